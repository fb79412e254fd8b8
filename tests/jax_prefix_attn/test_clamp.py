"""The clamp rule for traced lengths and indices (identical in every implementation), its
opt-in ``checkify`` checks (``check_ranges=True``; nothing compiled otherwise), and the dtype
rule of every entry point."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_prefix_attn as jpa
from helpers import random_forest, tree_inputs

B, TQ, HQ, HKV, D, G, P, S = 3, 2, 4, 2, 16, 2, 12, 7


@pytest.fixture(scope="module")
def shared_case():
    rng = np.random.default_rng(0)
    r = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32))  # noqa: E731
    return r(B, TQ, HQ, D), r(G, P, HKV, D), r(G, P, HKV, D), r(B, S, HKV, D), r(B, S, HKV, D)


def _shared(impl, check_ranges=False):
    return jax.jit(lambda q, pk, pv, sk, sv, sl, pl, s2p: jpa.shared_prefix_attention(
        q, pk, pv, sk, sv, suffix_lengths=sl, prefix_lengths=pl, seq_to_prefix=s2p, impl=impl,
        interpret=impl != "reference", return_lse=True, check_ranges=check_ranges))


@pytest.mark.parametrize("tq", [1, 2])
def test_shared_out_of_range_is_clamped(shared_case, tq):
    """Negative lengths, lengths past the buffers and out-of-range ``seq_to_prefix`` give, in
    every implementation, exactly the call with the clamped values."""
    q, pk, pv, sk, sv = shared_case
    q = q[:, :tq]
    bad = (jnp.array([-1, S + 3, 4]), jnp.array([P + 5, -2]), jnp.array([5, -1, 1]))
    clamped = (jnp.array([0, S, 4]), jnp.array([P, 0]), jnp.array([1, 0, 1]))
    for impl in ("reference", "shared", "flat"):
        f = _shared(impl)
        got, want = f(q, pk, pv, sk, sv, *bad), f(q, pk, pv, sk, sv, *clamped)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=impl)


def test_attention_out_of_range_is_clamped():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16), np.float32))
    k = jnp.asarray(rng.standard_normal((2, 6, 2, 16), np.float32))
    f = jax.jit(lambda ln, impl: jpa.attention(q, k, k, causal=True, kv_lengths=ln, impl=impl,
                                                  interpret=True), static_argnums=1)
    for impl in ("reference", "flash"):
        got = f(jnp.array([9, -4]), impl)
        want = f(jnp.array([6, 0]), impl)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_tree_out_of_range_is_clamped():
    """``tree_attention`` with lengths out of range equals the clamped call; draft parents out
    of ``[-1, t - 1]`` are clamped too."""
    tree = random_forest(np.random.default_rng(2), 2, 2, 2, 10)
    q, kp, vp, sk, sv, sl = tree_inputs(tree, tq=3, hq=4, hkv=2, d=16, smax=6, seed=0)
    bad = np.asarray(sl).copy()
    bad[0], bad[-1] = -3, 40
    dp_bad = jnp.array([-5, 7, 0])
    for impl in ("reference", "flatten"):
        f = jax.jit(lambda sl, dp, impl=impl: jpa.tree_attention(
            q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl, interpret=True,
            draft_parents=dp))
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(bad), None)),
                                      np.asarray(f(jnp.asarray(np.clip(bad, 0, 6)), None)))
        np.testing.assert_array_equal(   # drafts: lengths clamp to [Tq, S], parents to [-1, t-1]
            np.asarray(f(jnp.asarray(bad), dp_bad)),
            np.asarray(f(jnp.asarray(np.clip(bad, 3, 6)), jnp.array([-1, 0, 0]))))


def test_checkify_reports_out_of_range(shared_case):
    q, pk, pv, sk, sv = shared_case
    f = checkify.checkify(_shared("reference", check_ranges=True), errors=checkify.user_checks)
    err, _ = f(q, pk, pv, sk, sv, jnp.array([0, S + 1, 2]), jnp.array([P, 3]), jnp.array([0, 1, 1]))
    assert re.search(r"suffix_lengths out of range.*\[0, 7\].*got \[0 8 2\]", err.get())
    err, _ = f(q, pk, pv, sk, sv, jnp.array([0, 1, 2]), jnp.array([P, 3]), jnp.array([0, 2, 1]))
    assert "seq_to_prefix out of range" in err.get()
    err, _ = f(q, pk, pv, sk, sv, jnp.array([0, 1, 2]), jnp.array([P, -1]), jnp.array([0, 1, 1]))
    assert "prefix_lengths out of range" in err.get()
    err, _ = f(q, pk, pv, sk, sv, jnp.array([0, 1, 2]), jnp.array([P, 3]), jnp.array([0, 1, 1]))
    assert err.get() is None
    g = checkify.checkify(jax.jit(lambda ln: jpa.attention(q, sk, sv, kv_lengths=ln,
                                                           check_ranges=True)[0]),
                          errors=checkify.user_checks)
    assert "kv_lengths out of range" in g(jnp.array([1, 2, S + 1]))[0].get()
    tree = random_forest(np.random.default_rng(2), 2, 2, 2, 10)
    tq, kp, vp, tsk, tsv, sl = tree_inputs(tree, tq=1, hq=4, hkv=2, d=16, smax=6, seed=0)
    t = checkify.checkify(jax.jit(lambda ln: jpa.tree_attention(
        tq, tree, kp, vp, tsk, tsv, suffix_lengths=ln, impl="reference", check_ranges=True)),
        errors=checkify.user_checks)
    assert "suffix_lengths out of range" in t(jnp.asarray(sl).at[0].set(-1))[0].get()
    assert t(jnp.asarray(sl))[0].get() is None


def test_no_check_is_compiled_without_check_ranges(shared_case):
    """By default the program holds no check (no callback, no error value) and runs under a
    plain ``jit``; with ``check_ranges=True`` it needs ``checkify`` (JAX's own error)."""
    q, pk, pv, sk, sv = shared_case
    args = (q, pk, pv, sk, sv, jnp.array([0, 1, 2]), jnp.array([P, 3]), jnp.array([0, 1, 1]))
    text = _shared("reference").lower(*args).as_text()
    assert "callback" not in text and "custom_call" not in text
    jax.block_until_ready(_shared("reference")(*args))
    with pytest.raises(Exception, match="checkify"):
        _shared("reference", check_ranges=True).lower(*args).compile()


def test_concrete_out_of_range_still_raises(shared_case):
    q, pk, pv, sk, sv = shared_case
    with pytest.raises(ValueError, match="suffix_lengths must be <= 7"):
        jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=np.array([0, 8, 1]),
                                    seq_to_prefix=np.array([0, 1, 1]))
    with pytest.raises(ValueError, match=r"seq_to_prefix values must be in \[0, 2\)"):
        jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=np.array([0, 1, 1]),
                                    seq_to_prefix=np.array([0, 2, 1]))


