"""Session 8 probe: at the near-miss points of the 1.5x-floor target, the independent launches
with other prefix splits (msN: MGPU_SPLITS=N) and the one-launch kernel with prefix splits
(nsN) and orders, same run."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa

BUDGET = float(os.environ.get("BUDGET", "400"))
t_start = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
BASE = dict(pa.ONE_LAUNCH)
import re
pts = [  # (b, p, s, hq, hkv, variants)
    (256, 16384, 64, 32, 8, ["ms2", "ms8", "ns2", "ns4", "ns4sf"]),
    (1024, 16384, 1024, 8, 1, ["ms1", "ms4", "ns1", "ns2"]),
    (256, 16384, 256, 32, 8, ["ms2", "ns4", "ns4sf"]),
    (1024, 16384, 256, 8, 1, ["ms1", "ms4", "ns1", "ns2"]),
    (1024, 16384, 256, 32, 8, ["ms2", "ns2", "ns2sf"]),
    (1024, 16384, 64, 8, 1, ["ms1", "ms4", "ns2"]),
]
def knobs(v, plan):
    k = dict(BASE)
    if "sf" in v: k["order"] = "suffix_first"
    if m := re.search(r"ss(\d+)", v): k["suffix_splits"] = int(m.group(1))
    if m := re.search(r"ns(\d+)", v): k["num_splits"] = int(m.group(1))
    if m := re.search(r"b(\d+)", v): k["block_s"] = int(m.group(1))
    return k
res = []
for (b, p, s, hq, hkv, variants) in pts:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    ref = None
    for v in ["indep"] + variants:
        if time.time() - t_start > BUDGET:
            break
        pa.ONE_LAUNCH = dict(BASE)
        pa.MGPU_SPLITS = None
        if v == "indep" or v.startswith("ms"):
            pa.MGPU_MERGE = "independent"; plan = None
            if v.startswith("ms"):
                pa.MGPU_SPLITS = int(v[2:])
        else:
            pa.MGPU_MERGE = "one_launch"
            pa.ONE_LAUNCH = knobs(v, None)
            plan = pa.one_launch_plan(b, hq, hkv, p, s, 128, jnp.bfloat16)
        f = ours("shared")
        try:
            out = jax.jit(f)(*args)
            if ref is None:
                ref = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:]) * 1e3
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:400]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, variant=v, plan=plan, ms=t, floor_ms=fl,
                 over_floor=(t / fl if isinstance(t, float) else None), max_abs_diff=err,
                 elapsed=time.time() - t_start)
        print(json.dumps(r), flush=True)
        res.append(r)
pa.MGPU_MERGE = "auto"; pa.ONE_LAUNCH = BASE; pa.MGPU_SPLITS = None
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/" + os.environ.get("NAME", "probe_splits") + ".json", "w"), indent=1)
print("\n%-24s %-7s %8s %7s %7s %8s" % ("point", "variant", "ms", "/floor", "/indep", "maxdiff"))
base = {}
for r in res:
    key = (r['b'], r['p'], r['s'], r['hq'])
    ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    if r["variant"] == "indep": base[key] = ms
    print("%-24s %-7s %8.4f %7.2f %7.2f %8s" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["variant"],
          ms, ms / r["floor_ms"], ms / base.get(key, float('nan')), r["max_abs_diff"]))
