"""Session 23 probe (ran at commit e81ba7e, which had ``prefix_flat_tasks`` and the options
``persistent_flat`` / ``prefix_flat``; measured no faster and removed again, so this script does
not run at later commits): a persistent prefix CTA's tasks as ONE K/V pipeline
(``prefix_attention_mgpu.prefix_flat_tasks``: no pipeline fill or drain per task), in one process.

Part A, the prefix kernel alone (``prefix_partials_mgpu``), per shape: the grid form (one CTA a
task), the persistent round robin (``persistent_ctas=n``) and the flat form
(``persistent_flat=True``) on n = 132 CTAs and on the split's prefix CTA count, each with the max
|difference| to the grid form's partials.  Part B, the role split (``split_decode_mgpu``) with
and without ``prefix_flat`` at its planned CTAs (``plan_roles``; also the plan with the per-task
cost PLAN_TASK_S at TASK_S2), against the default shared path.  One JSON line per shape, tables
last.  Env: COMMIT, BUDGET_S (default 500), A (shape indices), B (point indices), TASK_S2."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import split_decode_mgpu as sd

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "500"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

SHAPES_A = [  # (hkv, rows M, p, splits)
    (8, 2048, 8192, 4),     # Hq=32 B=512 P=8K
    (8, 1024, 4096, 4),     # Hq=32 B=256 P=4K
    (8, 4096, 4096, 1),     # Hq=32 B=1024 P=4K
    (8, 4096, 16384, 2),    # Hq=32 B=1024 P=16K
    (1, 8192, 4096, 2),     # Hq=8 B=1024 P=4K
]
POINTS_B = [  # (hq, hkv, b, p, s)
    (32, 8, 512, 8192, 128),
    (32, 8, 1024, 4096, 128),
    (32, 8, 1024, 4096, 64),
    (32, 8, 1024, 16384, 256),
    (32, 8, 256, 4096, 128),
]
A = [SHAPES_A[int(i)] for i in os.environ.get("A", "0,1,2,3,4").split(",") if i]
B = [POINTS_B[int(i)] for i in os.environ.get("B", "0,1,2,3").split(",") if i]
TASK_S2 = float(os.environ.get("TASK_S2", "1.0e-6"))
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)


def prefix_fn(p, splits, ctas=None, flat=False):
    def f(q, k, v):
        o, lse = pm.prefix_partials_mgpu(q, k, v, jnp.full((1,), p, jnp.int32), scale=q.shape[-1] ** -0.5,
                                         num_splits=splits, persistent_ctas=ctas, persistent_flat=flat)
        return q + (o[0, :, :1, :1] * 0).astype(q.dtype) + (lse[0, :, :1, None] * 0).astype(q.dtype)
    return f


rows_a = []
for hkv, m, p, splits in A:
    if time.time() - T0 > BUDGET:
        break
    ks = jax.random.split(jax.random.PRNGKey(m + p), 3)
    q = jax.random.normal(ks[0], (hkv, m, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (p, hkv, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (p, hkv, 128), jnp.bfloat16)
    flops = 4.0 * hkv * m * p * 128
    rec = dict(hkv=hkv, m=m, p=p, splits=splits, tasks=hkv * (m // 128) * splits)
    ref = jax.jit(lambda q, k, v: pm.prefix_partials_mgpu(q, k, v, jnp.full((1,), p, jnp.int32),
                                                          scale=128 ** -0.5, num_splits=splits))(q, k, v)
    t = loop_time(prefix_fn(p, splits), q, (k, v), compiler_options=GRAPH_ALWAYS)
    rec["grid_ms"], rec["grid_tflops"] = t * 1e3, flops / t / 1e12
    for n in (132, 103):
        n = min(n, rec["tasks"])
        for flat in (False, True):
            key = f"{'flat' if flat else 'rr'}_n{n}"
            try:
                got = jax.jit(lambda q, k, v: pm.prefix_partials_mgpu(
                    q, k, v, jnp.full((1,), p, jnp.int32), scale=128 ** -0.5, num_splits=splits,
                    persistent_ctas=n, persistent_flat=flat))(q, k, v)
                rec[f"maxdiff_{key}"] = max(float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - ref[0].astype(jnp.float32)))),
                                            float(jnp.max(jnp.abs(got[1] - ref[1]))))
                t = loop_time(prefix_fn(p, splits, n, flat), q, (k, v), compiler_options=GRAPH_ALWAYS)
                rec[f"{key}_ms"], rec[f"{key}_tflops"] = t * 1e3, flops / t / 1e12
            except Exception as e:  # noqa: BLE001
                rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:500]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows_a.append(rec)


def split(n, sp, m, flat):
    def f(q, pk, pv, sk, sv, sl):
        return sd.split_decode_mgpu(q, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32), sk, sv, sl,
                                    prefix_ctas=n, stream_ctas=m, num_splits=sp, prefix_flat=flat)
    return f


rows_b = []
task0 = sd.PLAN_TASK_S
for hq, hkv, b, p, s in B:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    rest = (pk, pv, sk, sv, sl)
    rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, floor_ms=floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3)
    base_f = ours("shared")
    ref = jax.jit(base_f)(q, *rest).astype(jnp.float32)
    rec["base_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    plans = [sd.plan_roles(b, hq, hkv, p, s, 128)]
    sd.PLAN_TASK_S = TASK_S2
    if sd.plan_roles(b, hq, hkv, p, s, 128) not in plans:
        plans.append(sd.plan_roles(b, hq, hkv, p, s, 128))
    sd.PLAN_TASK_S = task0
    for (n, sp, m), flat in [(c, f) for c in plans for f in (False, True)]:
        if time.time() - T0 > BUDGET:
            break
        key = f"n{n}_s{sp}_m{m}" + ("_flat" if flat else "")
        try:
            out = jax.jit(split(n, sp, m, flat))(q, *rest).astype(jnp.float32)
            rec[f"maxdiff_{key}"] = float(jnp.max(jnp.abs(out - ref)))
            rec[f"split_{key}_ms"] = loop_time(split(n, sp, m, flat), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:500]}"
    rec["base_again_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows_b.append(rec)

print("\nA: prefix kernel alone | grid ms (TF/s) | variant ms (TF/s, maxdiff)")
for r in rows_a:
    print(r["hkv"], r["m"], r["p"], r["splits"], r["tasks"], "| %.4f (%.0f) |" % (r["grid_ms"], r["grid_tflops"]),
          " ".join("%s %.4f (%.0f, %.1g)" % (k[:-3], v, r[k[:-3] + "_tflops"], r.get("maxdiff_" + k[:-3], -1))
                   for k, v in r.items() if k.endswith("_ms") and k != "grid_ms"))
print("\nB: hq b p s | floor base base_again | split ms (/floor, /base)")
for r in rows_b:
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f %.4f %.4f |" % (r["floor_ms"], r["base_ms"], r["base_again_ms"]))
    bb = min(r["base_ms"], r["base_again_ms"])
    for k, v in r.items():
        if k.startswith("split_"):
            print("   %-24s %.4f (%.2fx floor, %.3fx base)" % (k[6:-3], v, v / r["floor_ms"], v / bb))
