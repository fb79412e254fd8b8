"""Session 21: error counts of the streamed suffix kernel against float64 under variants
(stages, CTAs so that each worker has one task, lengths full or random)."""
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, "tests")
from test_suffix_stream_mgpu import _states, _oracle
from bench.timing import device_info
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
for (b, hq, hkv, d, s) in [(70, 32, 8, 128, 128), (33, 8, 1, 128, 192), (21, 16, 1, 128, 64)]:
    rng = np.random.default_rng(b)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)
    q, sk, sv = f(b, hq, d), f(b, s, hkv, d), f(b, s, hkv, d)
    for full in (False, True):
        sl = np.full(b, s) if full else rng.integers(0, s + 1, b)
        ref, _ = _oracle(q, sk, sv, sl)
        g = hq // hkv
        n_tasks = -(-b * g // max(16, g)) * hkv
        one = -(-n_tasks // 2)   # CTAs so that each worker has one task
        for ctas, stages in [(5, 3), (5, 2), (5, 1), (3, 3), (1, 3), (one, 3), (one, 1)]:
            try:
                o, _ = jax.jit(lambda *a: _states(*a, ctas=ctas, stages=stages))(
                    q, sk, sv, jnp.asarray(sl, jnp.int32))
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(shape=(b, hq, hkv, s, full), ctas=ctas, stages=stages, error=str(e)[:200])), flush=True)
                continue
            o = np.asarray(o.astype(jnp.float32), np.float64)
            err = np.abs(o - ref).reshape(b, hkv, g, d).max(axis=(2, 3))
            print(json.dumps(dict(shape=(b, hq, hkv, s, full), ctas=ctas, stages=stages,
                                  n_bad=int((err > 0.05).sum()), of=b * hkv, max_err=float(err.max()))), flush=True)
