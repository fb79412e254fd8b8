"""Session 6 probe: Hq=8/Hkv=1 (and small-B Hq=32) shared path, Triton backend vs the Mosaic GPU
prefix kernel forced on, at several prefix splits."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
pts = [(256, 4096, 64, 8, 1), (256, 16384, 64, 8, 1), (256, 16384, 1024, 8, 1), (256, 4096, 256, 8, 1),
       (64, 16384, 64, 8, 1), (1024, 4096, 64, 8, 1), (64, 16384, 64, 32, 8), (64, 4096, 256, 32, 8)]
settings = [("triton", None), ("mgpu", None), ("mgpu", 4), ("mgpu", 8), ("mgpu", 16)]
res = []
t_start = time.time()
for (b, p, s, hq, hkv) in pts:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    ref = None
    for backend, splits in settings:
        if time.time() - t_start > 300:
            break
        pa.MGPU_SPLITS = splits
        f = ours("shared", backend=backend)
        try:
            out = jax.jit(f)(*args)
            if ref is None:
                ref = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:]) * 1e3
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:300]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, backend=backend, splits=splits, ms=t, floor_ms=fl,
                 max_abs_diff=err)
        print(json.dumps(r), flush=True)
        res.append(r)
pa.MGPU_SPLITS = None
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/probe_hq8.json", "w"), indent=1)
print("\n%-22s %-7s %6s %8s %7s" % ("point", "backend", "splits", "ms", "/floor"))
for r in res:
    ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    print("%-22s %-7s %6s %8.4f %7.2f" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["backend"],
          r["splits"], ms, ms / r["floor_ms"]))
