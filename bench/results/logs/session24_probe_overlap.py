"""Session 24 probe (ran at commit c18de32, which had the option ``overlapped`` of
``prefix_attention_mgpu.prefix_partials_mgpu`` and the flag ``OVERLAPPED``; measured slower and
removed again, so this script does not run at later commits): the prefix kernel's
intra-warpgroup overlapped schedule
(``prefix_attention_mgpu.prefix_tile_step_overlapped``, ``overlapped=True``: the previous tile's
``P V`` runs on the tensor cores during the softmax of the next tile), in one process.

Part A, the prefix kernel alone (``prefix_partials_mgpu``) per shape: the default schedule and
the overlapped one, each with and without the ping-pong barrier, 2 and 3 stages; the max
|difference| of each variant's merged partials to the default's, and its relative error to a
float32 reference.  Part B, the whole default shared path with ``OVERLAPPED`` False / True /
False again at grid points (every kernel that runs ``prefix_task``).  One JSON line per shape,
tables last.  Env: COMMIT, BUDGET_S (default 480), A (shape indices), B (point indices)."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels.decode_attention import merge_partials

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

SHAPES_A = [  # (hkv, rows M, p, splits)
    (8, 4096, 16384, 1),    # Hq=32 B=1024 P=16K (unsplit: 256 CTAs)
    (8, 2048, 8192, 4),     # Hq=32 B=512 P=8K
    (8, 4096, 4096, 1),     # Hq=32 B=1024 P=4K
    (1, 8192, 16384, 2),    # Hq=8 B=1024 P=16K
    (1, 8192, 4096, 2),     # Hq=8 B=1024 P=4K
    (8, 1024, 4096, 4),     # Hq=32 B=256 P=4K
]
POINTS_B = [  # (hq, hkv, b, p, s)
    (32, 8, 1024, 16384, 256),
    (8, 1, 1024, 16384, 256),
    (8, 1, 1024, 4096, 256),
    (32, 8, 512, 8192, 128),
    (32, 8, 256, 16384, 256),
    (8, 1, 256, 16384, 1024),
    (32, 8, 1024, 4096, 64),
]
A = [SHAPES_A[int(i)] for i in os.environ.get("A", "0,1,2,3,4,5").split(",") if i]
B = [POINTS_B[int(i)] for i in os.environ.get("B", "0,1,2,3,4,5,6").split(",") if i]
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
VARIANTS = [("base", dict(overlapped=False)), ("ov", dict(overlapped=True)),
            ("ov_nosched", dict(overlapped=True, schedule_barrier=False)),
            ("ov_st3", dict(overlapped=True, max_concurrent_steps=3)),
            ("base_again", dict(overlapped=False))]


def partials(p, splits, kw):
    def f(q, k, v):
        return pm.prefix_partials_mgpu(q, k, v, jnp.full((1,), p, jnp.int32),
                                       scale=q.shape[-1] ** -0.5, num_splits=splits, **kw)
    return f


def timed(p, splits, kw):
    def f(q, k, v):
        o, lse = partials(p, splits, kw)(q, k, v)
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
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    sc = jnp.einsum("hmd,phd->hmp", qf, kf, precision="highest") * 128 ** -0.5
    ro = jnp.einsum("hmp,phd->hmd", jax.nn.softmax(sc, axis=-1), vf, precision="highest")
    del sc
    rec = dict(hkv=hkv, m=m, p=p, splits=splits)
    base = None
    for name, kw in VARIANTS:
        try:
            o, lse = jax.jit(partials(p, splits, kw))(q, k, v)
            o, lse = merge_partials(o.astype(jnp.float32), lse)
            if base is None:
                base = o
            rec[f"rel_{name}"] = float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro))
            rec[f"maxdiff_{name}"] = float(jnp.max(jnp.abs(o - base)))
            t = loop_time(timed(p, splits, kw), q, (k, v), compiler_options=GRAPH_ALWAYS)
            rec[f"{name}_ms"], rec[f"{name}_tflops"] = t * 1e3, flops / t / 1e12
        except Exception as e:  # noqa: BLE001
            rec[f"error_{name}"] = f"{type(e).__name__}: {str(e)[:800]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows_a.append(rec)

rows_b = []
for hq, hkv, b, p, s in B:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    rest = (pk, pv, sk, sv, sl)
    rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, floor_ms=floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3)
    ref = None
    for name, flag in (("base", False), ("ov", True), ("base_again", False), ("ov_again", True)):
        pm.OVERLAPPED = flag
        try:
            f = ours("shared")
            f = (lambda f: lambda *a: f(*a))(f)  # a fresh function: traced with this flag
            out = jax.jit(f)(q, *rest).astype(jnp.float32)
            ref = out if ref is None else ref
            rec[f"maxdiff_{name}"] = float(jnp.max(jnp.abs(out - ref)))
            rec[f"{name}_ms"] = loop_time(f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[f"error_{name}"] = f"{type(e).__name__}: {str(e)[:800]}"
    pm.OVERLAPPED = False
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows_b.append(rec)

print("\nA: hkv m p splits | variant ms (TF/s, rel err vs f32, maxdiff vs base)")
for r in rows_a:
    print(r["hkv"], r["m"], r["p"], r["splits"])
    for name, _ in VARIANTS:
        if f"{name}_ms" in r:
            print("   %-11s %.4f (%4.0f, %.1e, %.1e)" % (name, r[f"{name}_ms"], r[f"{name}_tflops"],
                                                      r[f"rel_{name}"], r[f"maxdiff_{name}"]))
        else:
            print("   %-11s %s" % (name, r.get(f"error_{name}", "-")[:300]))
print("\nB: hq b p s | floor | base ov base_again ov_again (ms) | best ov / best base, /floor")
for r in rows_b:
    g = lambda k: r.get(k + "_ms", float("nan"))  # noqa: E731
    bb, bo = min(g("base"), g("base_again")), min(g("ov"), g("ov_again"))
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f | %.4f %.4f %.4f %.4f | %.3f %.2fx %.2fx" % (
        r["floor_ms"], g("base"), g("ov"), g("base_again"), g("ov_again"), bo / bb, bb / r["floor_ms"],
        bo / r["floor_ms"]), {k: v[:200] for k, v in r.items() if k.startswith("error")})
