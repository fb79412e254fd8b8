"""Session 8 probe: Hq=8/Hkv=1 B=256 (latency-bound) shared path variants, same run: the default,
the suffix merged in its epilogue (MGPU_MERGE='epilogue'), the suffix unsplit (ss1), and other
prefix splits of the Mosaic GPU kernel (msN)."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

BUDGET = float(os.environ.get("BUDGET", "300"))
t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
orig_dss = pa.default_suffix_splits
res = []
for p in (4096, 16384):
    for s in (64, 256, 1024):
        b, hq, hkv = 256, 8, 1
        args = make_inputs(b, p, s, hkv, hq, 128)
        fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
        ref = None
        for v in ["base", "epi", "ss1", "ss1epi", "ms4", "ms16"]:
            if time.time() - t0 > BUDGET:
                break
            pa.MGPU_MERGE = "epilogue" if "epi" in v else "auto"
            pa.MGPU_SPLITS = int(v[2:]) if v.startswith("ms") else None
            pa.default_suffix_splits = (lambda *a, **k: 1) if v.startswith("ss1") else orig_dss
            f = ours("shared")
            try:
                out = jax.jit(f)(*args)
                ref = out if ref is None else ref
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                t = loop_time(f, args[0], args[1:]) * 1e3
            except Exception as e:
                err, t = None, f"{type(e).__name__}: {e}"[:300]
            finally:
                pa.MGPU_MERGE, pa.MGPU_SPLITS, pa.default_suffix_splits = "auto", None, orig_dss
            r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, variant=v, ms=t, floor_ms=fl, max_abs_diff=err,
                     elapsed=time.time() - t0)
            print(json.dumps(r), flush=True)
            res.append(r)
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/probe_hq8_b256.json", "w"), indent=1)
print("\n%-22s %-7s %8s %7s %7s" % ("point", "variant", "ms", "/floor", "/base"))
base = {}
for r in res:
    k = (r["p"], r["s"]); ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    if r["variant"] == "base": base[k] = ms
    print("%-22s %-7s %8.4f %7.2f %7.2f" % (f"B256 P{r['p']} S{r['s']} H8", r["variant"], ms,
          ms / r["floor_ms"], ms / base.get(k, float("nan"))))
