"""Session 22 out-of-sample check of the role-split dispatch (``prefix_attention.SPLIT_REGIONS``):
at shapes inside the region that the fit did not use, the default shared path (which now takes
the role split, ``plan_roles``'s CTAs) against the same path with the split switched off
(``SPLIT_REGIONS = ()``: what the default did before), interleaved, in one process.

Per point: ``split_ms`` / ``before_ms`` (the better of two interleaved rounds of ``loop_time``),
the max |difference| of the outputs, and the plan.  One JSON line per point, a table last.
Env: COMMIT, BUDGET_S (default 300)."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention as pa

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "300"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
REGIONS = pa.SPLIT_REGIONS
POINTS = [(32, 8, 512, 4096, 128), (32, 8, 768, 8192, 192), (32, 8, 2048, 4096, 128),
          (32, 8, 1024, 8192, 256), (32, 8, 512, 16384, 128), (32, 8, 640, 4096, 64)]
if os.environ.get("POINTS"):   # indices (the second run: POINTS=4,5, the two the first skipped)
    POINTS = [POINTS[int(i)] for i in os.environ["POINTS"].split(",")]
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
rows = []
for hq, hkv, b, p, s in POINTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    d = 128
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    rest = (pk, pv, sk, sv, sl)
    rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, floor_ms=floor_s(b, p, s, hq, hkv, d, bw, mma)[0] * 1e3,
               plan=pa.split_plan(b, hq, hkv, p, s, d, jnp.bfloat16))
    f = ours("shared")
    outs, times = {}, {"split": [], "before": []}
    for rnd in range(2):
        for name, regions in (("split", REGIONS), ("before", ())):
            pa.SPLIT_REGIONS = regions
            try:
                if rnd == 0:
                    outs[name] = jax.jit(f)(q, *rest).astype(jnp.float32)
                times[name].append(loop_time(f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3)
            finally:
                pa.SPLIT_REGIONS = REGIONS
    rec["maxdiff"] = float(jnp.max(jnp.abs(outs["split"] - outs["before"])))
    rec.update({f"{k}_ms": min(v) for k, v in times.items()}, rounds=times)
    rec["split_over_before"] = rec["split_ms"] / rec["before_ms"]
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor | split before split/before | plan")
for r in rows:
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f | %.4f %.4f %.3f |" % (
        r["floor_ms"], r["split_ms"], r["before_ms"], r["split_over_before"]), r["plan"])
