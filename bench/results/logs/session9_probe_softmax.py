"""Session 9 probe: the Mosaic GPU prefix kernel alone, old softmax (mask on every tile, scale
before the max) vs new (fused multiply-add form, mask only on tiles that hold a masked key),
pipeline depth 2 vs 3, at the grid's compute-bound shapes; same run, TFLOP/s vs the measured
matmul rate.  Then the whole shared path (new code) at the region's compute-bound points."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
import jax, jax.numpy as jnp, numpy as np
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention_mgpu as pm
# pm_old: the kernel module before session 9, not kept in the repository (it is git history):
#   git show 6d6d587:pallas_kernels/prefix_attention_mgpu.py > .gpu/pm_old.py
import pm_old

t_start = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
shapes = [  # (label, hkv, m, p)
    ("Hq32 B256 P16K", 8, 1024, 16384), ("Hq32 B1024 P16K", 8, 4096, 16384),
    ("Hq32 B1024 P4K", 8, 4096, 4096), ("Hq32 B256 P4K", 8, 1024, 4096),
    ("Hq8 B1024 P16K", 1, 8192, 16384), ("Hq8 B1024 P4K", 1, 8192, 4096),
]
res = []
for label, hkv, m, p in shapes:
    rng = np.random.default_rng(m + p)
    q = jnp.asarray(rng.standard_normal((hkv, m, 128), np.float32), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((p, hkv, 128), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((p, hkv, 128), np.float32), jnp.bfloat16)
    flops = 4.0 * hkv * m * p * 128
    ref = None
    for name, mod, steps, n in [("old", pm_old, 2, p), ("new", pm, 2, p), ("new_s3", pm, 3, p),
                                ("new_masked", pm, 2, p - 5)]:
        def f(q, k, v, mod=mod, steps=steps, n=n):
            o, lse = mod.prefix_partials_mgpu(q, k, v, jnp.int32(n), scale=128 ** -0.5,
                                              max_concurrent_steps=steps)
            return o[0]
        try:
            out = jax.jit(f)(q, k, v)
            if ref is None:
                ref = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, q, (k, v))
            r = dict(shape=label, variant=name, ms=t * 1e3, tflops=flops / t / 1e12,
                     frac_of_matmul=flops / t / mma, max_abs_diff_vs_old=err)
        except Exception as e:
            r = dict(shape=label, variant=name, error=f"{type(e).__name__}: {e}"[:500])
        print(json.dumps(r), flush=True)
        res.append(r)

# whole shared path at the region's compute-bound points (new code)
from bench.shared_prefix import make_inputs, ours, floor_s
import pallas_kernels.prefix_attention as pa
for (b, p, s, hq, hkv) in [(256, 16384, 64, 32, 8), (256, 16384, 256, 32, 8), (1024, 16384, 256, 32, 8),
                           (1024, 4096, 64, 32, 8), (256, 4096, 64, 32, 8), (1024, 16384, 256, 8, 1),
                           (1024, 4096, 64, 8, 1), (256, 4096, 128, 32, 8), (512, 8192, 128, 32, 8),
                           (1024, 4096, 128, 32, 8)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    f = ours("shared")
    t = loop_time(f, args[0], args[1:]) * 1e3
    r = dict(shape=f"path Hq{hq} B{b} P{p} S{s}", variant="shared", ms=t, floor_ms=fl, over_floor=t / fl)
    print(json.dumps(r), flush=True)
    res.append(r)
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res, elapsed=time.time() - t_start),
          open(os.environ["OUT"] + "/probe_softmax.json", "w"), indent=1)
print("\n%-34s %-11s %8s %8s %7s" % ("shape", "variant", "ms", "TFLOP/s", "/floor"))
for r in res:
    print("%-34s %-11s %8.4f %8s %7s" % (r["shape"], r["variant"], r.get("ms", float("nan")),
          "%.0f" % r["tflops"] if "tflops" in r else "", "%.2f" % r["over_floor"] if "over_floor" in r else ""))
