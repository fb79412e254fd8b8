"""Session 8 probe: shared vs flat at small (latency-bound) shapes, with the overlap variant's
suffix now split like the fused variant's; the old overlap (suffix unsplit) at a few points.
Grid points (B <= 64, and Hq=8 B=256) first, then shapes outside the grid (not used to fit)."""
import functools, json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa
from jax_prefix_attn.cost_model import estimate

BUDGET = float(os.environ.get("BUDGET", "420"))
t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
H = [(32, 8), (8, 1)]
grid = [(b, p, s, hq, hkv) for (hq, hkv) in H for b in (16, 64) for p in (1024, 4096, 16384)
        for s in (64, 256, 1024)]
grid += [(256, p, s, 8, 1) for p in (1024, 4096, 16384) for s in (64, 256, 1024)]
oos = [(b, p, s, hq, hkv) for (hq, hkv) in H for b in (8, 32, 128) for p in (2048, 8192)
       for s in (128, 512)]
OLD = {(16, 4096, 1024, 8, 1), (16, 1024, 1024, 8, 1), (64, 1024, 1024, 8, 1),
       (16, 1024, 1024, 32, 8), (16, 16384, 1024, 32, 8)}
if os.environ.get("POINTS") == "validate":  # shapes not used to fit the cost model
    grid = []
    oos = [(b, p, s, hq, hkv) for (hq, hkv) in H for b in (8, 32, 128) for p in (2048, 8192)
           for s in (128, 512)][4:]
    oos += [(48, 3000, 384, 8, 1), (24, 6000, 200, 32, 8), (96, 1500, 700, 8, 1),
            (200, 2500, 100, 8, 1), (12, 12000, 64, 8, 1), (40, 1024, 2048, 32, 8)]
    OLD = set()
orig_ovl = pa._overlap_forward
res = []
for (b, p, s, hq, hkv) in grid + oos:
    if time.time() - t0 > BUDGET:
        print("budget reached", flush=True)
        break
    args = make_inputs(b, p, s, hkv, hq, 128)
    e = estimate(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=128, groups=1, prefix_len=p,
                 suffix_len=s, itemsize=2)
    row = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, in_grid=(b, p, s, hq, hkv) in grid,
               floor_ms=floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3,
               model_shared_us=e.shared_s * 1e6, model_flat_us=e.flat_s * 1e6,
               variant=pa.choose_variant(b, hkv, 8),
               mgpu_splits=pa.mgpu_decode_splits(b, hq, hkv, p, 128, 2))
    ref = None
    cols = ["shared", "flat"] + (["shared_oldovl"] if (b, p, s, hq, hkv) in OLD else [])
    for c in cols:
        if c == "shared_oldovl":
            pa._overlap_forward = functools.partial(orig_ovl, suffix_splits=1)
        f = ours(c.split("_")[0])
        try:
            out = jax.jit(f)(*args)
            ref = out if ref is None else ref
            row[c + "_maxdiff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            row[c + "_us"] = loop_time(f, args[0], args[1:]) * 1e6
        except Exception as ex:
            row[c + "_us"] = f"{type(ex).__name__}: {ex}"[:300]
        finally:
            pa._overlap_forward = orig_ovl
    row["elapsed"] = time.time() - t0
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    res.append(row)
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/probe_" + os.environ.get("POINTS", "small") + ".json", "w"), indent=1)
print("\n%-24s %7s %7s %7s %7s %7s" % ("point", "shared", "flat", "m_sh", "m_fl", "old"))
for r in res:
    g = lambda k: r.get(k) if isinstance(r.get(k), float) else float("nan")
    print("%-24s %7.1f %7.1f %7.1f %7.1f %7.1f" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}",
          g("shared_us"), g("flat_us"), r["model_shared_us"], r["model_flat_us"], g("shared_oldovl_us")))
