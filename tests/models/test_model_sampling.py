"""Sampling masks (top-k, top-p, min-p), penalties and top-k log-probabilities against numpy
references of their rules on fixed logits, and samples staying inside the masks."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.penalties import add_tokens, apply_penalties, prompt_seen_mask
from models.sampling import (DEFAULT_SAMPLING, GREEDY, VALUE_FIELDS, SamplingConfig, filter_logits, min_p_mask,
                             sample_keys, sample_tokens, token_logprobs, top_k_mask, top_logprobs, top_p_mask)
from models.sampling_params import SamplingParams


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


@pytest.mark.parametrize("name,value,expected", [
    ("temperature", -1.0, r"a finite float >= 0 \(0 = greedy\)"), ("temperature", float("inf"), "a finite float"),
    ("top_k", -2, r"an int >= 0 \(0 = off\)"), ("top_p", 0.0, r"a float in \(0, 1\]"), ("top_p", 1.5, r"\(0, 1\]"),
    ("min_p", -0.1, r"a float in \[0, 1\]"), ("min_p", 1.1, r"\[0, 1\]"), ("min_p", float("nan"), r"\[0, 1\]"),
    ("repetition_penalty", 0.0, "a finite float > 0"), ("repetition_penalty", float("inf"), "a finite float > 0"),
    ("presence_penalty", 2.5, r"a float in \[-2, 2\]"), ("frequency_penalty", -3.0, r"\[-2, 2\]")])
def test_sampling_config_rejects_values_out_of_range(name, value, expected):
    """ValueError naming the field, the value received and the range expected."""
    with pytest.raises(ValueError, match=rf"^{name}: received {re.escape(repr(value))}, expected .*{expected}"):
        SamplingConfig(**{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty", "top_k"])
@pytest.mark.parametrize("value", ["0.1", None, True, [0.5], np.bool_(False)])
def test_sampling_config_rejects_other_types(name, value):
    """TypeError naming the field, the type and value received and what was expected -- checked
    before the range, so no comparison of a string or None escapes as a bare TypeError."""
    want = rf"^{name}: received {type(value).__name__} {re.escape(repr(value))}, expected an? (finite )?(float|int)"
    with pytest.raises(TypeError, match=want):
        SamplingConfig(**{name: value})
    with pytest.raises(TypeError, match=want):
        SamplingParams(**{name: value})


def test_sampling_config_takes_numpy_numbers():
    cfg = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(7), top_p=np.float64(0.9),
                         min_p=np.float32(0.1), repetition_penalty=np.int32(2), presence_penalty=np.float16(-1))
    assert cfg == SamplingConfig(temperature=0.5, top_k=7, top_p=0.9, min_p=float(np.float32(0.1)),
                                 repetition_penalty=2.0, presence_penalty=-1.0)
    assert type(cfg.top_k) is int and all(type(getattr(cfg, n)) is float for n in VALUE_FIELDS)
    assert SamplingParams(min_p=np.float32(0.1)).config().min_p == float(np.float32(0.1))


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


def _np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("min_p", [1e-4, 0.05, 0.3, 1.0])
def test_min_p_mask_is_the_vllm_rule(min_p):
    """Kept: p >= min_p * p_max, computed from the softmax in float64."""
    logits = (3 * np.random.default_rng(10).normal(size=(5, 300))).astype(np.float32)
    probs = _np_softmax(logits)
    want = probs >= min_p * probs.max(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(min_p_mask(jnp.asarray(logits), min_p)), want)


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
                                 SamplingConfig(temperature=1.5, top_k=20, top_p=1.0, min_p=0.3),
                                 SamplingConfig(temperature=1.0, top_k=0, top_p=0.8, min_p=0.02)])
def test_min_p_after_temperature_before_top_k_and_top_p(cfg):
    """filter_logits: min-p on the temperature-scaled distribution, then top-k, then the
    nucleus of what min-p left (vLLM's order); samples stay inside the mask."""
    logits = (2 * np.random.default_rng(11).normal(size=(4, 400))).astype(np.float32)
    x = logits / np.float32(cfg.temperature)
    probs = _np_softmax(x)
    x = np.where(probs >= cfg.min_p * probs.max(-1, keepdims=True), x, -np.inf).astype(np.float32)
    if cfg.top_k:
        x = np.where(x >= np.sort(x, axis=-1)[:, ::-1][:, cfg.top_k - 1:cfg.top_k], x, -np.inf)
    want = np.isfinite(x)
    if cfg.top_p < 1:
        want &= _np_top_p_ties(np.where(want, x, -np.inf), cfg.top_p)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), cfg)))
    np.testing.assert_array_equal(got, want)
    off = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), dataclasses.replace(cfg, min_p=0.0))))
    assert (off >= got).all() and off.sum() > got.sum(), "min_p should remove tokens here"
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    draw = jax.jit(lambda s: sample_tokens(jnp.asarray(logits), keys, s, cfg))
    seen = np.stack([np.asarray(draw(s)) for s in range(30)])
    assert got[np.arange(4)[None, :], seen].all() and len(np.unique(seen[:, 0])) > 1


