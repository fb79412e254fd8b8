"""Session 12 probe: the own-layout flat kernel (suffix_decode_merge with the prefix as a span)
with the span's start / length given as [B] arrays or in the compact forms (start None, length
[1]); same process, alternating; us per call (loop of dependent calls)."""
import functools, json, math, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from pallas_kernels import decode_attention as da
from pallas_kernels.suffix_attention import suffix_decode_merge

PTS = [(64, 4096, 64, 32), (64, 16384, 64, 32), (256, 4096, 128, 32), (64, 4096, 256, 32), (16, 1024, 64, 8)]
FORMS = {"arr_arr": (True, True), "none_one": (False, False), "none_arr": (False, True), "arr_one": (True, False)}
for b, p, s, hq in PTS:
    hkv = 8 if hq == 32 else 1
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    splits = da._pick_splits(b * hkv, p + s, 128)
    tiling = da.flat_decode_tiling(b * hkv * splits)
    layout = da.flat_decode_layout(b * hkv * splits, da.cdiv(p, splits))
    runs = {}
    for name, (st_arr, len_arr) in FORMS.items():
        def fn(q, pk, pv, sk, sv, sl, st_arr=st_arr, len_arr=len_arr):
            st = jnp.zeros((b,), jnp.int32) + (sl * 0) if st_arr else None
            sn = jnp.full((b,), p, jnp.int32) + sl * 0 if len_arr else jnp.full((1,), p, jnp.int32)
            o, lse = suffix_decode_merge(q, sk, sv, sl, span=(pk, pv, st, sn), span_max=p,
                                         num_splits=splits, scale=1 / math.sqrt(128), **tiling)
            if splits > 1:
                o, lse = da.merge_partials(o, lse)
            return o.astype(q.dtype)
        def mk(n, fn=fn):
            @jax.jit
            def run(q, *rest):
                return jax.lax.fori_loop(0, n, lambda _, q: (q + fn(q, *rest) * 1e-3).astype(q.dtype), q)
            return run
        r4 = mk(4); jax.block_until_ready(r4(q, pk, pv, sk, sv, sl))
        t0 = time.perf_counter(); jax.block_until_ready(r4(q, pk, pv, sk, sv, sl)); t1 = (time.perf_counter() - t0) / 4
        n = max(4, min(2048, int(0.03 / t1)))
        r = mk(n); jax.block_until_ready(r(q, pk, pv, sk, sv, sl))
        runs[name] = (r, n, float(jnp.abs(jax.jit(fn)(q, pk, pv, sk, sv, sl).astype(jnp.float32)).sum()))
    ts = {k: [] for k in runs}
    for _ in range(5):
        for k, (r, n, _) in runs.items():
            t0 = time.perf_counter(); jax.block_until_ready(r(q, pk, pv, sk, sv, sl)); ts[k].append((time.perf_counter() - t0) / n * 1e6)
    print(json.dumps(dict(point=[b, p, s, hq], splits=splits, tiling=tiling, layout=layout,
                          us={k: round(statistics.median(v), 2) for k, v in ts.items()},
                          checks={k: v[2] for k, v in runs.items()})), flush=True)
