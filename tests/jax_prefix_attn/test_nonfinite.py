"""Non-finite inputs: a row that sees a NaN (its query, or a key or value it sees) gets NaN in
``out`` and ``lse`` in every implementation, the merges and the gradients; the other rows are
unaffected; NaN in unused buffer regions has no effect."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_prefix_attn as jpa
from helpers import random_forest, rel_err, tree_inputs

SHARED = [dict(impl="reference"), dict(impl="shared", interpret=True),
          dict(impl="flat", interpret=True)]


def _case(seed=0, b=3, tq=1, hq=4, hkv=2, d=16, p=12, s=7, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    r = lambda *sh: np.asarray(rng.standard_normal(sh, np.float32))  # noqa: E731
    q, pk, pv, sk, sv = r(b, tq, hq, d), r(p, hkv, d), r(p, hkv, d), r(b, s, hkv, d), r(b, s, hkv, d)
    sl = np.array([s, 3, 0][:b], np.int32)
    return [jnp.asarray(x, dtype) for x in (q, pk, pv, sk, sv)], jnp.asarray(sl)


@pytest.fixture(scope="module")
def shared_fns():
    """One jitted function per implementation (traced arrays: every test below reuses it)."""
    def make(kw):
        return jax.jit(lambda q, pk, pv, sk, sv, sl: jpa.shared_prefix_attention(
            q, pk, pv, sk, sv, suffix_lengths=sl, return_lse=True, **kw))
    return [make(kw) for kw in SHARED]


def _split_rows(out, lse, nan_rows):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.isnan(out[nan_rows]).any(-1).all() and np.isnan(lse[nan_rows]).all()
    assert np.isfinite(out[~nan_rows]).all() and not np.isnan(lse[~nan_rows]).any()
    return out[~nan_rows], lse[~nan_rows]


@pytest.mark.parametrize("where", ["prefix_k", "prefix_v", "suffix_k", "q"])
def test_nan_reaches_exactly_the_rows_that_see_it(shared_fns, where):
    """A NaN in a prefix key or value, a suffix key or a query: every implementation gives NaN
    (out and lse) exactly on the rows that see it, and the other rows equal the clean call."""
    (q, pk, pv, sk, sv), sl = _case()
    clean = [f(q, pk, pv, sk, sv, sl) for f in shared_fns]
    nan_rows = np.zeros(q.shape[:3], bool)
    if where == "prefix_k":
        pk = pk.at[4, 1, 3].set(jnp.nan)           # kv head 1: query heads 2, 3 of every sequence
        nan_rows[:, :, 2:] = True
    elif where == "prefix_v":
        pv = pv.at[4, 0, 3].set(jnp.nan)
        nan_rows[:, :, :2] = True
    elif where == "suffix_k":
        sk = sk.at[1, 2, 0, 0].set(jnp.nan)        # sequence 1 sees suffix keys < 3
        nan_rows[1, :, :2] = True
    else:
        q = q.at[2, 0, 3, 5].set(jnp.nan)
        nan_rows[2, 0, 3] = True
    for f, (o_ref, l_ref) in zip(shared_fns, clean):
        out, lse = _split_rows(*f(q, pk, pv, sk, sv, sl), nan_rows)
        assert rel_err(out, np.asarray(o_ref)[~nan_rows]) < 1e-6
        np.testing.assert_allclose(lse, np.asarray(l_ref)[~nan_rows], rtol=1e-6)


def test_nan_past_lengths_has_no_effect(shared_fns):
    (q, pk, pv, sk, sv), sl = _case()
    want = [f(q, pk, pv, sk, sv, sl) for f in shared_fns]
    past = np.arange(sk.shape[1])[None, :, None, None] >= np.asarray(sl)[:, None, None, None]
    sk, sv = jnp.where(past, jnp.nan, sk), jnp.where(past, jnp.nan, sv)
    for f, (o, l) in zip(shared_fns, want):
        got_o, got_l = f(q, pk, pv, sk, sv, sl)
        np.testing.assert_array_equal(np.asarray(got_o), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(got_l), np.asarray(l))


@pytest.mark.parametrize("impl", ["reference", "flash"])
def test_attention_nan_key_gives_nan_lse(impl):
    """``attention``: a row that sees a NaN key gets NaN in ``out`` and ``lse`` (never
    ``lse = -inf``, which means ``out = 0``), and an empty row stays ``(0, -inf)``."""
    (q, _, _, k, v), ln = _case(tq=2)
    k = k.at[0, 1, 0, 0].set(jnp.nan)
    out, lse = jpa.attention(q, k, v, causal=True, kv_lengths=ln, impl=impl,
                             interpret=impl == "flash")
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[0, :, :2]).any(-1).all() and np.isnan(lse[0, :, :2]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()
    assert (out[2] == 0).all() and (lse[2] == -np.inf).all()            # length 0: no key


@pytest.mark.parametrize("impl", ["reference", "flash"])
def test_large_finite_float16_rows_keep_a_finite_lse(impl):
    """Finite float16 outputs whose row sum overflows float16 (128 values near 600) are not
    flagged: their LSE stays finite and equals the float32 computation's."""
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((2, 4, 2, 128)), jnp.float16) for _ in range(2))
    v = jnp.asarray(600 + rng.standard_normal((2, 4, 2, 128)), jnp.float16)
    out, lse = jpa.attention(q, k, v, impl=impl, interpret=impl == "flash")
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    _, lse32 = jpa.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                             impl="reference")
    assert rel_err(lse, lse32) < 2e-2


