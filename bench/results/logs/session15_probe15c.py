"""Session 15 probe: the timing loop's own cost per iteration (GRAPH_ALWAYS, as every column of
bench/shared_prefix.py is timed): fn = identity (the loop body is one fused XLA kernel,
q + q * 1e-3), and fn = one trivial Pallas (Triton) copy kernel (two kernels per iteration), at
the query shapes of a few grid points; median of 5 timed loops."""
import functools, json, os, statistics, sys, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from bench.timing import GRAPH_ALWAYS, device_info
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

def pallas_copy(q):
    def k(x_ref, o_ref):
        o_ref[...] = x_ref[...]
    b, h, d = q.shape
    return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b,),
                          in_specs=[pl.BlockSpec((None, h, d), lambda i: (i, 0, 0))],
                          out_specs=pl.BlockSpec((None, h, d), lambda i: (i, 0, 0)))(q)

def looped(fn, n):
    @functools.partial(jax.jit, compiler_options=GRAPH_ALWAYS)
    def run(q):
        def body(_, q):
            return (q + fn(q).astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q)
    return run

for b, hq in [(8, 8), (256, 8), (256, 32), (1024, 32)]:
    q = jax.random.normal(jax.random.PRNGKey(0), (b, hq, 128), jnp.bfloat16)
    rec = dict(batch=b, heads_q=hq)
    for name, fn in [("identity", lambda q: q), ("pallas_copy", pallas_copy)]:
        n = 2048
        run = looped(fn, n); jax.block_until_ready(run(q))
        ts = []
        for _ in range(5):
            t0 = time.perf_counter(); jax.block_until_ready(run(q)); ts.append((time.perf_counter() - t0) / n * 1e6)
        rec[f"{name}_us"] = round(statistics.median(ts), 2)
    print(json.dumps(rec), flush=True)
