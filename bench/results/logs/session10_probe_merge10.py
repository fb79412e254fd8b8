# Run on c493647 + the UNROLL_MERGE switch (committed as 0837c27).
"""Session 10 probe: the XLA merge of partial states as one elementwise fusion over the parts
(UNROLL_MERGE=32, the working tree) against the stacked reduction of session 9 (UNROLL_MERGE=0)
and a cut at 4 parts, same run, alternating; Mosaic GPU points with many prefix splits and
small overlap/flat points."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours
from bench.timing import loop_time, device_info
import pallas_kernels.decode_attention as da

t0 = time.time()
res = []
for (b, p, s, hq, hkv, impl) in [(64, 4096, 64, 32, 8, "shared"), (64, 1024, 64, 32, 8, "shared"),
                                 (64, 4096, 64, 8, 1, "shared"), (256, 4096, 64, 8, 1, "shared"),
                                 (64, 16384, 64, 32, 8, "shared"), (16, 1024, 1024, 8, 1, "shared"),
                                 (16, 1024, 64, 8, 1, "shared"), (16, 1024, 1024, 8, 1, "flat")]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    ref = None
    ts = {}
    for u in [32, 0, 4, 32, 0, 4]:
        da.UNROLL_MERGE = u
        f = ours(impl)
        out = jax.jit(f)(*args)
        ref = out if ref is None else ref
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ts.setdefault(u, []).append(loop_time(f, args[0], args[1:]) * 1e6)
        res.append(dict(b=b, p=p, s=s, hq=hq, impl=impl, unroll=u, us=ts[u][-1], maxdiff=err))
        print(json.dumps(res[-1]), flush=True)
da.UNROLL_MERGE = 32
json.dump(dict(device=device_info(), results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_merge10.json", "w"), indent=1)
print("\n%-26s %14s %14s %14s" % ("point", "unroll32", "stacked", "unroll4"))
for i in range(0, len(res), 6):
    r = res[i]; g = {}
    for x in res[i:i + 6]:
        g.setdefault(x["unroll"], []).append(x["us"])
    print("%-26s %6.1f %6.1f   %6.1f %6.1f   %6.1f %6.1f" % ("B%d P%d S%d H%d %s" % (r["b"], r["p"], r["s"], r["hq"], r["impl"]), *g[32], *g[0], *g[4]))
print("elapsed", time.time() - t0)
