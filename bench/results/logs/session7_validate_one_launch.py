"""Session 7: the shared path's new default (MGPU_MERGE='auto': one launch where
one_launch_plan says so) against the session-6 default (independent launches) and the
composed-from-JAX-ops column, same run, at the grid points the rule touches plus P=1K/2K."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s, composed
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

BUDGET = float(os.environ.get("BUDGET", "330"))
t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
pts = [(256, 4096, 128, 32, 8), (1024, 4096, 128, 32, 8), (256, 4096, 256, 32, 8),
       (1024, 4096, 256, 32, 8), (1024, 4096, 256, 8, 1), (256, 2048, 256, 32, 8),
       (256, 2048, 128, 32, 8), (1024, 2048, 128, 8, 1), (256, 4096, 128, 32, 8)]
res = []
for (b, p, s, hq, hkv) in pts:
    if time.time() - t0 > BUDGET:
        break
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    plan = pa.one_launch_plan(b, hq, hkv, p, s, 128, jnp.bfloat16)
    row = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, floor_ms=fl, plan=plan)
    ref = None
    for col in ["independent", "auto", "composed"]:
        if col == "auto" and plan is None:
            continue
        if col == "composed":
            f = composed
        else:
            pa.MGPU_MERGE = col
            f = ours("shared")
        try:
            out = jax.jit(f)(*args)
            ref = out if ref is None else ref
            row[col + "_maxdiff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            row[col + "_ms"] = loop_time(f, args[0], args[1:]) * 1e3
        except Exception as e:
            row[col + "_ms"] = f"{type(e).__name__}: {e}"[:300]
    pa.MGPU_MERGE = "auto"
    row["elapsed"] = time.time() - t0
    print(json.dumps(row), flush=True)
    res.append(row)
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/" + os.environ.get("NAME", "validate_one_launch") + ".json", "w"), indent=1)
nan = float("nan")
g = lambda r, k: r.get(k) if isinstance(r.get(k), float) else nan
print("\n%-22s %8s %8s %8s %8s %7s %7s %7s" % ("point", "floor", "indep", "new", "composed", "new/fl", "new/ind", "comp/new"))
for r in res:
    new = g(r, "auto_ms") if r["plan"] else g(r, "independent_ms")
    print("%-22s %8.4f %8.4f %8.4f %8.4f %7.2f %7.2f %7.2f" % (
        f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["floor_ms"], g(r, "independent_ms"), new,
        g(r, "composed_ms"), new / r["floor_ms"], new / g(r, "independent_ms"), g(r, "composed_ms") / new))
