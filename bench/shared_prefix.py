"""Shared-prefix decode attention benchmark (Hydragen Fig. 4 grid), GPU.

Columns, all measured in one run (bf16, Tq = 1, every suffix full):

* ``shared``: ours, ``impl="shared"``: the shared family's leaf the planner picks for the point
  on this GPU (recorded as ``shared_path``; ``docs/dispatch.md``): on a Hopper GPU the Mosaic GPU
  prefix kernel with the suffix kernel or a one-launch / joint / role-split leaf, elsewhere the
  Triton prefix kernel + suffix kernel (2 launches) or, below 2048 (sequence, kv head) pairs, one
  launch of interleaved prefix and suffix programs + XLA merge;
* ``path_<leaf>`` (``--cols``, e.g. ``path_triton_overlap``): ours with that leaf forced
  (``plan_shared_prefix(..., path=leaf)``); a leaf that cannot run a point records the reason;
* ``flat``: ours, ``impl="flat"``: one ragged split-KV decode launch reading the prefix through
  ``seq_to_prefix`` for every sequence (no copy: "flat over shared storage"), in the queries'
  own layout or the row layout as the planner decides (``flat_path``);
* ``flat_gqa``: JAX's ``pallas.ops.gpu.decode_attention.gqa`` over materialised
  per-sequence KV ``[B, P + S, Hkv, D]`` (built outside the timed region);
* ``composed``: the Hydragen decomposition from JAX's deprecated ops:
  ``attention.mha`` on the prefix (all sequences' query heads as rows) +
  ``decode_attention.gqa`` on the suffixes + an XLA merge;
* ``auto``: ours with ``impl="auto"``: the planner's pick between the two families by its cost
  model from static shapes (``auto_choice``, its leaf ``auto_path``).  It runs exactly the chosen
  family's plan, so by default its time is recorded as that column's measured time
  (``auto_ms_source``) instead of compiling the same kernels again (``--measure-auto`` times it
  separately);
* ``flat_materialised``: our flat kernel over materialised per-sequence KV (each sequence its
  own prefix copy, so no L2 reuse): the decode kernel's bandwidth, at a few points;
* ``floor``: ``max(bytes / copy bandwidth, flops / bf16 matmul rate)`` with bytes = the prefix
  once + every suffix + q and out, flops = ``4 * B * Hq * (P + S) * D``; both rates measured here
  (``floor_read_ms``: the same with the read-only bandwidth of an XLA reduction).

Timing (``bench.timing.loop_time``): each function runs ``n`` times inside one jitted
``fori_loop`` whose iterations depend on each other (the output perturbs the next query), median
of 3 such calls divided by ``n``.  ``n`` is a compile-time constant (a traced trip count costs a
host synchronisation per iteration), and every column's loop is compiled with
``bench.timing.GRAPH_ALWAYS`` (the loop body one CUDA graph, as inside a model's decode step;
XLA's default graphs only bodies of at least 5 kernels and launches paths with fewer kernels one
by one).
Point sets: the three probe points (Hq=32/Hkv=8, suffix 128); the small-GQA case (``SMALL_GQA``:
Hq=8/Hkv=1, batch 8, prefix 4000, suffixes 64/256/1024; records marked ``small_gqa``), where the
auto path must not lose to plain decoding; then the grid.
Points that do not fit in memory are recorded as ``"X"``; points not reached within the time
budget as ``"skipped"``.  Each finished point is appended to the JSON as it completes.
``--smoke``: tiny shapes, every kernel in Pallas interpret mode (CPU), planned as on an H100 SXM.

Usage: ``python bench/shared_prefix.py --out results.json [--quick] [--tune] [--budget-s 420]``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import (GRAPH_ALWAYS, device_info, gpu_slug, is_oom, loop_time,  # noqa: E402
                          measure_copy_bandwidth, measure_matmul_rate, time_fn)
from jax_prefix_attn import leaf_plans  # noqa: E402
from jax_prefix_attn import device_info as jpa_device_info  # noqa: E402
from jax_prefix_attn import plan_shared_prefix, shared_prefix_attention  # noqa: E402
from jax_prefix_attn.device import H100_SXM  # noqa: E402
from jax_prefix_attn.reference import row_limits  # noqa: E402
from pallas_kernels._common import next_pow2, q_rows_layout, row_meta, rows_from_q, seq_rows  # noqa: E402
from pallas_kernels.decode_attention import Source, ragged_attention  # noqa: E402
from pallas_kernels.prefix_attention import prefix_partials  # noqa: E402

HEADS = [(32, 8, 128), (8, 1, 128)]
BATCH = [16, 64, 256, 1024]
PREFIX = [1024, 4096, 16384]
SUFFIX = [64, 256, 1024]
PROBES = [(256, 4096, 128), (512, 8192, 128), (1024, 4096, 128)]
# The small-GQA case, where a three-launch cascade loses to plain decoding in other libraries
# (8 query heads, 1 kv head, batch 8, prefix 4000: not a multiple of any tile), at three suffix
# lengths; records carry ``small_gqa: true`` and stay out of the heat map.
SMALL_GQA_HEADS = (8, 1, 128)
SMALL_GQA = [(8, 4000, 64), (8, 4000, 256), (8, 4000, 1024)]
COLS = ["shared", "flat", "flat_gqa", "composed", "auto", "flat_materialised"]
# Our flat kernel over materialised per-sequence KV (no L2 reuse of a shared prefix): the
# bandwidth test of the decode kernel, measured at these (batch, prefix) points only.
MATERIALISED_AT = {(64, 4096), (256, 4096)}
INTERPRET = False  # --smoke: every kernel in Pallas interpret mode on tiny shapes (CPU check)
READ_BW = [0.0]    # read-only bandwidth (bytes/s) measured in this run, for the second floor


def measure_read_bandwidth(nbytes: int) -> float:
    """Bytes/s of an XLA read-only reduction (sum) over ``nbytes`` of bf16."""
    x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    t = time_fn(f, [(x,)], warmup=3, iters=20, stat="min")
    del x
    return nbytes / t


def plan_device():
    """The device the plans are made for: this GPU, or (``--smoke``, interpret mode on the CPU)
    an H100 SXM, so that the planner takes the GPU's decisions."""
    return H100_SXM if INTERPRET else jpa_device_info()


