"""Session 9 probe, after the prefix kernel's softmax change: the shared path at the balanced
misses of the 1.5x-floor target with the default prefix splits, other splits (msN), and the
opt-in concurrent CUDA-graph scheduling (conc: CONCURRENT_COMPILER_OPTIONS), same run."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa
from jax_prefix_attn import CONCURRENT_COMPILER_OPTIONS

t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
pts = [(256, 16384, 64, 32, 8, ["ms2", "conc"]), (256, 16384, 256, 32, 8, ["ms2", "conc"]),
       (1024, 16384, 256, 32, 8, ["ms2", "conc"]), (512, 8192, 128, 32, 8, ["ms2", "conc"]),
       (1024, 4096, 64, 32, 8, ["ms2", "conc"]), (1024, 16384, 256, 8, 1, ["ms2", "ms8", "conc"]),
       (1024, 4096, 64, 8, 1, ["ms2", "conc"]), (256, 4096, 64, 32, 8, ["ms2", "conc"])]
res = []
for (b, p, s, hq, hkv, variants) in pts:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    ref = None
    for v in ["default"] + variants:
        pa.MGPU_SPLITS = int(v[2:]) if v.startswith("ms") else None
        opts = CONCURRENT_COMPILER_OPTIONS if v == "conc" else None
        f = ours("shared")
        try:
            out = jax.jit(f)(*args)
            ref = out if ref is None else ref
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:], compiler_options=opts) * 1e3
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:300]
        r = dict(b=b, p=p, s=s, hq=hq, variant=v, ms=t, floor_ms=fl,
                 over_floor=t / fl if isinstance(t, float) else None, maxdiff=err)
        print(json.dumps(r), flush=True)
        res.append(r)
pa.MGPU_SPLITS = None
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_splits9.json", "w"), indent=1)
print("\n%-24s %-8s %8s %7s %8s" % ("point", "variant", "ms", "/floor", "/default"))
base = {}
for r in res:
    k = (r["b"], r["p"], r["s"], r["hq"]); ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    base.setdefault(k, ms)
    print("%-24s %-8s %8.4f %7.2f %8.3f" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["variant"], ms, ms / r["floor_ms"], ms / base[k]))
