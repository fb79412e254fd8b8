"""Where the shared path's time goes (GPU): its two launches timed apart, and the prefix kernel's
backends (Triton ``prefix_partials`` vs the Mosaic GPU ``prefix_partials_mgpu``) side by side.

For each point (Tq = 1, one prefix, every suffix full, bf16), all in one run:

* ``shared_triton_ms`` / ``shared_mgpu_ms`` / ``shared_mgpu_nosched_ms``: the whole shared path
  with ``PREFIX_BACKEND = "triton"`` / ``"mgpu"`` / ``"mgpu"`` without the ping-pong schedule
  barrier;
* ``prefix_triton_ms`` / ``prefix_mgpu_ms[...]``: launch 1 alone (prefix partials), the Mosaic
  GPU kernel at a few ``(num_splits, schedule_barrier)`` settings, with its achieved
  TFLOP/s (``4 * rows * P * D`` flops per kv head);
* ``suffix_merge_ms``: launch 2 alone (suffix decode + merge of fixed prefix partials) at the
  first setting of ``SUFFIX_SETTINGS`` (64-key tiles, 4 warps, 3 stages: the tiling before
  session 4; the shared path now uses ``prefix_attention.DECODE_SUFFIX_TILING``), with its
  bandwidth as a fraction of the copy bandwidth, and
  ``suffix_merge_ms[bk=,w=,st=]`` the sweep of its ``(block_k, num_warps, num_stages)`` at points
  with short suffixes;
* ``floor_ms``: as in ``bench/shared_prefix.py``.

Every Mosaic GPU result is checked against the Triton partials (merged over splits) in the same
run.  Usage: ``python bench/shared_breakdown.py --out res.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from bench.shared_prefix import floor_s, make_inputs, ours  # noqa: E402
from pallas_kernels import prefix_attention as pa  # noqa: E402
from pallas_kernels import prefix_attention_mgpu as pm  # noqa: E402
from pallas_kernels.decode_attention import (cdiv, merge_partials, next_pow2, q_rows_layout,  # noqa: E402
                                             rows_from_q)

POINTS = [(256, 4096, 128, 32, 8, 128), (512, 8192, 128, 32, 8, 128), (1024, 4096, 128, 32, 8, 128),
          (256, 4096, 1024, 32, 8, 128), (64, 16384, 64, 32, 8, 128), (256, 16384, 64, 8, 1, 128)]
# (num_splits, schedule_barrier) of the Mosaic GPU prefix kernel alone
MGPU_SETTINGS = [(None, True), (1, True), (2, True), (4, True), (8, True), (None, False),
                 (2, False)]
# (block_k, num_warps, num_stages) of the suffix pass (launch 2) alone; the first is the pre-session-4 tiling
SUFFIX_SETTINGS = [(64, 4, 3), (64, 4, 2), (32, 4, 2), (32, 4, 3), (32, 2, 3), (64, 8, 3),
                   (128, 4, 1), (128, 4, 2), (128, 8, 2), (16, 2, 4)]
SUFFIX_SWEEP_MAX_S = 256  # sweep the suffix settings only at points with short suffixes


def _err(e):
    return f"{type(e).__name__}: {str(e)[:1500]}"


def run_point(b, p, s, hq, hkv, d, bw, mma):
    rec = dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv, head_dim=d)
    rec["floor_ms"] = floor_s(b, p, s, hq, hkv, d, bw, mma)[0] * 1e3
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    scale = d ** -0.5
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    m = b * r2
    cfg = pa.prefix_config(b, r, hkv, p)
    rec["triton_cfg"] = cfg
    m_pad = cdiv(m + r16, cfg["block_m"]) * cfg["block_m"]
    qp = jnp.pad(rows_from_q(q[:, None], hkv, r2), ((0, 0), (0, m_pad - m), (0, 0)))
    grp_rows = jnp.zeros((m_pad,), jnp.int32)
    lim_rows = jnp.full((m_pad,), p, jnp.int32)
    prefix_flops = 4.0 * hkv * m * p * d

    # whole shared path, both backends (mgpu with and without its ping-pong schedule barrier)
    for name, backend, sched in (("shared_triton", "triton", True), ("shared_mgpu", "mgpu", True),
                                 ("shared_mgpu_nosched", "mgpu", False)):
        try:
            f0 = ours("shared", backend=backend)

            def f(*a, f0=f0, sched=sched):
                old = pa.MGPU_SCHEDULE_BARRIER
                pa.MGPU_SCHEDULE_BARRIER = sched
                try:
                    return f0(*a)
                finally:
                    pa.MGPU_SCHEDULE_BARRIER = old
            rec[name + "_ms"] = loop_time(f, q, (pk, pv, sk, sv, sl)) * 1e3
            out = jax.jit(f)(q, pk, pv, sk, sv, sl)
            ref = jax.jit(ours("reference"))(q, pk, pv, sk, sv, sl)
            rec[name + "_maxdiff_vs_reference"] = float(jnp.max(jnp.abs(
                out.astype(jnp.float32) - ref.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001
            rec[name + "_ms"] = "error"
            rec[name + "_error"] = _err(e)
            traceback.print_exc(limit=3)

    # launch 1 alone: Triton prefix partials
    def tri(qp, pk, pv):
        o, lse = pa.prefix_partials(qp, pk[None], pv[None], grp_rows, lim_rows, scale=scale,
                                    block_m=cfg["block_m"], block_k=cfg["block_k"],
                                    num_splits=cfg["num_splits"], num_warps=cfg["num_warps"],
                                    num_stages=cfg["num_stages"],
                                    two_phase=cfg.get("two_phase", False))
        return o, lse
    o_t, l_t = jax.jit(tri)(qp, pk, pv)
    o_ref, l_ref = merge_partials(o_t[:, :, :m], l_t[:, :, :m])
    t = loop_time(lambda qp, pk, pv: tri(qp, pk, pv)[0][0].astype(qp.dtype), qp, (pk, pv)) * 1e3
    rec["prefix_triton_ms"] = t
    rec["prefix_triton_tflops"] = prefix_flops / (t * 1e-3) / 1e12

    # launch 1 alone: Mosaic GPU prefix partials
    m128 = cdiv(m, 128) * 128  # as the shared path: no padding row block
    out_rows = max(m128, m - r2 + r16)
    qm = jnp.pad(qp, ((0, 0), (0, m128 - m_pad), (0, 0))) if m128 > m_pad else qp[:, :m128]
    mgpu_parts = None
    for splits, sched in MGPU_SETTINGS:
        key = f"prefix_mgpu_ms[splits={splits},sched={int(sched)}]"
        try:
            def mg(qm, pk, pv, splits=splits, sched=sched):
                return pm.prefix_partials_mgpu(qm, pk, pv, jnp.int32(p), scale=scale,
                                               num_splits=splits, schedule_barrier=sched,
                                               out_rows=out_rows)
            o_m, l_m = jax.jit(mg)(qm, pk, pv)
            if splits is None and sched:
                mgpu_parts = (o_m, l_m)
            o_mm, l_mm = merge_partials(o_m[:, :, :m].astype(jnp.float32), l_m[:, :, :m])
            rel = float(jnp.linalg.norm(o_mm - o_ref) / jnp.linalg.norm(o_ref))
            lse_diff = float(jnp.max(jnp.abs(l_mm - l_ref)))
            t = loop_time(lambda qm, pk, pv: mg(qm, pk, pv)[0][0][:, :qm.shape[1]], qm, (pk, pv)) * 1e3
            rec[key] = t
            rec[key.replace("_ms", "_tflops")] = prefix_flops / (t * 1e-3) / 1e12
            rec[key.replace("_ms", "_rel_err")] = rel
            rec[key.replace("_ms", "_lse_maxdiff")] = lse_diff
        except Exception as e:  # noqa: BLE001
            rec[key] = "error"
            rec[key.replace("_ms", "_error")] = _err(e)
            traceback.print_exc(limit=3)

    # launch 2 alone: suffix decode merging fixed prefix partials (the Mosaic GPU kernel's
    # bf16 partials, as in the default path, when it ran; else the Triton ones)
    o_in, l_in = mgpu_parts if mgpu_parts is not None else (o_t, l_t)
    rec["suffix_partials_from"] = "mgpu" if mgpu_parts is not None else "triton"
    suf_bytes = b * s * 2 * hkv * d * 2 + 2 * b * hq * d * 2
    rec["suffix_floor_ms"] = suf_bytes / bw * 1e3
    settings = SUFFIX_SETTINGS if s <= SUFFIX_SWEEP_MAX_S else SUFFIX_SETTINGS[:1]
    for bk, nw, ns in settings:
        def suf(q, sk, sv, sl, bk=bk, nw=nw, ns=ns):
            lim_s = sl[:, None]
            out, _ = pa._suffix_with_merge(q[:, None], sk, sv, lim_s, o_in, l_in, None, None, b=b,
                                           tq=1, hq=hq, hkv=hkv, r=r, r2=r2, r16=r16, scale=scale,
                                           interpret=False, two_phase=False,
                                           suffix_block_k=bk, suffix_warps=nw, suffix_stages=ns,
                                           suffix_splits=None)
            return out[:, 0]
        key = f"suffix_merge_ms[bk={bk},w={nw},st={ns}]"
        try:
            t = loop_time(suf, q, (sk, sv, sl)) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[key] = "error"
            rec[key.replace("_ms", "_error")] = _err(e)
            continue
        rec[key] = t
        if (bk, nw, ns) == SUFFIX_SETTINGS[0]:
            rec["suffix_merge_ms"] = t
            rec["suffix_merge_bw_frac_of_copy"] = suf_bytes / (t * 1e-3) / bw
    rec["prefix_floor_ms"] = max(p * 2 * hkv * d * 2 / bw, 4.0 * b * hq * p * d / mma) * 1e3
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--max-points", type=int, default=len(POINTS), help="first N points only")
    args = ap.parse_args()
    t0 = time.time()
    bw = measure_copy_bandwidth(2 << 30)
    mma = measure_matmul_rate(8192)
    doc = dict(info=device_info(), copy_bw_Bps=bw, matmul_flops=mma, notes=__doc__, results=[])
    print(f"copy {bw / 1e12:.2f} TB/s, matmul {mma / 1e12:.0f} TFLOP/s", flush=True)
    for pt in POINTS[:args.max_points]:
        if time.time() - t0 > args.budget_s:
            doc["results"].append(dict(zip(("batch", "prefix", "suffix", "heads_q", "heads_kv",
                                            "head_dim"), pt), status="skipped (time budget)"))
            continue
        try:
            rec = run_point(*pt, bw, mma)
        except Exception as e:  # noqa: BLE001
            rec = dict(zip(("batch", "prefix", "suffix", "heads_q", "heads_kv", "head_dim"), pt),
                       status="error", error=_err(e))
            traceback.print_exc(limit=3)
        doc["results"].append(rec)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                          if "error" not in k}), flush=True)
    print("\nb p s hq/hkv | floor | shared_triton | shared_mgpu | nosched | prefix tri (TF/s) | best mgpu (TF/s) | suffix+merge (BW) | best suffix")
    for r in doc["results"]:
        if "floor_ms" not in r:
            continue
        mg = [(v, k) for k, v in r.items() if k.startswith("prefix_mgpu_ms") and isinstance(v, float)]
        best = min(mg) if mg else (float("nan"), "-")
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"{r['batch']} {r['prefix']} {r['suffix']} {r['heads_q']}/{r['heads_kv']} | "
              f"{r['floor_ms']:.3f} | {fmt(r.get('shared_triton_ms'))} | {fmt(r.get('shared_mgpu_ms'))} | "
              f"{fmt(r.get('shared_mgpu_nosched_ms'))} | "
              f"{fmt(r.get('prefix_triton_ms'))} ({r.get('prefix_triton_tflops', 0):.0f}) | "
              f"{best[0]:.3f} {best[1][14:]} ({r.get(best[1].replace('_ms', '_tflops'), 0):.0f}) | "
              f"{fmt(r.get('suffix_merge_ms'))} ({r.get('suffix_merge_bw_frac_of_copy', 0):.2f}) | "
              f"{min(sw) if (sw := [(round(v, 4), k[15:]) for k, v in r.items() if k.startswith('suffix_merge_ms[') and isinstance(v, float)]) else '-'}")


if __name__ == "__main__":
    main()
