"""``python -m jax_prefix_attn``: a short self-check of the installed package."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn as jpa


def main() -> int:
    print(f"jax-prefix-attn {jpa.__version__} on jax {jax.__version__}, backend {jax.default_backend()}")
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    b, tq, tk, hq, hkv, d = 2, 4, 37, 8, 2, 64
    q = jax.random.normal(kq, (b, tq, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, tk, hkv, d), jnp.float32)
    v = jax.random.normal(kv, (b, tk, hkv, d), jnp.float32)
    out, lse = jpa.attention(q, k, v, causal=True)
    # Split the keys into a "prefix" and a "suffix", attend to each, merge: must equal the whole.
    cut = 20
    o1, l1 = jpa.reference.attention(q, k[:, :cut], v[:, :cut])
    o2, l2 = jpa.reference.attention(q, k[:, cut:], v[:, cut:], causal=True)
    om, lm = jpa.merge_two(o1, l1, o2, l2)
    err = float(jnp.linalg.norm(om - out) / jnp.linalg.norm(out))
    lerr = float(jnp.max(jnp.abs(lm - lse)))
    ok = err < 1e-5 and lerr < 1e-4 and bool(np.isfinite(np.asarray(out)).all())
    print(f"prefix/suffix merge vs whole attention: rel err {err:.2e}, max |dlse| {lerr:.2e}: "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
