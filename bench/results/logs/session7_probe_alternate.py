"""Session 7, probe 3: the one-launch kernel with suffix_mode='alternate' (both warpgroups on
the same 64 rows taking suffix steps in turn, up to 5 stages) vs 'rows' and vs the two
independent launches, same run; plus the suffix tasks alone."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa
from pallas_kernels.shared_decode_mgpu import shared_decode_partials_mgpu

BUDGET = float(os.environ.get("BUDGET", "380"))
t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
BASE = dict(pa.ONE_LAUNCH)
A = dict(suffix_mode="alternate")
R = dict(suffix_mode="rows", suffix_steps=None, suffix_splits=None)
pts = [
    ((256, 4096, 128, 32, 8), [("rows_ns1", R), ("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2)),
                               ("alt_ns4", dict(A, num_splits=4)), ("alt_ns2_ss1", dict(A, num_splits=2, suffix_splits=1)),
                               ("alt_ns1_st3", dict(A, suffix_steps=3)), ("alt_ns2_pf", dict(A, num_splits=2, order="prefix_first")),
                               ("suf_alt_ss1", "suffix:1"), ("suf_alt_ss2", "suffix:2")]),
    ((1024, 4096, 128, 32, 8), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((1024, 4096, 256, 8, 1), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((256, 4096, 256, 32, 8), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((512, 8192, 128, 32, 8), [("alt_ns2", dict(A, num_splits=2)), ("alt_ns4", dict(A, num_splits=4))]),
    ((256, 4096, 64, 32, 8), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((1024, 4096, 64, 32, 8), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((256, 16384, 256, 32, 8), [("alt_ns2", dict(A, num_splits=2)), ("alt_ns4", dict(A, num_splits=4))]),
    ((256, 4096, 1024, 32, 8), [("alt_ns1", A), ("alt_ns2", dict(A, num_splits=2))]),
    ((256, 2048, 128, 32, 8), [("alt_ns1", A)]),
    ((1024, 16384, 64, 8, 1), [("alt_ns2", dict(A, num_splits=2)), ("alt_ns4", dict(A, num_splits=4))]),
]
res = []
for (b, p, s, hq, hkv), variants in pts:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    ref = None
    for name, kn in [("indep", None)] + variants:
        if time.time() - t0 > BUDGET:
            break
        pa.ONE_LAUNCH = dict(BASE)
        plan = None
        if isinstance(kn, str):  # suffix tasks alone
            ss = int(kn.split(":")[1]); g = hq // hkv
            q = args[0].reshape(b, hkv, g, 128).transpose(1, 0, 2, 3).reshape(hkv, b * g, 128)
            def f(q, pk, pv, sk, sv, sl, ss=ss, g=g):
                return shared_decode_partials_mgpu(q, pk, pv, p, sk, sv, sl, scale=128 ** -0.5, group=g,
                                                   num_splits=1, suffix_splits=ss, suffix_steps=5,
                                                   tasks=("suffix",))[2][0]
            try:
                t = loop_time(f, q, args[1:]) * 1e3; err = None
            except Exception as e:
                t, err = f"{type(e).__name__}: {e}"[:300], None
        else:
            if kn is None:
                pa.MGPU_MERGE = "independent"
            else:
                pa.MGPU_MERGE = "one_launch"; pa.ONE_LAUNCH.update(kn)
                plan = pa.one_launch_plan(b, hq, hkv, p, s, 128, jnp.bfloat16, force=True)
            f = ours("shared")
            try:
                out = jax.jit(f)(*args)
                ref = out if ref is None else ref
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                t = loop_time(f, args[0], args[1:]) * 1e3
            except Exception as e:
                err, t = None, f"{type(e).__name__}: {e}"[:300]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, variant=name, plan=plan, ms=t, floor_ms=fl, max_abs_diff=err,
                 elapsed=time.time() - t0)
        print(json.dumps(r), flush=True); res.append(r)
pa.MGPU_MERGE = "auto"; pa.ONE_LAUNCH = BASE
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res),
          open(os.environ["OUT"] + "/probe_alternate.json", "w"), indent=1)
print("\n%-22s %-12s %8s %7s %7s %8s" % ("point", "variant", "ms", "/floor", "/indep", "maxdiff"))
base = {}
for r in res:
    key = (r['b'], r['p'], r['s'], r['hq'])
    ms = r["ms"] if isinstance(r["ms"], float) else float("nan")
    if r["variant"] == "indep": base[key] = ms
    print("%-22s %-12s %8.4f %7.2f %7.2f %8s" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["variant"],
          ms, ms / r["floor_ms"], ms / base.get(key, float('nan')), r["max_abs_diff"]))
