"""Session 14 probe: shared path variants in one process, interleaved timed loops.
base = defaults (GRAPH_ALWAYS); epi = MGPU_MERGE "epilogue" (suffix kernel merges the Mosaic GPU
prefix partials in its epilogue); conc = defaults compiled with CONCURRENT_COMPILER_OPTIONS."""
import functools, json, os, statistics, sys, time
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from bench.timing import GRAPH_ALWAYS, device_info
from jax_prefix_attn import shared_prefix_attention
from jax_prefix_attn.shared_prefix import CONCURRENT_COMPILER_OPTIONS
from pallas_kernels import prefix_attention as pa

PTS = [tuple(int(x) for x in s.split(":")) for s in sys.argv[1].split(",")]
VARS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "epi", "conc"]
budget = float(os.environ.get("AB_BUDGET", 300))
t_start = time.time()
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
SET = {"base": {}, "epi": {"MGPU_MERGE": "epilogue"}, "conc": {}, "joint": {"MGPU_MERGE": "joint"}, "joint1": {"MGPU_MERGE": "joint", "JOINT_SPLITS": 1}, "joint2": {"MGPU_MERGE": "joint", "JOINT_SPLITS": 2},
       "indep": {"MGPU_MERGE": "independent"},
       "joint4": {"MGPU_MERGE": "joint", "JOINT_SPLITS": 4},
       "jt": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": True},
       "jn": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": False},
       "jt16": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": True, "JOINT_SPLITS": 16},
       "jn4": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": False, "JOINT_SPLITS": 4},
       "jt4": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": True, "JOINT_SPLITS": 4},
       "ol": {"MGPU_MERGE": "one_launch"},
       "nb": {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": False},
       "nb1": {"MGPU_MERGE": "joint", "JOINT_SPLITS": 1, "JOINT_SCHEDULE_BARRIER": False},
       "nb2": {"MGPU_MERGE": "joint", "JOINT_SPLITS": 2, "JOINT_SCHEDULE_BARRIER": False}}
OPTS = {"conc": CONCURRENT_COMPILER_OPTIONS}

def make_fn(var):
    def fn(q, pk, pv, sk, sv, sl):
        old = {k: getattr(pa, k) for k in SET[var]}
        for k, v in SET[var].items():
            setattr(pa, k, v)
        try:
            return shared_prefix_attention(q[:, None], pk, pv, sk, sv, suffix_lengths=sl,
                                           impl="shared")[:, 0]
        finally:
            for k, v in old.items():
                setattr(pa, k, v)
    return fn

def looped(var, n):
    fn = make_fn(var)
    @functools.partial(jax.jit, compiler_options=OPTS.get(var, GRAPH_ALWAYS))
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
    runs, outs = {}, {}
    for var in VARS:
        run1, fn = looped(var, 4)
        jax.block_until_ready(run1(*args)); t0 = time.perf_counter(); jax.block_until_ready(run1(*args))
        t1 = (time.perf_counter() - t0) / 4
        n = max(4, min(2048, int(0.03 / max(t1, 1e-6))))
        run, _ = looped(var, n)
        jax.block_until_ready(run(*args))
        runs[var] = (run, n)
        outs[var] = jax.jit(fn)(*args).astype(jnp.float32)
    for var in VARS:
        rec[f"{var}_maxdiff"] = float(jnp.abs(outs[var] - outs[VARS[0]]).max())
    ts = {v: [] for v in VARS}
    for _ in range(5):
        for var in VARS:
            run, n = runs[var]
            t0 = time.perf_counter(); jax.block_until_ready(run(*args))
            ts[var].append((time.perf_counter() - t0) / n * 1e6)
    for var in VARS:
        rec[f"{var}_us"] = round(statistics.median(ts[var]), 2)
        rec[f"{var}_over_base"] = round(rec[f"{var}_us"] / statistics.median(ts[VARS[0]]), 3)
    print(json.dumps(rec), flush=True)
