"""Sampling masks (top-k, top-p) against numpy, and samples staying inside them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import (DEFAULT_SAMPLING, GREEDY, SamplingConfig, filter_logits, sample_keys, sample_tokens,
                             token_logprobs, top_k_mask, top_p_mask)


def _np_top_p(logits, p):
    out = np.zeros_like(logits, bool)
    for b, row in enumerate(logits):
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        out[b, order[before < p]] = True
    return out


def _np_top_p_ties(logits, p):
    """_np_top_p, then whole tie groups: every token equal to the smallest kept logit is kept
    (the module's semantics: the mask is ``logits >= threshold``)."""
    kept = _np_top_p(logits, p)
    thr = np.where(kept, logits, np.inf).min(-1, keepdims=True)
    return logits >= thr


def test_top_k_mask():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    for k in (1, 5, 50, 80):
        got = np.asarray(top_k_mask(jnp.asarray(logits), k))
        want = logits >= np.sort(logits, axis=-1)[:, ::-1][:, min(k, 50) - 1:min(k, 50)]
        np.testing.assert_array_equal(got, want)
        assert (got.sum(-1) == min(k, 50)).all()


@pytest.mark.parametrize("p", [1e-6, 0.3, 0.9, 0.999])
def test_top_p_mask(p):
    logits = (3 * np.random.default_rng(1).normal(size=(6, 40))).astype(np.float32)
    got = np.asarray(top_p_mask(jnp.asarray(logits), p))
    np.testing.assert_array_equal(got, _np_top_p(logits, p))
    assert got[np.arange(6), logits.argmax(-1)].all()  # the most probable token always survives


@pytest.mark.parametrize("p", [0.05, 0.9, 0.999])
def test_top_p_mask_beyond_candidates(p):
    """Flat rows whose nucleus holds more than the candidate set (bisection fallback) and, with
    few candidates, rows that mix both cases; integer-valued logits add ties at the threshold."""
    rng = np.random.default_rng(3)
    flat = (0.3 * rng.normal(size=(3, 3000))).astype(np.float32)            # nucleus >> 256 tokens
    ties = rng.integers(-4, 3, size=(3, 3000)).astype(np.float32)           # many exact ties
    logits = np.concatenate([flat, ties])
    for cands in (256, 4):
        got = np.asarray(jax.jit(lambda x: top_p_mask(x, p, candidates=cands))(jnp.asarray(logits)))
        np.testing.assert_array_equal(got, _np_top_p_ties(logits, p), err_msg=f"candidates={cands}")
    assert got[:3].sum(-1).min() > 256 or p < 0.5


@pytest.mark.parametrize("k,p", [(5, 0.7), (40, 0.5), (40, 0.999), (300, 0.9)])
def test_top_k_then_top_p_matches_numpy(k, p):
    """filter_logits == numpy top-k mask (ties kept) followed by the numpy nucleus of the survivors."""
    rng = np.random.default_rng(4)
    logits = np.concatenate([(2 * rng.normal(size=(3, 500))).astype(np.float32),
                             rng.integers(-3, 3, size=(3, 500)).astype(np.float32)])  # ties at the k-th value
    t = 0.7
    x = logits / np.float32(t)
    kth = np.sort(x, axis=-1)[:, ::-1][:, min(k, 500) - 1:min(k, 500)]
    xk = np.where(x >= kth, x, -np.inf).astype(np.float32)
    want = _np_top_p_ties(xk, p) & np.isfinite(xk)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), SamplingConfig(temperature=t, top_k=k, top_p=p))))
    np.testing.assert_array_equal(got, want)
    assert (got.sum(-1) >= 1).all()


@pytest.mark.parametrize("cfg,scale", [(SamplingConfig(temperature=1.0, top_p=0.9), 0.2),
                                       (SamplingConfig(temperature=1.0, top_k=50, top_p=0.95), 4.0)])