def plan_for(b, p, s, hq, hkv, d, *, impl="auto", path=None, groups=1):
    """The planner's plan of a decode point (Tq = 1, bf16, ``groups`` prefixes of ``p`` keys)."""
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=groups,
                              prefix_len=p, suffix_len=s, dtype=jnp.bfloat16, impl=impl,
                              path=path, device=plan_device(), interpret=INTERPRET)


def prefix_rows(q, hkv, p, block_m):
    """The prefix kernel's operands as the two-launch leaf builds them for one prefix of ``p``
    keys: query rows ``[Hkv, M_pad, D]`` (``R2`` rows per sequence + the ``R16`` rows the suffix
    pass reads past the last one, padded to ``block_m``; the padding rows, zero queries, see
    the prefix like the last real row), row groups and row limits ``[M_pad]``; and ``M``."""
    b, hq, _ = q.shape
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    m = b * r2
    m_pad = -(-(m + r16) // block_m) * block_m
    qp = jnp.pad(rows_from_q(q[:, None], hkv, r2), ((0, 0), (0, m_pad - m), (0, 0)))
    return qp, jnp.zeros((m_pad,), jnp.int32), jnp.full((m_pad,), p, jnp.int32), m


def tune_large_m(doc):
    """Sweep the prefix kernel's tiling for unsplit (large-M) prefixes on this GPU; records the
    sweep, the fastest setting and the library's: the planning device's ``large_m_tiling``
    (``leaf_plans.tuning``; which it does not change: a faster setting is adopted by editing
    the part's data file, ``jax_prefix_attn/device_data/``)."""
    b, p, hq, hkv, d = 1024, 4096, 32, 8, 128
    q, pk, pv, _, _, _ = make_inputs(b, p, 64, hkv, hq, d)
    qp, grp, lim, m = prefix_rows(q, hkv, p, 128)
    res = []
    for bk, nw, ns in [(64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 4, 2)]:
        cfg = dict(block_m=128, block_k=bk, num_splits=1, num_warps=nw, num_stages=ns,
                   two_phase=True)

        def f(qp, pk, pv, grp, lim, cfg=cfg):
            o, _ = prefix_partials(qp, pk[None], pv[None], grp, lim, scale=0.088, **cfg)
            return o[0].astype(qp.dtype)
        try:
            t = loop_time(f, qp, (pk, pv, grp, lim), target_s=0.02)
            res.append(dict(block_k=bk, num_warps=nw, num_stages=ns, ms=t * 1e3,
                            tflops=4.0 * m * hkv * p * d / t / 1e12))
        except Exception as e:  # noqa: BLE001
            res.append(dict(block_k=bk, num_warps=nw, num_stages=ns, error=str(e)[:200]))
        print("large-M tiling", res[-1], flush=True)
    ok = [x for x in res if "ms" in x]
    if ok:
        best = min(ok, key=lambda x: x["ms"])
        doc["large_m_tiling_fastest"] = {k: best[k] for k in ("block_k", "num_warps", "num_stages")}
    doc["large_m_tiling_sweep"] = res
    doc["large_m_tiling"] = dict(zip(("block_k", "num_warps", "num_stages"),
                                     leaf_plans.tuning(plan_device()).large_m_tiling))


# ----------------------------------------------------------------------------- columns

def ours(plan):
    """Our ``shared_prefix_attention`` of a decode point run by ``plan``: ``q [B, Hq, D]`` ->
    ``out [B, Hq, D]``."""
    def f(q, pk, pv, sk, sv, sl):
        out = shared_prefix_attention(q[:, None], pk, pv, sk, sv, suffix_lengths=sl, plan=plan,
                                      interpret=INTERPRET)
        return out[:, 0]
    return f


def _k_splits(n, block_k=64, want=16):
    blocks = n // block_k
    best = 1
    for d in range(1, blocks + 1):
        if blocks % d == 0 and abs(d - want) < abs(best - want):
            best = d
    return best


def flat_gqa(q, k_full, v_full, lens):
    from jax.experimental.pallas.ops.gpu import decode_attention as jda
    n = k_full.shape[1]
    return jda.gqa(q, k_full, v_full, kv_seq_len=lens, k_splits=_k_splits(n), block_k=64,
                   interpret=INTERPRET)


def composed(q, pk, pv, sk, sv, sl):
    """Hydragen from JAX's deprecated ops: mha (prefix, inter-sequence rows) + gqa + XLA merge."""
    from jax.experimental.pallas.ops.gpu import attention as jat
    from jax.experimental.pallas.ops.gpu import decode_attention as jda
    b, hq, d = q.shape
    p, hkv = pk.shape[0], pk.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    rows = b * g
    qp = q.reshape(b, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, rows, d)
    qp = qp.transpose(1, 0, 2)[None]  # [1, rows, Hkv, D]
    # (mha needs the prefix length to be a multiple of block_k: the largest power of two <= 128
    # dividing it, e.g. 32 for the small-GQA prefix of 4000)
    bk = p if p <= 128 else min(128, p & -p)
    if bk < 16 and p > 128:
        raise ValueError(f"composed: no mha key block of >= 16 divides the prefix length {p}")
    bs = jat.BlockSizes(block_q=min(128, rows), block_k=bk, block_q_dkv=32,
                        block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    o_p, lse2 = jat.mha(qp, pk[None], pv[None], None, sm_scale=scale, block_sizes=bs,
                        return_residuals=True, interpret=INTERPRET)
    o_p = o_p[0].transpose(1, 0, 2).reshape(hkv, b, g, d).transpose(1, 0, 2, 3).reshape(b, hq, d)
    lse_p = (lse2[0] * math.log(2.0)).reshape(hkv, b, g).transpose(1, 0, 2).reshape(b, hq)
    s = sk.shape[1]
    o_s, (l_s, m_s) = jda.gqa(q, sk, sv, kv_seq_len=sl, k_splits=_k_splits(s, 16, 16),
                              block_k=16 if s < 256 else 64, return_residuals=True,
                              interpret=INTERPRET)
    lse_s = m_s + jnp.log(l_s)
    m = jnp.maximum(lse_p, lse_s)
    wp, ws = jnp.exp(lse_p - m), jnp.exp(lse_s - m)
    out = (wp[..., None] * o_p.astype(jnp.float32) + ws[..., None] * o_s.astype(jnp.float32))
    return (out / (wp + ws)[..., None]).astype(q.dtype)


# ----------------------------------------------------------------------------- one point

def floor_s(b, p, s, hq, hkv, d, bw, mma, itemsize=2):
    nbytes = (p + b * s) * 2 * hkv * d * itemsize + 2 * b * hq * d * itemsize
    flops = 4.0 * b * hq * (p + s) * d
    return max(nbytes / bw, flops / mma), nbytes, flops


def make_inputs(b, p, s, hkv, hq, d, seed=0):
    """``q [B, Hq, D]``, one prefix ``pk/pv [P, Hkv, D]``, suffixes ``sk/sv [B, S, Hkv, D]``
    (bf16, standard normal) and full suffix lengths ``[B]``."""
    shapes = ((b, hq, d), (p, hkv, d), (p, hkv, d), (b, s, hkv, d), (b, s, hkv, d))
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, pk, pv, sk, sv = (jax.random.normal(k, shape, jnp.bfloat16) for k, shape in zip(keys, shapes))
    return q, pk, pv, sk, sv, jnp.full((b,), s, jnp.int32)


def _maxdiff(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run_point(b, p, s, hq, hkv, d, bw, mma, cols=COLS, check=True, measure_auto=False):
    rec = dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv, head_dim=d)
    fl, nbytes, flops = floor_s(b, p, s, hq, hkv, d, bw, mma)
    rec.update(floor_ms=fl * 1e3, bytes=nbytes, flops=flops)
    plans = {impl: plan_for(b, p, s, hq, hkv, d, impl=impl) for impl in ("shared", "flat", "auto")}
    rec["shared_path"], rec["flat_path"] = plans["shared"].path, plans["flat"].path
    rec["auto_choice"], rec["auto_path"] = plans["auto"].impl, plans["auto"].path
    try:
        q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            return {**rec, **{c + "_ms": "X" for c in cols}}
        raise
    ref = None
    for c in cols:
        forced = f"path_{rec['shared_path']}"
        if c == "shared" and isinstance(rec.get(forced + "_ms"), float):
            rec["shared_ms"] = rec[forced + "_ms"]
            rec["shared_ms_source"] = forced + " (same plan)"
            continue
        if c == "flat_materialised" and (b, p) not in MATERIALISED_AT:
            continue
        if c == "auto" and not measure_auto:
            rec["auto_ms"] = rec.get(rec["auto_choice"] + "_ms", "not measured")
            rec["auto_ms_source"] = rec["auto_choice"] + " (same plan)"
            continue
        try:
            if c == "flat_materialised":
                pk_b = jnp.broadcast_to(pk[None], (b,) + pk.shape) + 0  # a real copy per sequence
                pv_b = jnp.broadcast_to(pv[None], (b,) + pv.shape) + 0
                s2p = jnp.arange(b, dtype=jnp.int32)
                plan_m = plan_for(b, p, s, hq, hkv, d, impl="flat", groups=b)

                def fm(q, pk_b, pv_b, sk, sv, sl, s2p):
                    out = shared_prefix_attention(q[:, None], pk_b, pv_b, sk, sv, suffix_lengths=sl,
                                                  seq_to_prefix=s2p, plan=plan_m,
                                                  interpret=INTERPRET)
                    return out[:, 0]
                t = loop_time(fm, q, (pk_b, pv_b, sk, sv, sl, s2p), compiler_options=GRAPH_ALWAYS)
                del pk_b, pv_b
            elif c in plans or c.startswith("path_"):
                plan = plans[c] if c in plans else plan_for(b, p, s, hq, hkv, d, path=c[5:])
                f = ours(plan)
                t = loop_time(f, q, (pk, pv, sk, sv, sl), compiler_options=GRAPH_ALWAYS)
                if check:
                    out = jax.jit(f)(q, pk, pv, sk, sv, sl)
                    if ref is None:
                        ref = out
                        # independent check of the first column against the pure-JAX reference
                        r_out = jax.jit(ours(plan_for(b, p, s, hq, hkv, d, impl="reference")))(
                            q, pk, pv, sk, sv, sl)
                        rec["maxdiff_vs_reference"] = _maxdiff(out, r_out)
                    rec[c + "_maxdiff_vs_shared"] = _maxdiff(out, ref)
            elif c == "flat_gqa":
                # A length that is no multiple of gqa's 64-key blocks (P = 4000 at the small-GQA
                # points) is padded with zeros to a multiple of 16 x 64 keys, so that the keys
                # split 16 ways (``_k_splits``); gqa's loop stops at the length, so the padding
                # is never read.  (Grid lengths are multiples of 64 and are not padded.)
                pad = ((0, 0), (0, -(p + s) % 1024 if (p + s) % 64 else 0), (0, 0), (0, 0))
                k_full = jnp.pad(jnp.concatenate([jnp.broadcast_to(pk[None], (b,) + pk.shape), sk],
                                                 axis=1), pad)
                v_full = jnp.pad(jnp.concatenate([jnp.broadcast_to(pv[None], (b,) + pv.shape), sv],
                                                 axis=1), pad)
                lens = jnp.full((b,), p + s, jnp.int32)
                t = loop_time(flat_gqa, q, (k_full, v_full, lens), compiler_options=GRAPH_ALWAYS)
                if check and ref is not None:
                    rec[c + "_maxdiff_vs_shared"] = _maxdiff(jax.jit(flat_gqa)(q, k_full, v_full, lens),
                                                             ref)
                del k_full, v_full
            elif c == "composed":
                t = loop_time(composed, q, (pk, pv, sk, sv, sl), compiler_options=GRAPH_ALWAYS)
                if check and ref is not None:
                    rec[c + "_maxdiff_vs_shared"] = _maxdiff(jax.jit(composed)(q, pk, pv, sk, sv, sl),
                                                             ref)
            else:
                raise ValueError(f"unknown column {c!r}")
            rec[c + "_ms"] = t * 1e3
        except Exception as e:  # noqa: BLE001
            if is_oom(e):
                rec[c + "_ms"] = "X"
            else:
                rec[c + "_ms"] = "error"
                rec[c + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=2)
    sh = rec.get("shared_ms")
    if isinstance(sh, float):
        rec["shared_over_floor"] = sh / rec["floor_ms"]
        for c in cols:
            if c != "shared" and isinstance(rec.get(c + "_ms"), float):
                rec[f"{c}_over_shared"] = rec[c + "_ms"] / sh
    flat_bytes = b * (p + s) * 2 * hkv * d * 2 + 2 * b * hq * d * 2
    for c in ("flat", "flat_gqa", "flat_materialised"):
        if isinstance(rec.get(c + "_ms"), float):
            rec[c + "_bw_frac_of_copy"] = flat_bytes / (rec[c + "_ms"] * 1e-3) / bw
    if isinstance(rec.get("flat_materialised_ms"), float):
        rec["flat_materialised_bw_frac_of_read"] = flat_bytes / (rec["flat_materialised_ms"] * 1e-3) / READ_BW[0]
    if READ_BW[0]:
        rec["floor_read_ms"] = floor_s(b, p, s, hq, hkv, d, READ_BW[0], mma)[0] * 1e3
    return rec


# ----------------------------------------------------------------------------- tuning

def tune(bw, mma, out):
    """Time the prefix kernel and the suffix kernel alone, and the flat path (row layout), for
    a few tilings at two points."""
    res = []
    for (b, p, s, hq, hkv) in [(256, 4096, 128, 32, 8), (64, 4096, 256, 8, 1)]:
        d = 128
        q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
        r, r16 = q_rows_layout(1, hq, hkv)
        r2 = next_pow2(r)
        _, lim_s = row_limits(1, jnp.full((b,), p, jnp.int32), sl)
        base = dataclasses.asdict(leaf_plans.prefix_tiling(b, r, hkv, p, 2 * plan_device().sm_count))
        for bm in (64, 128):
            for bk in (32, 64, 128):
                for nw, ns in ((4, 2), (8, 2), (8, 3)):
                    cfg = dict(base, block_m=max(bm, r2), block_k=bk, num_warps=nw, num_stages=ns)
                    qp, grp, lim, m = prefix_rows(q, hkv, p, cfg["block_m"])

                    def f(qp, pk, pv, grp, lim, cfg=cfg):
                        o, _ = prefix_partials(qp, pk[None], pv[None], grp, lim, scale=0.088, **cfg)
                        return o[0, :, :qp.shape[1]].astype(qp.dtype)
                    try:
                        t = loop_time(f, qp, (pk, pv, grp, lim), target_s=0.02)
                        fl = 4.0 * m * hkv * p * d
                        res.append(dict(kind="prefix", batch=b, prefix=p, heads_q=hq, **cfg,
                                        ms=t * 1e3, tflops=fl / t / 1e12))
                    except Exception as e:  # noqa: BLE001
                        res.append(dict(kind="prefix", batch=b, **cfg, error=str(e)[:200]))
                    print(res[-1], flush=True)
        qs = rows_from_q(q[:, None], hkv, r16)
        idx = seq_rows(np.arange(b, dtype=np.int32), r16)
        lim = row_meta(lim_s, hq // hkv, r16)
        for bk in (32, 64, 128):
            for ns in (2, 3):
                def g(qs, sk, sv, idx, lim, bk=bk, ns=ns):
                    o, _ = ragged_attention(qs, [Source(sk, sv, idx, lim)], scale=0.088,
                                            block_m=r16, block_k=bk, finalize=True, num_warps=4,
                                            num_stages=ns)
                    return o
                try:
                    t = loop_time(g, qs, (sk, sv, idx, lim), target_s=0.02)
                    nb = b * s * 2 * hkv * d * 2
                    res.append(dict(kind="suffix", batch=b, suffix=s, block_k=bk, num_stages=ns,
                                    num_warps=4, ms=t * 1e3, bw_frac=nb / t / bw))
                except Exception as e:  # noqa: BLE001
                    res.append(dict(kind="suffix", batch=b, block_k=bk, error=str(e)[:200]))
                print(res[-1], flush=True)
        # the flat path in the row layout, its leaf's tiling replaced in the plan
        flat = plan_for(b, p, s, hq, hkv, d, path="flat_rows")
        for bk in (64, 128):
            for ns in (2, 3):
                for nw in (4, 8):
                    leaf = dataclasses.replace(flat.chunks[0].leaf, block_k=bk, num_warps=nw,
                                               num_stages=ns)
                    plan = dataclasses.replace(flat, chunks=(dataclasses.replace(flat.chunks[0],
                                                                                 leaf=leaf),))
                    try:
                        t = loop_time(ours(plan), q, (pk, pv, sk, sv, sl), target_s=0.02)
                        nb = b * (p + s) * 2 * hkv * d * 2
                        res.append(dict(kind="flat", batch=b, prefix=p, suffix=s, block_k=bk,
                                        num_stages=ns, num_warps=nw, ms=t * 1e3, bw_frac=nb / t / bw))
                    except Exception as e:  # noqa: BLE001
                        res.append(dict(kind="flat", batch=b, block_k=bk, error=str(e)[:200]))
                    print(res[-1], flush=True)
    with open(out, "w") as fh:
        json.dump(dict(info=device_info(), copy_bw=bw, matmul_rate=mma, tune=res), fh, indent=1)


# ----------------------------------------------------------------------------- heat map

def heatmap(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(HEADS), figsize=(7 * len(HEADS), 4.8))
    for ax, (hq, hkv, d) in zip(np.atleast_1d(axes), HEADS):
        cols = [(p, s) for p in PREFIX for s in SUFFIX]
        grid = np.full((len(BATCH), len(cols)), np.nan)
        labels = np.full(grid.shape, "", dtype=object)
        for r in results:
            if (r.get("heads_q"), r.get("heads_kv")) != (hq, hkv) or r.get("probe"):
                continue
            if r["batch"] not in BATCH or (r["prefix"], r["suffix"]) not in cols:
                continue
            i, j = BATCH.index(r["batch"]), cols.index((r["prefix"], r["suffix"]))
            sp = r.get("flat_gqa_over_shared")
            if sp is not None:
                grid[i, j] = sp
                labels[i, j] = f"{sp:.1f}"
            else:
                labels[i, j] = ("X (OOM)" if r.get("flat_gqa_ms") == "X" or r.get("shared_ms") == "X"
                                else "not\nmeasured")
        im = ax.imshow(np.log2(grid), cmap="viridis", aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, labels[i, j] or "not\nmeasured", ha="center", va="center",
                        color="w" if np.isfinite(grid[i, j]) else "k", fontsize=7)
        ax.set_xticks(range(len(cols)), [f"P{p // 1024}K\nS{s}" for p, s in cols], fontsize=7)
        ax.set_yticks(range(len(BATCH)), [str(b) for b in BATCH])
        ax.set_ylabel("batch")
        ax.set_title(f"speedup shared vs flat gqa (JAX), Hq={hq} Hkv={hkv} D={d}")
        fig.colorbar(im, ax=ax, label="log2 speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(doc):
    print("\nprobe points (Hq=32 Hkv=8 D=128 suffix 128):")
    for r in doc["results"]:
        if r.get("probe") and isinstance(r.get("shared_ms"), float):
            ratios = ", ".join(f"{c}/shared={r[c + '_over_shared']:.2f}" for c in
                               ("flat", "flat_gqa", "composed", "auto") if c + "_over_shared" in r)
            read = (f"; {r['shared_ms'] / r['floor_read_ms']:.2f}x read-bw floor"
                    if isinstance(r.get("floor_read_ms"), float) else "")
            print(f"  B={r['batch']} P={r['prefix']}: shared ({r.get('shared_path')}) "
                  f"{r['shared_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms "
                  f"({r['shared_over_floor']:.2f}x floor{read}), {ratios}")
    small = [r for r in doc["results"] if r.get("small_gqa") and isinstance(r.get("auto_ms"), float)]
    if small:
        print("small GQA points (where a cascade must not lose to plain decoding):")
    for r in small:
        cols = ", ".join(f"{c} {r[c + '_ms'] * 1e3:.1f} us" for c in
                         ("shared", "flat", "flat_gqa", "composed", "auto")
                         if isinstance(r.get(c + "_ms"), float))
        ratios = ", ".join(f"/ {c} {r['auto_ms'] / r[c + '_ms']:.3f}" for c in
                           ("shared", "flat", "flat_gqa", "composed")
                           if isinstance(r.get(c + "_ms"), float))
        print(f"  Hq={r['heads_q']} Hkv={r['heads_kv']} B={r['batch']} P={r['prefix']} "
              f"S={r['suffix']}: {cols}; auto ({r['auto_choice']}) {ratios}")
    print(f"auto worst ratio to the better path: {doc.get('auto_worst_over_best')}")


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a small subset of the grid")
    ap.add_argument("--tune", action="store_true", help="kernel tiling sweep only")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--measure-auto", action="store_true")
    ap.add_argument("--tune-large-m", action="store_true")
    ap.add_argument("--cols", default=",".join(COLS),
                    help="comma-separated columns; path_<leaf> forces a leaf of the planner")
    ap.add_argument("--resume", action="store_true",
                    help="keep the points already measured in --out, measure the rest (each record "
                         "carries the rates of the run that measured it)")
    ap.add_argument("--redo", nargs="+", default=[], metavar="B:P:S:HQ",
                    help="with --resume: measure these points again (all their columns, in this "
                         "run) even though --out has them")
    args = ap.parse_args()
    redo = {tuple(int(x) for x in spec.split(":")) for spec in args.redo}
    global INTERPRET, HEADS, BATCH, PREFIX, SUFFIX, PROBES, SMALL_GQA, SMALL_GQA_HEADS
    if args.smoke:
        INTERPRET = True
        HEADS, BATCH, PREFIX, SUFFIX, PROBES = [(4, 2, 16)], [2], [128], [64], [(2, 128, 64)]
        SMALL_GQA_HEADS, SMALL_GQA = (4, 1, 16), [(3, 100, 64)]
    t_start = time.time()
    out = args.out or f"bench/results/shared_prefix_{gpu_slug()}.json"
    bw = measure_copy_bandwidth(1 << 24 if args.smoke else 2 << 30)
    mma = measure_matmul_rate(256 if args.smoke else 8192)
    READ_BW[0] = measure_read_bandwidth(1 << 24 if args.smoke else 4 << 30)
    print(f"read-only bandwidth {READ_BW[0] / 1e12:.2f} TB/s", flush=True)
    print(f"device {device_info()['device']}: copy {bw / 1e12:.2f} TB/s, matmul {mma / 1e12:.0f} TFLOP/s",
          flush=True)
    if args.tune:
        tune(bw, mma, out)
        return
    pts = []
    for (b, p, s) in PROBES:
        pts.append((b, p, s) + HEADS[0] + (True,))
    small = {(b, p, s) + SMALL_GQA_HEADS for (b, p, s) in SMALL_GQA}
    pts += [x + (False,) for x in sorted(small)]
    grid = [(b, p, s, hq, hkv, d, False) for (hq, hkv, d) in HEADS for b in BATCH for p in PREFIX
            for s in SUFFIX]
    if args.quick:
        grid = [x for x in grid if x[1] == 4096 and x[2] in (64, 1024) and x[0] in (16, 256)]
    # Most informative first: large batch / prefix (the targets), then the rest.
    grid.sort(key=lambda x: (-(x[0] >= 256 and x[1] >= 4096), x[3] != 32, -x[0], -x[1], x[2]))
    pts += grid
    doc = dict(info=device_info(), copy_bw_Bps=bw, matmul_flops=mma, read_bw_Bps=READ_BW[0],
               columns=args.cols.split(","), notes=__doc__, results=[])
    done = {}
    if args.resume and os.path.exists(out):
        with open(out) as fh:
            old = json.load(fh)
        for k, v in old.items():  # notes added to the file by hand (keys ending in "_note")
            if k.endswith("_note"):
                doc[k] = v
        doc["earlier_runs"] = old.get("earlier_runs", []) + [
            {k: old.get(k) for k in ("info", "copy_bw_Bps", "matmul_flops", "read_bw_Bps")}]
        for r in old["results"]:
            if "status" not in r:
                r.setdefault("run", len(doc["earlier_runs"]) - 1)
                done[(r["batch"], r["prefix"], r["suffix"], r["heads_q"], r["heads_kv"], r["head_dim"],
                      bool(r.get("probe")))] = r
    if not args.smoke and args.tune_large_m:
        tune_large_m(doc)
    for (b, p, s, hq, hkv, d, probe) in pts:
        if (b, p, s, hq, hkv, d, probe) in done and (b, p, s, hq) not in redo:
            doc["results"].append(done[(b, p, s, hq, hkv, d, probe)])
            continue
        if time.time() - t_start > args.budget_s:
            if (b, p, s, hq, hkv, d, probe) in done:  # a --redo point not reached: keep the old run
                doc["results"].append(done[(b, p, s, hq, hkv, d, probe)])
                continue
            doc["results"].append(dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv,
                                       head_dim=d, probe=probe, status="skipped (time budget)"))
            continue
        t0 = time.time()
        is_small = (b, p, s, hq, hkv, d) in small
        rec = run_point(b, p, s, hq, hkv, d, bw, mma, cols=args.cols.split(","),
                        check=not args.no_check and (probe or is_small or b == 16),
                        measure_auto=args.measure_auto)
        rec["probe"] = probe
        if is_small:
            rec["small_gqa"] = True
        rec["wall_s"] = time.time() - t0
        if args.resume:
            rec["run"] = len(doc.get("earlier_runs", []))
        doc["results"].append(rec)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                          if k not in ("notes",)}), flush=True)
    # Summary: auto against the better path, then probes and auto.
    worst = None
    for r in doc["results"]:
        a, sh, fl = r.get("auto_ms"), r.get("shared_ms"), r.get("flat_ms")
        if all(isinstance(x, float) for x in (a, sh, fl)):
            ratio = a / min(sh, fl)
            r["auto_over_best"] = ratio
            worst = ratio if worst is None else max(worst, ratio)
    doc["auto_worst_over_best"] = worst
    summarize(doc)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    try:
        heatmap(doc["results"], os.path.splitext(out)[0] + ".png")
    except Exception as e:  # noqa: BLE001
        print("heat map failed:", e)


if __name__ == "__main__":
    main()
