"""Session 15: out-of-sample check of the cost model's shared/flat choice at small shapes (none of
them in the grid or in earlier validation sets): both paths timed as interleaved loops (each one
CUDA graph, GRAPH_ALWAYS), 5 rounds, medians; the choices of the cost model are derived offline
from these times (any constants)."""
import functools, json, os, statistics, sys, time
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info

PTS = [(16, 2048, 64, 8, 1), (16, 2048, 512, 8, 1), (24, 1536, 128, 8, 1), (12, 3000, 200, 8, 1),
       (48, 1024, 96, 8, 1), (32, 1024, 192, 8, 1), (8, 1024, 64, 8, 1), (24, 4096, 512, 8, 1),
       (64, 2048, 64, 8, 1), (40, 6000, 300, 8, 1), (8, 1024, 64, 32, 8), (16, 2048, 64, 32, 8),
       (24, 1024, 128, 32, 8), (12, 1536, 256, 32, 8), (32, 1024, 64, 32, 8), (16, 512, 64, 32, 8),
       (20, 768, 100, 32, 8), (8, 3000, 500, 32, 8)]
BUDGET = float(os.environ.get("PROBE_BUDGET", 230))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

def looped(fn, n):
    @functools.partial(jax.jit, compiler_options=GRAPH_ALWAYS)
    def run(q, *rest):
        def body(_, q):
            return (q + fn(q, *rest).astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q)
    return run

t_start = time.time()
for (b, p, s, hq, hkv) in PTS:
    if time.time() - t_start > BUDGET:
        print(json.dumps(dict(point=[b, p, s, hq, hkv], skipped=True)), flush=True)
        continue
    q, *rest = make_inputs(b, p, s, hkv, hq, 128)
    runs = {}
    for impl in ("shared", "flat"):
        fn = ours(impl)
        r4 = looped(fn, 4); jax.block_until_ready(r4(q, *rest))
        t0 = time.perf_counter(); jax.block_until_ready(r4(q, *rest)); t1 = (time.perf_counter() - t0) / 4
        n = max(4, min(2048, int(0.03 / max(t1, 1e-6))))
        run = looped(fn, n); jax.block_until_ready(run(q, *rest))
        runs[impl] = (run, n)
    ts = {k: [] for k in runs}
    for _ in range(5):
        for impl, (run, n) in runs.items():
            t0 = time.perf_counter(); jax.block_until_ready(run(q, *rest))
            ts[impl].append((time.perf_counter() - t0) / n * 1e6)
    rec = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, shared_us=[round(x, 2) for x in ts["shared"]],
               flat_us=[round(x, 2) for x in ts["flat"]],
               shared_med=round(statistics.median(ts["shared"]), 2),
               flat_med=round(statistics.median(ts["flat"]), 2))
    print(json.dumps(rec), flush=True)
