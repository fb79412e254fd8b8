"""Session 18 probe: the Mosaic GPU prefix kernel with 3 K/V pipeline stages (the LSE stored
from registers, which frees the 512 bytes a third stage lacked at D = 128) against the default 2,
at the issue-4 target points (B >= 256, P >= 4K) and the probes: the prefix kernel alone and the
whole shared path (``impl="shared"``), interleaved in one process (rounds alternate the two
settings), GRAPH_ALWAYS loops as in bench/shared_prefix.py.  Output: one JSON line per point."""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention as pa
from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels.decode_attention import cdiv, merge_partials, next_pow2, rows_from_q

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "470"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
bw, mma = measure_copy_bandwidth(), measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)

POINTS = [(256, 4096, 128, 32, 8), (512, 8192, 128, 32, 8), (1024, 4096, 128, 32, 8)]
POINTS += [(b, p, s, hq, hkv) for hq, hkv in ((32, 8), (8, 1)) for b in (256, 1024)
           for p in (4096, 16384) for s in (64, 256, 1024)]
ROUNDS = 2
RECS = []


def prefix_alone(q, pk, pv, hq, hkv, stages):
    b, _, d = q.shape
    r2 = next_pow2(hq // hkv)
    m = b * r2
    m128 = cdiv(m, 128) * 128
    qm = jnp.pad(rows_from_q(q[:, None], hkv, r2), ((0, 0), (0, m128 - m), (0, 0)))
    splits = pa.mgpu_decode_splits(b, hq, hkv, pk.shape[0], d, 2)

    def f(qm, pk, pv):
        return pm.prefix_partials_mgpu(qm, pk, pv, jnp.int32(pk.shape[0]), scale=d ** -0.5,
                                       num_splits=splits, max_concurrent_steps=stages)
    return f, qm, splits


for b, p, s, hq, hkv in POINTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(stopped="budget", at=[b, p, s, hq, hkv])), flush=True)
        break
    d = 128
    fl, nbytes, flops = floor_s(b, p, s, hq, hkv, d, bw, mma)
    rec = dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv, floor_ms=fl * 1e3)
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    times = {k: [] for k in ("pre2", "pre3", "sh2", "sh3")}
    try:
        outs = {}
        for st in (2, 3):
            f, qm, splits = prefix_alone(q, pk, pv, hq, hkv, st)
            o, l = jax.jit(f)(qm, pk, pv)
            outs[st] = merge_partials(o.astype(jnp.float32), l)
            rec["splits"] = splits
            pm.PIPELINE_STAGES = st
            outs[f"sh{st}"] = jax.jit(ours("shared"))(q, pk, pv, sk, sv, sl).astype(jnp.float32)
        pm.PIPELINE_STAGES = 2
        rec["prefix_maxdiff_3v2"] = float(jnp.max(jnp.abs(outs[3][0][:, :b * next_pow2(hq // hkv)]
                                                          - outs[2][0][:, :b * next_pow2(hq // hkv)])))
        rec["lse_maxdiff_3v2"] = float(jnp.max(jnp.abs(outs[3][1][:, :b * next_pow2(hq // hkv)]
                                                       - outs[2][1][:, :b * next_pow2(hq // hkv)])))
        rec["shared_maxdiff_3v2"] = float(jnp.max(jnp.abs(outs["sh3"] - outs["sh2"])))
        for _ in range(ROUNDS):
            for st in (2, 3):
                f, qm, _s = prefix_alone(q, pk, pv, hq, hkv, st)
                times[f"pre{st}"].append(loop_time(lambda qm, pk, pv, f=f: f(qm, pk, pv)[0][0],
                                                   qm, (pk, pv), compiler_options=GRAPH_ALWAYS))
                pm.PIPELINE_STAGES = st
                times[f"sh{st}"].append(loop_time(ours("shared"), q, (pk, pv, sk, sv, sl),
                                                  compiler_options=GRAPH_ALWAYS))
                pm.PIPELINE_STAGES = 2
        for k, v in times.items():
            rec[k + "_ms"] = statistics.median(v) * 1e3
        pf = 4.0 * b * hq * p * d
        rec["pre2_tflops"] = pf / (rec["pre2_ms"] * 1e-3) / 1e12
        rec["pre3_tflops"] = pf / (rec["pre3_ms"] * 1e-3) / 1e12
        rec["sh2_over_floor"] = rec["sh2_ms"] / rec["floor_ms"]
        rec["sh3_over_floor"] = rec["sh3_ms"] / rec["floor_ms"]
        rec["sh3_over_sh2"] = rec["sh3_ms"] / rec["sh2_ms"]
        rec["pre3_over_pre2"] = rec["pre3_ms"] / rec["pre2_ms"]
    except Exception as e:  # noqa: BLE001
        pm.PIPELINE_STAGES = 2
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    RECS.append(rec)
    print(json.dumps(rec), flush=True)
    del q, pk, pv, sk, sv, sl

print("point (Hq/Hkv B P S) | splits | pre2 TF | pre3/pre2 | sh3/sh2 | sh2/floor | sh3/floor")
for r in RECS:
    if "error" in r:
        print(r["heads_q"], r["batch"], r["prefix"], r["suffix"], r["error"][:120])
        continue
    print(f"{r['heads_q']}/{r['heads_kv']} {r['batch']} {r['prefix']} {r['suffix']} | {r['splits']} | "
          f"{r['pre2_tflops']:.0f} | {r['pre3_over_pre2']:.3f} | {r['sh3_over_sh2']:.3f} | "
          f"{r['sh2_over_floor']:.2f} | {r['sh3_over_floor']:.2f}")
