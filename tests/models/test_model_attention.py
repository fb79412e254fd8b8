"""models.attention: the flat backend's decode path through shared_prefix_attention's ragged
decode kernel (interpret mode on CPU; the GPU picks it automatically for T <= FLAT_DECODE_MAX_TQ)
equals the reference oracle over each sequence's buffer prefix; every path takes ``interpret``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_prefix_attn import reference
from models.attention import cache_attention, flat_decode_attention
from helpers import rel_err


def _qkv(seed, b, t, s, hq, hkv, d):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("t", [1, 3])
def test_flat_decode_kernel_matches_reference(t):
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    q, k, v = _qkv(t, b, t, s, hq, hkv, d)
    lengths = jnp.asarray([t, 17, 40], jnp.int32)
    got = np.asarray(flat_decode_attention(q, k, v, lengths, impl="flat", interpret=True))
    assert np.isfinite(got).all()
    for i in range(b):
        n = int(lengths[i])
        want = reference.attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
        want = want[0] if isinstance(want, tuple) else want
        assert rel_err(got[i:i + 1], np.asarray(want)) < 1e-5
    # and equals the model's flat path (reference impl on CPU)
    flat = cache_attention(q, (), (), (), k, v, lengths, backend="flat", impl="reference")
    assert rel_err(got, np.asarray(flat)) < 1e-5
    # impl="auto" takes interpret (the decode kernel on a GPU, the reference elsewhere)
    auto = cache_attention(q, (), (), (), k, v, lengths, backend="flat", impl="auto", interpret=True)
    assert rel_err(auto, got) < 1e-5


def test_shared_backend_with_interpret_matches_reference():
    """Two prefix levels (a root and two nodes) + suffixes: ``impl="auto"`` with
    ``interpret=True`` (shared-prefix attention for the deepest level, flash attention for the
    root: kernels in interpret mode on a GPU, the reference elsewhere) equals the reference."""
    b, t, s, hq, hkv, d = 4, 1, 24, 4, 2, 16
    q, k, v = _qkv(5, b, t, s, hq, hkv, d)
    ks = jax.random.split(jax.random.PRNGKey(6), 4)
    pk = (jax.random.normal(ks[0], (1, 32, hkv, d)), jax.random.normal(ks[1], (2, 16, hkv, d)))
    pv = (jax.random.normal(ks[2], (1, 32, hkv, d)), jax.random.normal(ks[3], (2, 16, hkv, d)))
    plen = (jnp.asarray([29], jnp.int32), jnp.asarray([16, 7], jnp.int32))
    lengths = jnp.asarray([1, 9, 24, 3], jnp.int32)
    want = cache_attention(q, pk, pv, plen, k, v, lengths, backend="shared", impl="reference")
    got = cache_attention(q, pk, pv, plen, k, v, lengths, backend="shared", impl="auto", interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-5
