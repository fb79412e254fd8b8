"""Session 24 probe: every existing form of the shared decode path, forced, at the issue-4 grid
points (B >= 256, P >= 4K) that miss 1.5x the floor, against the default (``MGPU_MERGE="auto"``)
in one process.  Forms: ``prefix_attention.MGPU_MERGE`` in independent / epilogue / one_launch /
joint / split (each where its kernel applies; an error is recorded where not), and the Triton
backend (``JPA_PREFIX_BACKEND=triton``, its own variant choice).  Per point each form is timed
once (``loop_time``, graphed), then the default and the fastest form again.  One JSON line per
point (max |difference| of each form's output to the default's), a table last.
Env: COMMIT, BUDGET_S (default 480), P (point indices)."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention as pa

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
POINTS = [  # (hq, hkv, b, p, s): the H200 grid's misses of 1.5x the floor (run 24)
    (8, 1, 1024, 4096, 256), (8, 1, 256, 16384, 1024), (8, 1, 1024, 16384, 256),
    (32, 8, 1024, 16384, 256), (8, 1, 256, 16384, 64), (32, 8, 256, 16384, 256),
    (32, 8, 1024, 4096, 64), (32, 8, 256, 4096, 64), (8, 1, 1024, 4096, 64),
    (8, 1, 256, 16384, 256), (8, 1, 256, 4096, 256), (8, 1, 256, 4096, 64),
]
PTS = [POINTS[int(i)] for i in os.environ.get("P", ",".join(map(str, range(len(POINTS))))).split(",") if i]
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
FORMS = [("default", "auto", None), ("independent", "independent", None),
         ("epilogue", "epilogue", None), ("one_launch", "one_launch", None),
         ("joint", "joint", None), ("split", "split", None), ("triton", "auto", "triton")]


def form_fn(merge, backend):
    base = ours("shared", backend=backend)

    def f(*a):
        old = pa.MGPU_MERGE
        pa.MGPU_MERGE = merge
        try:
            return base(*a)
        finally:
            pa.MGPU_MERGE = old
    return f


rows = []
for hq, hkv, b, p, s in PTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    rest = (pk, pv, sk, sv, sl)
    rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, floor_ms=floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3)
    ref = None
    for name, merge, backend in FORMS:
        if time.time() - T0 > BUDGET:
            break
        try:
            f = form_fn(merge, backend)
            out = jax.jit(f)(q, *rest).astype(jnp.float32)
            ref = out if ref is None else ref
            rec[f"maxdiff_{name}"] = float(jnp.max(jnp.abs(out - ref)))
            rec[f"{name}_ms"] = loop_time(f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[f"error_{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
    timed = {k[:-3]: v for k, v in rec.items() if k.endswith("_ms") and k != "floor_ms"}
    best = min((v, k) for k, v in timed.items() if k != "default")[1] if len(timed) > 1 else None
    if best is not None and time.time() - T0 < BUDGET:
        for name in ("default", best):
            merge, backend = next((m, bk) for n, m, bk in FORMS if n == name)
            rec[f"{name}_again_ms"] = loop_time(form_fn(merge, backend), q, rest,
                                                compiler_options=GRAPH_ALWAYS) * 1e3
    rec["best_other"] = best
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor | default (again) | best other form (again) | best/default, default/floor, best/floor")
for r in rows:
    g = lambda k: r.get(k + "_ms", float("nan"))  # noqa: E731
    bo = r["best_other"]
    d = min(g("default"), g("default_again"))
    o = min(g(bo), g(bo + "_again")) if bo else float("nan")
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f | %.4f (%.4f) | %s %.4f (%.4f) | %.3f %.2fx %.2fx" % (
        r["floor_ms"], g("default"), g("default_again"), bo, g(bo) if bo else float("nan"),
        g(bo + "_again") if bo else float("nan"), o / d, d / r["floor_ms"], o / r["floor_ms"]))
    print("    ", " ".join("%s=%.4f" % (k[:-3], v) for k, v in r.items()
                          if k.endswith("_ms") and "again" not in k and k not in ("floor_ms", "default_ms")),
          " errors:", [k[6:] for k in r if k.startswith("error_")])
