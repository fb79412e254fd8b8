"""Any GQA group (``Hq % Hkv == 0``) and head_dim in every implementation: the tree kernels
(power-of-two row blocks) pad each group with dummy query heads, the Triton kernels pad a head_dim
that is not a power of two with zero columns."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_prefix_attn as jpa
from helpers import concat_oracle, random_forest, rel_err, tree_inputs


@pytest.fixture(scope="module")
def forest():
    return random_forest(np.random.default_rng(7), 2, 3, 2, 14)


@pytest.mark.parametrize("hq,hkv,impl", [(3, 1, "flatten"), (10, 2, "hybrid"), (7, 1, "flatten")])
def test_tree_kernels_any_group(forest, hq, hkv, impl):
    """GQA groups that are not powers of two (3, 5, 7): the tree schedules, whose kernels pad
    each kv head's query heads to a power of two, match the oracle."""
    q, kp, vp, sk, sv, sl = tree_inputs(forest, tq=1, hq=hq, hkv=hkv, d=16, smax=5, seed=hq)
    want, want_lse = concat_oracle(forest, q, kp, vp, sk, sv, sl)
    out, lse = jax.jit(lambda q: jpa.tree_attention(q, forest, kp, vp, sk, sv, suffix_lengths=sl,
                                                    impl=impl, interpret=True, return_lse=True))(q)
    assert rel_err(out, want) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(24, 8), (40, 8), (28, 4)])
def test_tree_any_group_gradients_gpu(hq, hkv):
    """Gradients through the tree backward kernels with groups 3, 5, 7 (bf16)."""
    tree = random_forest(np.random.default_rng(5), 1, 3, 3, 200, seqs_per_leaf=(2, 4))
    q, kp, vp, sk, sv, sl = tree_inputs(tree, tq=2, hq=hq, hkv=hkv, d=128, smax=32, seed=3,
                                        dtype=jnp.bfloat16)

    def loss(impl):
        return lambda q, kp: jnp.sum(jnp.sin(jpa.tree_attention(
            q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl).astype(jnp.float32)))
    got = jax.jit(jax.grad(loss("flatten"), argnums=(0, 1)))(q, kp)
    want = jax.jit(jax.grad(loss("reference"), argnums=(0, 1)))(q, kp)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 3e-2


def test_head_dim_not_a_power_of_two():
    """head_dim 24 (and 96), not a power of two: the shared-prefix kernels run it zero-padded
    and match the reference."""
    rng = np.random.default_rng(0)
    r = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32))  # noqa: E731
    q, pk, pv, sk, sv = r(2, 2, 6, 24), r(9, 2, 24), r(9, 2, 24), r(2, 5, 2, 24), r(2, 5, 2, 24)
    sl = jnp.array([5, 2])
    want = jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, impl="reference")
    for impl in ("shared", "flat"):
        got = jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, impl=impl,
                                          interpret=True)
        assert rel_err(got, want) < 1e-5, impl


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(24, 8, 128), (40, 8, 128), (28, 4, 96), (12, 1, 64)])
def test_groups_gpu(hq, hkv, d):
    """Groups 3, 5, 7, 12 on the compiled paths: shared-prefix (auto, shared, flat) and tree
    (auto, flatten, hybrid), bf16 at decode sizes."""
    rng = np.random.default_rng(hq)
    bf = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)  # noqa: E731
    b, p, s = 64, 1024, 128
    q, pk, pv, sk, sv = bf(b, 1, hq, d), bf(p, hkv, d), bf(p, hkv, d), bf(b, s, hkv, d), bf(b, s, hkv, d)
    sl = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
    want = jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, impl="reference")
    for impl in ("auto", "shared", "flat"):
        got = jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, impl=impl)
        assert rel_err(got, want) < 2e-2, impl
    tree = random_forest(np.random.default_rng(1), 1, 3, 4, 300, seqs_per_leaf=(2, 4))
    q, kp, vp, sk, sv, sl = tree_inputs(tree, tq=1, hq=hq, hkv=hkv, d=d, smax=64, seed=2,
                                        dtype=jnp.bfloat16)
    want, _ = concat_oracle(tree, q, kp, vp, sk, sv, sl)
    for impl in ("auto", "flatten", "hybrid"):
        got = jpa.tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl)
        assert rel_err(got, want) < 2e-2, impl