def test_one_dtype_rule(shared_case):
    """Queries, keys and values of different dtypes (float32 ``q`` with bfloat16 ``k``/``v``)
    are a TypeError naming both arguments and dtypes at every entry point."""
    q, pk, pv, sk, sv = shared_case
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    msg = r"q and {} must have the same dtype.*got q float32 and {} bfloat16"
    with pytest.raises(TypeError, match=msg.format("k", "k")):
        jpa.attention(q, bf(sk), bf(sv))
    with pytest.raises(TypeError, match=msg.format("prefix_k", "prefix_k")):
        jpa.shared_prefix_attention(q, bf(pk), bf(pv), sk, sv, suffix_lengths=np.array([0, 1, 1]),
                                    seq_to_prefix=np.array([0, 1, 1]))
    tree = random_forest(np.random.default_rng(2), 2, 2, 2, 10)
    tq, kp, vp, tsk, tsv, sl = tree_inputs(tree, tq=1, hq=4, hkv=2, d=16, smax=6, seed=0)
    with pytest.raises(TypeError, match=msg.format("k_pool", "k_pool")):
        jpa.tree_attention(tq, tree, bf(kp), bf(vp), bf(tsk), bf(tsv), suffix_lengths=sl)
    with pytest.raises(TypeError, match=r"outs\[0\] and outs\[1\] must have the same dtype"):
        jpa.merge_attention_states([q, bf(q)], [q[..., 0], q[..., 0]])
