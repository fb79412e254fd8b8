"""Session 6 probe: the decode shared path with the Mosaic GPU prefix kernel, merge in the suffix
kernel's epilogue (two dependent launches) vs independent launches + XLA merge, under XLA's
default command-buffer scheduling and under CONCURRENT (per-jit compiler_options)."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

CONC = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_graph_min_graph_size": 1}
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
pts = [(256, 4096, 128, 32, 8), (512, 8192, 128, 32, 8), (1024, 4096, 128, 32, 8),
       (256, 16384, 128, 32, 8), (256, 4096, 256, 32, 8), (1024, 4096, 128, 8, 1)]
settings = [("epilogue", None, None), ("epilogue", None, "conc"), ("independent", None, None),
            ("independent", None, "conc"), ("independent", 1, "conc"), ("independent", 2, "conc"),
            ("independent", 4, "conc"), ("independent", 8, "conc")]
res = []
t_start = time.time()
for (b, p, s, hq, hkv) in pts:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    ref = None
    for merge, splits, opt in settings:
        if time.time() - t_start > 420:
            break
        pa.MGPU_MERGE, pa.MGPU_SPLITS = merge, splits
        f = ours("shared")
        co = CONC if opt else None
        try:
            out = jax.jit(f, compiler_options=co)(*args)
            if ref is None:
                ref = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:], compiler_options=co) * 1e3
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:400]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, merge=merge, splits=splits, opts=opt, ms=t, floor_ms=fl,
                 over_floor=(t / fl if isinstance(t, float) else None), max_abs_diff=err)
        print(json.dumps(r), flush=True)
        res.append(r)
pa.MGPU_MERGE, pa.MGPU_SPLITS = "epilogue", None
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/probe_concurrent.json", "w"), indent=1)
print("\n%-22s %-12s %6s %5s %8s %7s" % ("point", "merge", "splits", "opts", "ms", "/floor"))
for r in res:
    ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    print("%-22s %-12s %6s %5s %8.4f %7.2f" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["merge"],
          r["splits"], r["opts"], ms, ms / r["floor_ms"]))
