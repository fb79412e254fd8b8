"""Session 12 A/B in one process: HEAD's code (renamed copy pk_old / jpa_old) against this
tree, interleaved; per point and path the median us of 7 alternating timed loops each."""
import functools, json, os, statistics, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), ".gpu/old12x"))
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from jax_prefix_attn import shared_prefix_attention as new_api
from jpa_old import shared_prefix_attention as old_api

PTS = [tuple(int(x) for x in s.split(":")) for s in sys.argv[1].split(",")]
IMPLS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["shared", "flat"]
budget = float(os.environ.get("AB_BUDGET", 300))
t_start = time.time()

def looped(api, impl, n):
    def fn(q, pk, pv, sk, sv, sl):
        return api(q[:, None], pk, pv, sk, sv, suffix_lengths=sl, impl=impl)[:, 0]
    @functools.partial(jax.jit, compiler_options=json.loads(os.environ.get("XOPTS", "null")))
    def run(q, *rest):
        def body(_, q):
            return (q + fn(q, *rest).astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q)
    return run, fn

for b, p, s, hq in PTS:
    if time.time() - t_start > budget:
        print(json.dumps(dict(point=[b, p, s, hq], skipped=True)), flush=True)
        continue
    hkv = 8 if hq == 32 else 1
    args = make_inputs(b, p, s, hkv, hq, 128)
    rec = dict(point=[b, p, s, hq])
    for impl in IMPLS:
        runs = {}
        for tag, api in (("old", old_api), ("new", new_api)):
            run1, fn = looped(api, impl, 4)
            jax.block_until_ready(run1(*args)); t0 = time.perf_counter(); jax.block_until_ready(run1(*args))
            t1 = (time.perf_counter() - t0) / 4
            n = max(4, min(2048, int(0.03 / max(t1, 1e-6))))
            run, _ = looped(api, impl, n)
            jax.block_until_ready(run(*args))
            runs[tag] = (run, n)
            rec[f"{impl}_{tag}_check"] = float(jnp.abs(jax.jit(fn)(*args).astype(jnp.float32)).sum())
        ts = {"old": [], "new": []}
        for _ in range(7):
            for tag in ("old", "new"):
                run, n = runs[tag]
                t0 = time.perf_counter(); jax.block_until_ready(run(*args))
                ts[tag].append((time.perf_counter() - t0) / n * 1e6)
        for tag in ts:
            rec[f"{impl}_{tag}_us"] = statistics.median(ts[tag])
            rec[f"{impl}_{tag}_all"] = [round(x, 2) for x in ts[tag]]
        rec[f"{impl}_new_over_old"] = rec[f"{impl}_new_us"] / rec[f"{impl}_old_us"]
    print(json.dumps(rec), flush=True)
