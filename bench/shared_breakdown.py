"""Where the shared path's time goes (GPU): its launches timed apart, and the prefix kernels
(Triton ``prefix_partials`` vs the Mosaic GPU ``prefix_partials_mgpu``) side by side.

For each point (Tq = 1, one prefix, every suffix full, bf16), all in one run:

* ``shared_ms``: the whole shared path as the planner runs it (leaf ``shared_path``);
  ``shared_triton_ms`` / ``shared_mgpu_ms``: with the Triton two-launch leaf (or, below the
  device's ``overlap_below_programs`` (sequence, kv head) pairs, the overlap leaf) / the Mosaic
  GPU two-launch leaf forced (``plan_shared_prefix(..., path=...)``), and
  ``shared_mgpu_stream_ms`` with the all-Mosaic two-launch leaf (``mgpu_stream_two_launch``:
  the stream-only Mosaic GPU suffix launch in place of the Triton one), each checked against
  the reference;
* ``prefix_triton_ms`` / ``prefix_mgpu_ms[...]``: the prefix launch alone (prefix partials),
  Triton with the planner's tiling, the Mosaic GPU kernel at a few ``(num_splits,
  schedule_barrier)`` settings (``None``: the planner's splits), with achieved TFLOP/s
  (``4 * rows * P * D`` flops per kv head);
* ``suffix_merge_ms``: the suffix launch alone (the decode suffix kernel merging fixed prefix
  partials in its epilogue) with the planner's tiling (``leaf_plans.decode_suffix_tiling``), its
  bandwidth as a fraction of the copy bandwidth, and ``suffix_merge_ms[bk=,w=,st=]`` a sweep of
  its ``(block_k, num_warps, num_stages)`` at points with short suffixes;
* ``floor_ms``: as in ``bench/shared_prefix.py``.

Every Mosaic GPU result is checked against the Triton partials (merged over splits) in the same
run.  Usage: ``python bench/shared_breakdown.py --out res.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.shared_prefix import floor_s, make_inputs, ours, plan_device, plan_for, prefix_rows  # noqa: E402
from bench.timing import device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from jax_prefix_attn import leaf_plans  # noqa: E402
from jax_prefix_attn.plans import Shapes  # noqa: E402
from pallas_kernels._common import cdiv, merge_partials, next_pow2, q_rows_layout  # noqa: E402
from pallas_kernels.prefix_attention import prefix_partials  # noqa: E402
from pallas_kernels.prefix_attention_mgpu import prefix_partials_mgpu  # noqa: E402
from pallas_kernels.suffix_attention import suffix_decode_merge  # noqa: E402

POINTS = [(256, 4096, 128, 32, 8, 128), (512, 8192, 128, 32, 8, 128), (1024, 4096, 128, 32, 8, 128),
          (256, 4096, 1024, 32, 8, 128), (64, 16384, 64, 32, 8, 128), (256, 16384, 64, 8, 1, 128)]
# (num_splits, schedule_barrier) of the Mosaic GPU prefix kernel alone (None: the planner's)
MGPU_SETTINGS = [(None, True), (1, True), (2, True), (4, True), (8, True), (None, False),
                 (2, False)]
# (block_k, num_warps, num_stages) of the suffix launch alone, swept after the planner's tiling
SUFFIX_SETTINGS = [(64, 4, 3), (64, 4, 2), (32, 4, 2), (32, 4, 3), (64, 8, 3), (128, 4, 1),
                   (128, 4, 2), (128, 8, 2), (16, 2, 4)]
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
    dev = plan_device()
    cfg = dataclasses.asdict(leaf_plans.prefix_tiling(b, r, hkv, p, 2 * dev.sm_count))
    rec["triton_cfg"] = cfg
    qp, grp_rows, lim_rows, m = prefix_rows(q, hkv, p, cfg["block_m"])
    prefix_flops = 4.0 * hkv * m * p * d

    # the whole shared path: the planner's leaf, and the Triton and Mosaic GPU leaves forced
    overlap_below = leaf_plans.tuning(dev).overlap_below_programs
    triton = "triton_overlap" if b * hkv < overlap_below else "triton_two_launch"
    ref = jax.jit(ours(plan_for(b, p, s, hq, hkv, d, impl="reference")))(q, pk, pv, sk, sv, sl)
    for name, path in (("shared", None), ("shared_triton", triton),
                       ("shared_mgpu", "mgpu_two_launch"),
                       ("shared_mgpu_stream", "mgpu_stream_two_launch")):
        try:
            plan = plan_for(b, p, s, hq, hkv, d, impl="shared", path=path)
            rec[name + "_path"] = plan.path
            f = ours(plan)
            rec[name + "_ms"] = loop_time(f, q, (pk, pv, sk, sv, sl)) * 1e3
            out = jax.jit(f)(q, pk, pv, sk, sv, sl)
            rec[name + "_maxdiff_vs_reference"] = float(jnp.max(jnp.abs(
                out.astype(jnp.float32) - ref.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001
            rec[name + "_ms"] = "error"
            rec[name + "_error"] = _err(e)
            traceback.print_exc(limit=3)

    # the prefix launch alone: Triton prefix partials
    def tri(qp, pk, pv):
        return prefix_partials(qp, pk[None], pv[None], grp_rows, lim_rows, scale=scale, **cfg)
    o_t, l_t = jax.jit(tri)(qp, pk, pv)
    o_ref, l_ref = merge_partials(o_t[:, :, :m], l_t[:, :, :m])
    t = loop_time(lambda qp, pk, pv: tri(qp, pk, pv)[0][0].astype(qp.dtype), qp, (pk, pv)) * 1e3
    rec["prefix_triton_ms"] = t
    rec["prefix_triton_tflops"] = prefix_flops / (t * 1e-3) / 1e12

    # the prefix launch alone: Mosaic GPU prefix partials
    m128 = cdiv(m, 128) * 128  # as the shared path: no padding row block
    out_rows = max(m128, m - r2 + r16)
    m_pad = qp.shape[1]
    qm = jnp.pad(qp, ((0, 0), (0, m128 - m_pad), (0, 0))) if m128 > m_pad else qp[:, :m128]
    planned_splits = leaf_plans.mgpu_splits(Shapes(b, 1, hq, hkv, d, 1, p, s, "bfloat16"), dev)
    mgpu_parts = None
    for splits, sched in MGPU_SETTINGS:
        key = f"prefix_mgpu_ms[splits={splits},sched={int(sched)}]"
        try:
            def mg(qm, pk, pv, splits=splits, sched=sched):
                return prefix_partials_mgpu(qm, pk, pv, jnp.int32(p), scale=scale,
                                            num_splits=planned_splits if splits is None else splits,
                                            schedule_barrier=sched, out_rows=out_rows)
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

    # the suffix launch alone: the decode suffix kernel merging fixed prefix partials (the Mosaic
    # GPU kernel's 16-bit partials, as in the Mosaic GPU leaves, when it ran; else the Triton ones)
    o_in, l_in = mgpu_parts if mgpu_parts is not None else (o_t, l_t)
    rec["suffix_partials_from"] = "mgpu" if mgpu_parts is not None else "triton"
    suf_bytes = b * s * 2 * hkv * d * 2 + 2 * b * hq * d * 2
    rec["suffix_floor_ms"] = suf_bytes / bw * 1e3
    planned = dataclasses.astuple(leaf_plans.decode_suffix_tiling(dev))
    settings = [planned] + ([x for x in SUFFIX_SETTINGS if x != planned]
                            if s <= SUFFIX_SWEEP_MAX_S else [])
    for bk, nw, ns in settings:
        def suf(q, sk, sv, sl, bk=bk, nw=nw, ns=ns):
            out, _ = suffix_decode_merge(q, sk, sv, sl, (o_in, l_in), in_stride=r2, scale=scale,
                                         block_k=bk, num_warps=nw, num_stages=ns)
            return out
        key = f"suffix_merge_ms[bk={bk},w={nw},st={ns}]"
        try:
            t = loop_time(suf, q, (sk, sv, sl)) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[key] = "error"
            rec[key.replace("_ms", "_error")] = _err(e)
            continue
        rec[key] = t
        if (bk, nw, ns) == planned:
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
    print("\nb p s hq/hkv | floor | shared (path) | shared_triton | shared_mgpu | shared_mgpu_stream | prefix tri (TF/s) | best mgpu (TF/s) | suffix+merge (BW) | best suffix")
    for r in doc["results"]:
        if "floor_ms" not in r:
            continue
        mg = [(v, k) for k, v in r.items() if k.startswith("prefix_mgpu_ms") and isinstance(v, float)]
        best = min(mg) if mg else (float("nan"), "-")
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"{r['batch']} {r['prefix']} {r['suffix']} {r['heads_q']}/{r['heads_kv']} | "
              f"{r['floor_ms']:.3f} | {fmt(r.get('shared_ms'))} ({r.get('shared_path')}) | "
              f"{fmt(r.get('shared_triton_ms'))} | {fmt(r.get('shared_mgpu_ms'))} | "
              f"{fmt(r.get('shared_mgpu_stream_ms'))} | "
              f"{fmt(r.get('prefix_triton_ms'))} ({r.get('prefix_triton_tflops', 0):.0f}) | "
              f"{best[0]:.3f} {best[1][14:]} ({r.get(best[1].replace('_ms', '_tflops'), 0):.0f}) | "
              f"{fmt(r.get('suffix_merge_ms'))} ({r.get('suffix_merge_bw_frac_of_copy', 0):.2f}) | "
              f"{min(sw) if (sw := [(round(v, 4), k[15:]) for k, v in r.items() if k.startswith('suffix_merge_ms[') and isinstance(v, float)]) else '-'}")


if __name__ == "__main__":
    main()
