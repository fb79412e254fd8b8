# Run on the working tree of 014ad3a + the masked incoming loads (b690c7d); the probe found the epilogue merge 0.997-1.18x the time of the default at every point, so the default (MGPU_MERGE="auto") stays.
"""Session 10 probe: the Mosaic GPU decode path's merge, in one run per point:
default (MGPU_MERGE="auto": one launch where planned, else independent + XLA merge),
indep (forced independent, only where default is the one launch), and epi (the suffix kernel
merges the prefix partials in its epilogue, now reading only the G real rows of each)."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
pts = [(256, 4096, 64, 32, 8), (256, 4096, 128, 32, 8), (256, 4096, 256, 32, 8),
       (256, 16384, 64, 32, 8), (256, 16384, 256, 32, 8), (512, 8192, 128, 32, 8),
       (1024, 4096, 64, 32, 8), (1024, 4096, 128, 32, 8), (1024, 16384, 256, 32, 8),
       (1024, 4096, 64, 8, 1), (1024, 4096, 256, 8, 1), (1024, 16384, 256, 8, 1),
       (256, 16384, 1024, 8, 1), (256, 4096, 64, 8, 1), (256, 4096, 256, 8, 1),
       (256, 16384, 256, 8, 1)]
res = []
budget = float(os.environ.get("PROBE_BUDGET", "250"))
for (b, p, s, hq, hkv) in pts:
    if time.time() - t0 > budget:
        print("budget reached", flush=True); break
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    plan = pa.one_launch_plan(b, hq, hkv, p, s, 128, jnp.bfloat16)
    ref = None
    for v in ["default"] + (["indep"] if plan is not None else []) + ["epi"]:
        pa.MGPU_MERGE = {"default": "auto", "indep": "independent", "epi": "epilogue"}[v]
        f = ours("shared")
        try:
            out = jax.jit(f)(*args)
            ref = out if ref is None else ref
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:]) * 1e3
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:300]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, variant=v, one_launch=plan is not None, ms=t,
                 floor_ms=fl, over_floor=t / fl if isinstance(t, float) else None, maxdiff=err)
        print(json.dumps(r), flush=True)
        res.append(r)
pa.MGPU_MERGE = "auto"
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_epi.json", "w"), indent=1)
print("\n%-24s %-8s %8s %7s %8s" % ("point", "variant", "ms", "/floor", "/default"))
base = {}
for r in res:
    k = (r["b"], r["p"], r["s"], r["hq"]); ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    base.setdefault(k, ms)
    print("%-24s %-8s %8.4f %7.2f %8.3f" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["variant"], ms, ms / r["floor_ms"], ms / base[k]))