def test_merge_reads_nan_lse_as_nan_not_empty():
    rng = np.random.default_rng(0)
    outs = jnp.asarray(rng.standard_normal((3, 2, 5, 8), np.float32))
    lses = jnp.asarray(rng.standard_normal((3, 2, 5), np.float32))
    lses = lses.at[1, 0, 2].set(jnp.nan).at[:, 1, 4].set(-jnp.inf)
    outs = outs.at[2, 1, 1, 3].set(jnp.nan).at[:, 1, 4].set(jnp.nan)   # live / empty parts
    out, lse = jax.jit(jpa.merge_attention_states)(outs, lses)
    out, lse = np.asarray(out), np.asarray(lse)
    bad = np.zeros((2, 5), bool)
    bad[0, 2] = bad[1, 1] = True
    assert np.isnan(out[bad]).any(-1).all() and np.isnan(lse[bad]).all()
    assert (out[1, 4] == 0).all() and lse[1, 4] == -np.inf             # every part empty
    assert np.isfinite(out[~bad & (lse > -np.inf)]).all()


def test_tree_nan_in_a_node():
    """A NaN in a node's span reaches the sequences below that node (out and lse NaN) in the
    kernels and the reference; sequences elsewhere are unaffected."""
    tree = random_forest(np.random.default_rng(3), 2, 2, 2, 12)
    q, kp, vp, sk, sv, sl = tree_inputs(tree, tq=1, hq=4, hkv=2, d=16, smax=5, seed=1)
    node = int(np.argmax(tree.lengths))
    kp = kp.at[tree.starts[node], 1, 2].set(jnp.nan)
    below = np.array([node in tree.path(i) for i in range(tree.num_seqs)])
    assert below.any() and not below.all()
    for kw in (dict(impl="reference"), dict(impl="flatten", interpret=True)):
        out, lse = jax.jit(lambda q, kp, kw=kw: jpa.tree_attention(
            q, tree, kp, vp, sk, sv, suffix_lengths=sl, return_lse=True, **kw))(q, kp)
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(lse[below][:, :, 2:]).all() and np.isnan(out[below][:, :, 2:]).any(-1).all()
        assert np.isfinite(lse[~below]).all() and np.isfinite(out[~below]).all()
        assert np.isfinite(out[:, :, :2]).all()                         # the other kv head


def test_gradients_nan_rows_only():
    """Gradients: the rows that see a NaN (and the inputs they read) get NaN gradients; the
    other sequences' query and suffix gradients equal the clean ones."""
    (q, pk, pv, sk, sv), sl = _case()
    bad_sk = sk.at[0, 1, 0, 0].set(jnp.nan)
    for kw in (dict(impl="reference"), dict(impl="shared", interpret=True)):
        def loss(q, sk, kw=kw):
            return jnp.sum(jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl,
                                                       **kw) ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        dq0, dsk0 = grad(q, sk)
        dq, dsk = grad(q, bad_sk)
        dq, dsk = np.asarray(dq), np.asarray(dsk)
        assert np.isnan(dq[0, :, :2]).any()
        np.testing.assert_allclose(dq[1:], np.asarray(dq0)[1:], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dsk[1:], np.asarray(dsk0)[1:], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "shared", "flat"])
@pytest.mark.parametrize("b", [16, 256])
def test_nan_rows_gpu(impl, b):
    """The compiled paths at decode sizes (the Mosaic GPU leaves at B=256 on Hopper)."""
    (q, pk, pv, sk, sv), _ = _case(b=b, hq=32, hkv=8, d=128, p=2048, s=256, dtype=jnp.bfloat16)
    sl = jnp.asarray(np.random.default_rng(1).integers(0, 257, b), jnp.int32)
    pk = pk.at[100, 3, 7].set(jnp.nan)
    q = q.at[5, 0, 30, 1].set(jnp.nan)
    past = np.arange(256)[None, :, None, None] >= np.asarray(sl)[:, None, None, None]
    sv = jnp.where(past, jnp.nan, sv)
    out, lse = jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, impl=impl,
                                           return_lse=True)
    ref_o, ref_l = jpa.shared_prefix_attention(q, pk, pv, sk, jnp.where(past, 0, sv),
                                               suffix_lengths=sl, impl="reference",
                                               return_lse=True)
    nan_rows = np.zeros((b, 1, 32), bool)
    nan_rows[:, :, 12:16] = True
    nan_rows[5, 0, 30] = True
    out, lse = _split_rows(out, lse, nan_rows)
    assert rel_err(out, np.asarray(ref_o, np.float32)[~nan_rows]) < 2e-2
    np.testing.assert_allclose(lse, np.asarray(ref_l)[~nan_rows], atol=2e-2)
