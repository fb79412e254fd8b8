"""models.attention: the flat backend's decode path through shared_prefix_attention's ragged
decode kernel (interpret mode on CPU; the GPU picks it automatically for T <= FLAT_DECODE_MAX_TQ)
equals the reference oracle over each sequence's buffer prefix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_prefix_attn import reference
from models.attention import cache_attention, flat_decode_attention
from conftest import rel_err


@pytest.mark.parametrize("t", [1, 3])
def test_flat_decode_kernel_matches_reference(t):
    b, s, hq, hkv, d = 3, 40, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(t), 3)
    q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32)
    lengths = jnp.asarray([t, 17, 40], jnp.int32)
    got = np.asarray(flat_decode_attention(q, k, v, lengths, impl="flat_interpret"))
    assert np.isfinite(got).all()
    for i in range(b):
        n = int(lengths[i])
        want = reference.attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=True)
        want = want[0] if isinstance(want, tuple) else want
        assert rel_err(got[i:i + 1], np.asarray(want)) < 1e-5
    # and equals the model's flat path (reference impl on CPU)
    flat = cache_attention(q, (), (), (), k, v, lengths, backend="flat", impl="reference")
    assert rel_err(got, np.asarray(flat)) < 1e-5
