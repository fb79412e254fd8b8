"""Session 21: where the streamed suffix kernel is wrong (per (sequence, kv head): error, length,
task, worker, round), and what bounds its speed (timing-only variants: no length reads, no math)."""
import json, os, sys, time
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, "tests")
from test_suffix_stream_mgpu import _states, _oracle
from bench.timing import GRAPH_ALWAYS, device_info, loop_time
from pallas_kernels import prefix_attention as pa
from pallas_kernels import suffix_stream_mgpu as ss
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

for (b, hq, hkv, d, s, ctas, full) in [(70, 32, 8, 128, 128, 5, False), (70, 32, 8, 128, 128, 5, True),
                                        (33, 8, 1, 128, 192, 3, False), (20, 4, 4, 128, 64, 1, True)]:
    rng = np.random.default_rng(b)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)
    q, sk, sv = f(b, hq, d), f(b, s, hkv, d), f(b, s, hkv, d)
    sl = np.full(b, s) if full else rng.integers(0, s + 1, b)
    o, lse = jax.jit(lambda *a: _states(*a, ctas=ctas))(q, sk, sv, jnp.asarray(sl, jnp.int32))
    o = np.asarray(o.astype(jnp.float32), np.float64)
    ref, _ = _oracle(q, sk, sv, sl)
    g = hq // hkv
    cols = ss.cols_for(g); spt = cols // g; workers = 2 * ctas
    bad = []
    for i in range(b):
        for h in range(hkv):
            e = np.abs(o[i, h * g:(h + 1) * g] - ref[i, h * g:(h + 1) * g]).max()
            if e > 0.05:
                task = (i // spt) * hkv + h
                bad.append((i, h, int(sl[i]), task, task % workers, task // workers, round(float(e), 3)))
    print(json.dumps(dict(shape=(b, hq, hkv, d, s, ctas, full), n_bad=len(bad), of=b * hkv,
                          bad_first=bad[:40])), flush=True)

q = jnp.asarray(np.random.default_rng(0).standard_normal((512, 32, 128)), jnp.bfloat16)
sk = jnp.asarray(np.random.default_rng(1).standard_normal((512, 128, 8, 128)), jnp.bfloat16)
sl = jnp.full((512,), 128, jnp.int32)
for m in (24, 132):
    for dbg in ("", "nolen", "nomath", "nolen,nomath"):
        def fn(q, sk, sv, sl, m=m, dbg=dbg):
            qm, _ = pa._rows_128(q[:, None], 8, 4)
            o, _ = ss.suffix_stream_mgpu(qm, sk, sv, sl, scale=0.1, group=4, ctas=m, _debug=dbg)
            return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
        t = loop_time(fn, q, (sk, sk, sl), compiler_options=GRAPH_ALWAYS)
        print(json.dumps(dict(m=m, debug=dbg, ms=t * 1e3, tbps=2 * sk.size * 2 / t / 1e12)), flush=True)