def _np_penalties(logits, prompt_seen, counts, rep, pres, freq):
    """vLLM's rules, written out: repetition on prompt or generated ids, then frequency and presence
    on the generated counts."""
    x = np.asarray(logits, np.float64).copy()
    seen = prompt_seen | (counts > 0)
    pos = seen & (x > 0)
    neg = seen & (x <= 0)
    x[pos] /= rep
    x[neg] *= rep
    x -= freq * counts
    x -= pres * (counts > 0)
    return x


@pytest.mark.parametrize("rep,pres,freq", [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4),
                                           (1.0, -0.5, 0.0), (1.5, 0.5, 0.25)])
def test_penalties_match_numpy(rep, pres, freq):
    rng = np.random.default_rng(12)
    b, v = 4, 60
    logits = (2 * rng.normal(size=(b, v))).astype(np.float32)
    prompts = [rng.integers(0, v, size=n).tolist() for n in (1, 5, 12, 30)]
    generated = [rng.integers(0, v, size=n).tolist() for n in (0, 3, 8, 20)]
    counts = np.stack([np.bincount(g, minlength=v) for g in generated]).astype(np.int32)
    seen = prompt_seen_mask(prompts, v)
    np.testing.assert_array_equal(seen, np.stack([np.isin(np.arange(v), p) for p in prompts]))
    cfg = SamplingConfig(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    assert cfg.penalized
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(seen), cfg))
    want = _np_penalties(logits, seen, counts, rep, pres, freq)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(got, logits), "the penalty should change the logits"


def test_penalties_on_padded_vocabulary_and_neutral_config():
    """A prompt mask narrower than the logits (a split vocabulary's padding) counts the extra
    columns as unseen; the neutral config is not penalized (no counts are kept)."""
    logits = np.asarray([[2.0, -1.0, 3.0, 0.5, 4.0, -2.0]], np.float32)
    seen = prompt_seen_mask([[0, 1]], 4)
    counts = np.asarray([[0, 0, 1, 0, 2, 0]], np.int32)
    cfg = SamplingConfig(repetition_penalty=2.0)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(seen), cfg))
    np.testing.assert_allclose(got, [[1.0, -2.0, 1.5, 0.5, 2.0, -2.0]])
    assert not SamplingConfig().penalized and not GREEDY.penalized
    with pytest.raises(ValueError, match="needs prompt_seen_bv"):
        apply_penalties(jnp.asarray(logits), jnp.asarray(counts), None, cfg)


def test_add_tokens_counts_active_rows_only():
    counts = jnp.zeros((3, 8), jnp.int32)
    for toks, active in (([1, 2, 3], [1, 1, 1]), ([1, 5, 3], [1, 0, 1]), ([1, 5, 7], [1, 1, 0])):
        counts = add_tokens(counts, jnp.asarray(toks), jnp.asarray(active, bool))
    want = np.zeros((3, 8), np.int32)
    for r, toks in enumerate(([1, 1, 1], [2, 5], [3, 3])):
        np.add.at(want[r], toks, 1)
    np.testing.assert_array_equal(np.asarray(counts), want)


@pytest.mark.parametrize("k", [1, 5, 70])
def test_top_logprobs_match_numpy(k):
    logits = (3 * np.random.default_rng(13).normal(size=(3, 70))).astype(np.float32)
    logp = np.log(_np_softmax(logits))
    ids, lps = (np.asarray(a) for a in top_logprobs(jnp.asarray(logits), k))
    want_ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(lps, np.take_along_axis(logp, want_ids, -1), atol=1e-5)
    # padded columns past vocab_size are never reported
    padded = np.concatenate([logits, np.full((3, 10), 50.0, np.float32)], axis=1)
    ids2, lps2 = (np.asarray(a) for a in top_logprobs(jnp.asarray(padded), k, vocab_size=70))
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(lps2, lps, atol=1e-6)
