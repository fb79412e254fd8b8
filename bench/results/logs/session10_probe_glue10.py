# .gpu/oldpk/pallas_kernels_old (the code before the glue change): mkdir -p .gpu/oldpk && git archive b690c7d pallas_kernels | tar -x -C .gpu/oldpk && mv .gpu/oldpk/pallas_kernels .gpu/oldpk/pallas_kernels_old && sed -i "s/pallas_kernels\./pallas_kernels_old./g; s/from pallas_kernels import/from pallas_kernels_old import/g" .gpu/oldpk/pallas_kernels_old/*.py
# (its docstring says "session-9 code": it is commit b690c7d, session 9 plus the masked suffix loads)
"""Session 10 probe: the XLA glue around the kernels at small points, session-9 code (commit
b690c7d, loaded as pallas_kernels_old) against the working tree, same run, alternating:
constant row indices and Tq=1 limits as broadcasts (seq_rows), merges as one elementwise fusion
(merge_partial_list).  Per path: kernels in the compiled entry computation, and time."""
import json, math, os, re, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu", "oldpk"))
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from bench.timing import loop_time, device_info
from jax_prefix_attn.shared_prefix import row_limits
import pallas_kernels.decode_attention as da_new, pallas_kernels.prefix_attention as pa_new
import pallas_kernels_old.decode_attention as da_old, pallas_kernels_old.prefix_attention as pa_old

def make(fwd):
    def f(q, pk, pv, sk, sv, sl):
        b = q.shape[0]
        s2p = jnp.zeros((b,), jnp.int32)
        lim_p, lim_s = row_limits(1, jnp.full((b,), pk.shape[0], jnp.int32), sl)
        o, _ = fwd(q[:, None], pk[None], pv[None], sk, sv, s2p, lim_p, lim_s,
                   scale=1 / math.sqrt(q.shape[-1]))
        return o[:, 0]
    return f

def kernels(f, args):
    txt = jax.jit(f).lower(*args).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return len(re.findall(r"= \S+ (?:fusion|custom-call|copy|transpose)\(", entry))

t0 = time.time()
fns = {("flat", "old"): make(da_old.flat_forward), ("flat", "new"): make(da_new.flat_forward),
       ("shared", "old"): make(pa_old.shared_prefix_forward),
       ("shared", "new"): make(pa_new.shared_prefix_forward)}
res = []
for (b, p, s, hq, hkv) in [(16, 1024, 1024, 8, 1), (16, 1024, 64, 8, 1), (64, 1024, 64, 8, 1),
                           (64, 1024, 1024, 8, 1), (16, 4096, 256, 8, 1), (16, 1024, 256, 32, 8),
                           (64, 4096, 256, 32, 8), (256, 4096, 64, 8, 1), (1024, 4096, 64, 32, 8)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    for impl in ("flat", "shared"):
        ref = jax.jit(fns[(impl, "old")])(*args)
        new = jax.jit(fns[(impl, "new")])(*args)
        err = float(jnp.max(jnp.abs(new.astype(jnp.float32) - ref.astype(jnp.float32))))
        nk = {v: kernels(fns[(impl, v)], args) for v in ("old", "new")}
        ts = {"old": [], "new": []}
        for v in ("old", "new", "old", "new"):
            ts[v].append(loop_time(fns[(impl, v)], args[0], args[1:]) * 1e6)
        r = dict(b=b, p=p, s=s, hq=hq, impl=impl, kernels_old=nk["old"], kernels_new=nk["new"],
                 us_old=ts["old"], us_new=ts["new"], maxdiff_new_vs_old=err)
        print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_glue10.json", "w"), indent=1)
print("\n%-20s %-7s %9s %14s %14s %8s" % ("point", "path", "kernels", "old us", "new us", "new/old"))
for r in res:
    o, n = sum(r["us_old"]) / 2, sum(r["us_new"]) / 2
    print("%-20s %-7s %4d->%-4d %6.1f %6.1f   %6.1f %6.1f   %6.3f" % (
        "B%d P%d S%d H%d" % (r["b"], r["p"], r["s"], r["hq"]), r["impl"], r["kernels_old"],
        r["kernels_new"], *r["us_old"], *r["us_new"], n / o))
print("elapsed", time.time() - t0)
