"""Session 15 probe: the issue's small-GQA case (Hq=8/Hkv=1, B=8, P=4000) -- our shared, flat
and auto paths against JAX's gqa over materialised per-sequence KV (padded to a multiple of
1024 keys as bench/shared_prefix.py does), interleaved timed loops (each one CUDA graph), 7
rounds, median and min per column."""
import functools, json, os, statistics, sys, time
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, flat_gqa
from bench.timing import GRAPH_ALWAYS, device_info

print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

def looped(fn, n):
    @functools.partial(jax.jit, compiler_options=GRAPH_ALWAYS)
    def run(q, *rest):
        def body(_, q):
            return (q + fn(q, *rest).astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q)
    return run

for spec in sys.argv[1].split(","):
    b, p, s = (int(x) for x in spec.split(":"))
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, 1, 8, 128)
    pad = ((0, 0), (0, -(p + s) % 1024 if (p + s) % 64 else 0), (0, 0), (0, 0))
    kf = jnp.pad(jnp.concatenate([jnp.broadcast_to(pk[None], (b,) + pk.shape), sk], 1), pad)
    vf = jnp.pad(jnp.concatenate([jnp.broadcast_to(pv[None], (b,) + pv.shape), sv], 1), pad)
    lens = jnp.full((b,), p + s, jnp.int32)
    cols = {"shared": (ours("shared"), (pk, pv, sk, sv, sl)), "flat": (ours("flat"), (pk, pv, sk, sv, sl)),
            "auto": (ours("auto"), (pk, pv, sk, sv, sl)), "jax_gqa": (flat_gqa, (kf, vf, lens))}
    runs = {}
    for c, (fn, rest) in cols.items():
        r4 = looped(fn, 4); jax.block_until_ready(r4(q, *rest))
        t0 = time.perf_counter(); jax.block_until_ready(r4(q, *rest)); t1 = (time.perf_counter() - t0) / 4
        n = max(4, min(2048, int(0.03 / max(t1, 1e-6))))
        run = looped(fn, n); jax.block_until_ready(run(q, *rest))
        runs[c] = (run, n, rest)
    ts = {c: [] for c in cols}
    for _ in range(7):
        for c, (run, n, rest) in runs.items():
            t0 = time.perf_counter(); jax.block_until_ready(run(q, *rest))
            ts[c].append((time.perf_counter() - t0) / n * 1e6)
    rec = dict(point=[b, p, s, 8, 1, 128])
    for c in cols:
        rec[f"{c}_us_median"] = round(statistics.median(ts[c]), 2)
        rec[f"{c}_us_min"] = round(min(ts[c]), 2)
        rec[f"{c}_us_all"] = [round(x, 2) for x in ts[c]]
    for c in cols:
        rec[f"{c}_over_jax_gqa"] = round(rec[f"{c}_us_median"] / rec["jax_gqa_us_median"], 3)
    print(json.dumps(rec), flush=True)
