"""Every user-error path raises TypeError/ValueError naming the argument."""
import jax.numpy as jnp
import numpy as np
import pytest

import jax_prefix_attn as jpa
from jax_prefix_attn import reference

Q = jnp.ones((2, 3, 4, 8), jnp.float32) * 0.5
K = jnp.ones((2, 5, 2, 8), jnp.float32) * 0.25
FNS = [reference.attention, jpa.attention]


@pytest.mark.parametrize("fn", FNS)
def test_wrong_rank(fn):
    with pytest.raises(ValueError, match=r"q must have rank 4.*\(2, 3, 32\)"):
        fn(Q.reshape(2, 3, 32), K, K)
    with pytest.raises(ValueError, match=r"k must have rank 4"):
        fn(Q, K[0], K)


@pytest.mark.parametrize("fn", FNS)
def test_head_dim_mismatch(fn):
    with pytest.raises(ValueError, match=r"head_dim.*8.*16"):
        fn(Q, jnp.ones((2, 5, 2, 16)), jnp.ones((2, 5, 2, 16)))


@pytest.mark.parametrize("fn", FNS)
def test_gqa_not_divisible(fn):
    k3 = jnp.ones((2, 5, 3, 8))
    with pytest.raises(ValueError, match=r"heads_q=4.*heads_kv=3"):
        fn(Q, k3, k3)


@pytest.mark.parametrize("fn", FNS)
def test_integer_dtype(fn):
    with pytest.raises(TypeError, match=r"q must have a floating dtype.*int32"):
        fn(Q.astype(jnp.int32), K, K)
    with pytest.raises(TypeError, match=r"v must have a floating dtype|same dtype"):
        fn(Q, K, K.astype(jnp.int32))


@pytest.mark.parametrize("fn", FNS)
def test_batch_mismatch(fn):
    k1 = jnp.ones((1, 5, 2, 8))
    with pytest.raises(ValueError, match=r"batch size"):
        fn(Q, k1, k1)


@pytest.mark.parametrize("fn", FNS)
def test_k_v_shape_mismatch(fn):
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        fn(Q, K, jnp.ones((2, 6, 2, 8)))


@pytest.mark.parametrize("fn", FNS)
def test_negative_lengths(fn):
    with pytest.raises(ValueError, match=r"kv_lengths must be >= 0, got minimum -1"):
        fn(Q, K, K, kv_lengths=jnp.array([3, -1], jnp.int32))


@pytest.mark.parametrize("fn", FNS)
def test_lengths_too_long_shape_and_dtype(fn):
    with pytest.raises(ValueError, match=r"kv_lengths must be <= 5"):
        fn(Q, K, K, kv_lengths=np.array([6, 1], np.int32))
    with pytest.raises(ValueError, match=r"kv_lengths must have shape \[2\]"):
        fn(Q, K, K, kv_lengths=jnp.array([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match=r"kv_lengths must have an integer dtype"):
        fn(Q, K, K, kv_lengths=jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("fn", FNS)
def test_bad_sm_scale(fn):
    with pytest.raises(ValueError, match=r"sm_scale must be a positive"):
        fn(Q, K, K, sm_scale=-1.0)
    with pytest.raises(TypeError, match=r"sm_scale must be a Python float"):
        fn(Q, K, K, sm_scale="big")


def test_bad_impl():
    with pytest.raises(ValueError, match=r"impl must be one of"):
        jpa.attention(Q, K, K, impl="cuda")


def test_not_an_array():
    with pytest.raises(TypeError, match=r"q must be an array, got list"):
        reference.attention([[1.0]], K, K)


def test_merge_validation():
    o = jnp.ones((2, 1, 3, 4, 8))
    with pytest.raises(ValueError, match=r"lses must have shape \(2, 1, 3, 4\)"):
        jpa.merge_attention_states(o, jnp.ones((2, 1, 3)))
    with pytest.raises(ValueError, match=r"at least one"):
        jpa.merge_attention_states([], [])
    with pytest.raises(ValueError, match=r"same length as outs"):
        jpa.merge_attention_states([o[0], o[1]], [jnp.ones((1, 3, 4))])
    with pytest.raises(ValueError, match=r"outs\[1\] must have shape"):
        jpa.merge_attention_states([o[0], o[1, :, :2]], [jnp.ones((1, 3, 4)), jnp.ones((1, 2, 4))])
    with pytest.raises(TypeError, match=r"outs must have a floating dtype"):
        jpa.merge_attention_states(o.astype(jnp.int32), jnp.ones((2, 1, 3, 4)))


def test_merge_list_lse_shape_is_named():
    o = jnp.ones((2, 3, 4, 8), jnp.float32)
    lse = jnp.zeros((2, 3, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"lses\[1\] must have shape \(2, 3, 4\).*got \(2, 1, 4\)"):
        jpa.merge_attention_states([o, o], [lse, lse[:, :1]])


def test_empty_query_or_key_axes():
    """Kernels name what they cannot run (and point to the reference), which handles it: no
    query gives empty outputs, no key gives ``out = 0`` and ``lse = -inf``."""
    with pytest.raises(ValueError, match=r"impl=.flash..*seq_q=0.*use impl='reference'"):
        jpa.attention(Q[:, :0], K, K, impl="flash", interpret=True)
    with pytest.raises(ValueError, match=r"seq_k=0"):
        jpa.attention(Q, K[:, :0], K[:, :0], impl="flash", interpret=True)
    assert jpa.attention(Q[:, :0], K, K)[0].shape == (2, 0, 4, 8)
    out, lse = jpa.attention(Q, K[:, :0], K[:, :0])
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    q16, k16 = jnp.ones((2, 3, 4, 16), jnp.float32), jnp.ones((2, 5, 2, 16), jnp.float32)
    pk, sk = k16[0, :4], k16[:, :3]
    sl = jnp.array([1, 3], jnp.int32)
    for q, s, lens in ((q16[:, :0], sk, sl), (q16[:0], sk[:0], sl[:0])):
        with pytest.raises(ValueError, match=r"q must hold at least one sequence and one query.*"
                                             r"use impl='reference'"):
            jpa.shared_prefix_attention(q, pk, pk, s, s, suffix_lengths=lens, impl="shared",
                                        interpret=True)
        out = jpa.shared_prefix_attention(q, pk, pk, s, s, suffix_lengths=lens, impl="reference")
        assert out.shape == q.shape


@pytest.mark.parametrize("fn", FNS)
def test_causal_must_be_a_bool(fn):
    with pytest.raises(TypeError, match=r"causal must be a bool, got str"):
        fn(Q, K, K, causal="yes")
    with pytest.raises(TypeError, match=r"causal must be a bool, got int"):
        fn(Q, K, K, causal=1)


def test_tree_attention_return_lse_must_be_a_bool():
    tree = jpa.PrefixTree.from_parents([-1], [4], [0])
    q, kp = jnp.ones((1, 1, 2, 16), jnp.float32), jnp.ones((4, 1, 16), jnp.float32)
    sk = jnp.ones((1, 2, 1, 16), jnp.float32)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got int"):
        jpa.tree_attention(q, tree, kp, kp, sk, sk, suffix_lengths=jnp.array([1], jnp.int32), return_lse=1)