def test_large_vocab_samples_inside_mask(cfg, scale):
    """V > candidates: flat rows (bisection + full-row draw) and peaked rows (candidate draw)."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray((scale * rng.normal(size=(3, 2000))).astype(np.float32))
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    allowed = np.isfinite(np.asarray(filter_logits(logits, cfg)))
    draw = jax.jit(lambda s: sample_tokens(logits, keys, s, cfg))
    seen = np.stack([np.asarray(draw(s)) for s in range(20)])
    assert allowed[np.arange(3)[None, :], seen].all()
    assert len(np.unique(seen[:, 0])) > 1
    np.testing.assert_array_equal(seen[3], np.asarray(draw(3)))  # deterministic per (key, step)


def test_samples_stay_inside_masks():
    rng = np.random.default_rng(2)
    logits = jnp.asarray((2 * rng.normal(size=(4, 64))).astype(np.float32))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    cfg = SamplingConfig(temperature=1.3, top_k=6, top_p=0.8)
    allowed = np.isfinite(np.asarray(filter_logits(logits, cfg)))
    assert (allowed.sum(-1) <= 6).all() and (allowed.sum(-1) >= 1).all()
    draw = jax.jit(lambda s: sample_tokens(logits, keys, s, cfg))
    seen = np.stack([np.asarray(draw(s)) for s in range(60)])  # [steps, B]
    assert allowed[np.arange(4)[None, :], seen].all()
    assert len(np.unique(seen[:, 0])) > 1  # actually random across steps
    greedy = sample_tokens(logits, keys, 0, GREEDY)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(logits).argmax(-1))


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_config_rejects(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)


def test_defaults_are_the_documented_ones():
    assert SamplingConfig() == DEFAULT_SAMPLING == SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)
    assert GREEDY.greedy and not DEFAULT_SAMPLING.greedy


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0, top_p=0.9),              # top-p alone
                                 SamplingConfig(temperature=1.0, top_k=0, top_p=1.0),      # whole row
                                 SamplingConfig(temperature=0.9, top_k=40, top_p=0.95)])   # top-k + top-p
def test_a_row_draws_the_same_token_in_any_batch(cfg):
    """A peaked row (its nucleus inside the candidates) and a flat row (bisection, whole-row
    draw): the peaked row's tokens alone equal its tokens next to the flat row, step by step."""
    rng = np.random.default_rng(6)
    peaked = (4 * rng.normal(size=(1, 2000))).astype(np.float32)    # nucleus 0.9: ~33 tokens
    flat = (0.2 * rng.normal(size=(1, 2000))).astype(np.float32)     # nucleus > the 256 candidates
    keys = sample_keys(3, [0, 1], [2, 0])
    both = jax.jit(lambda s: sample_tokens(jnp.asarray(np.concatenate([peaked, flat])), keys, s, cfg))
    alone = jax.jit(lambda s: sample_tokens(jnp.asarray(peaked), keys[:1], s, cfg))
    got_both = np.stack([np.asarray(both(s)) for s in range(12)])
    got_alone = np.stack([np.asarray(alone(s)) for s in range(12)])
    np.testing.assert_array_equal(got_both[:, 0], got_alone[:, 0])
    assert len(np.unique(got_both[:, 1])) > 1 and len(np.unique(got_both[:, 0])) > 1  # actually random


def test_sample_keys_depend_only_on_seed_prompt_and_sample():
    a = np.asarray(sample_keys(5, [0, 0, 1, 1], [0, 1, 0, 1]))
    b = np.asarray(sample_keys(5, [1, 0], [1, 1]))
    np.testing.assert_array_equal(b, a[[3, 1]])
    assert len({tuple(k) for k in a}) == 4
    assert not np.array_equal(np.asarray(sample_keys(6, [0], [0])), a[:1])
    with pytest.raises(ValueError, match="seed must be an int in"):
        sample_keys(-1, [0], [0])


def test_token_logprobs_is_log_softmax():
    logits = (3 * np.random.default_rng(9).normal(size=(3, 70))).astype(np.float32)
    toks = np.asarray([5, 0, 69])
    want = logits[np.arange(3), toks] - np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(toks))), want, atol=1e-5)
