"""Session 7: the one-launch kernel's parts timed apart (prefix tasks only, suffix tasks only,
both) at two points, to see which part bounds it."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
from pallas_kernels.shared_decode_mgpu import shared_decode_partials_mgpu

BUDGET = float(os.environ.get("BUDGET", "300"))
t0 = time.time()
bw = measure_copy_bandwidth(1 << 30); mma = measure_matmul_rate(8192)
print(f"bw {bw/1e12:.2f} TB/s mma {mma/1e12:.0f} TFLOP/s", flush=True)
cases = {
  (256, 4096, 128, 32, 8): [("prefix", 1, 1, "interleave"), ("prefix", 2, 1, "interleave"), ("prefix", 4, 1, "interleave"),
                            ("suffix", 1, 1, "interleave"), ("suffix", 1, 2, "interleave"),
                            ("both", 1, 2, "interleave"), ("both", 1, 2, "prefix_first"), ("both", 2, 2, "prefix_first"),
                            ("both", 4, 2, "prefix_first"), ("both", 2, 1, "prefix_first"), ("both", 1, 1, "prefix_first")],
  (1024, 4096, 128, 32, 8): [("prefix", 1, 1, "interleave"), ("suffix", 1, 1, "interleave"), ("suffix", 1, 2, "interleave"),
                             ("both", 1, 1, "interleave"), ("both", 1, 1, "prefix_first"), ("both", 2, 1, "prefix_first")],
  (1024, 4096, 256, 8, 1): [("prefix", 1, 1, "interleave"), ("suffix", 1, 4, "interleave"),
                            ("both", 1, 4, "interleave"), ("both", 1, 4, "prefix_first"), ("both", 2, 4, "prefix_first")],
}
res = []
for (b, p, s, hq, hkv), variants in cases.items():
    g = hq // hkv; d = 128
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (hkv, b * g, d), jnp.bfloat16)
    pk, pv = (jax.random.normal(k, (p, hkv, d), jnp.bfloat16) for k in ks[1:3])
    sk, sv = (jax.random.normal(k, (b, s, hkv, d), jnp.bfloat16) for k in ks[3:5])
    sl = jnp.full((b,), s, jnp.int32)
    for kind, ns, ss, order in variants:
        if time.time() - t0 > BUDGET:
            break
        tasks = ("prefix", "suffix") if kind == "both" else (kind,)
        def f(q, pk, pv, sk, sv, sl, tasks=tasks, ns=ns, ss=ss, order=order):
            o1, _, o2, _ = shared_decode_partials_mgpu(q, pk, pv, p, sk, sv, sl, scale=d ** -0.5, group=g,
                num_splits=ns, suffix_splits=ss, order=order, tasks=tasks)
            return (o1[0] if "prefix" in tasks else o2[0])
        try:
            t = loop_time(f, q, (pk, pv, sk, sv, sl)) * 1e3
        except Exception as e:
            t = f"{type(e).__name__}: {e}"[:300]
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, kind=kind, num_splits=ns, suffix_splits=ss, order=order, ms=t)
        print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), bw=bw, mma=mma, results=res), open(os.environ["OUT"] + "/probe_parts.json", "w"), indent=1)
print("\n%-20s %-7s %3s %3s %-13s %8s" % ("point", "kind", "ns", "ss", "order", "ms"))
for r in res:
    print("%-20s %-7s %3d %3d %-13s %8s" % (f"B{r['b']} P{r['p']} S{r['s']} H{r['hq']}", r["kind"], r["num_splits"], r["suffix_splits"], r["order"],
          f"{r['ms']:.4f}" if isinstance(r['ms'], float) else r['ms'][:40]))
