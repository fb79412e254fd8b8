"""Sampling masks (top-k, top-p) against numpy, and samples staying inside them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import SamplingConfig, filter_logits, sample_tokens, top_k_mask, top_p_mask


def _np_top_p(logits, p):
    out = np.zeros_like(logits, bool)
    for b, row in enumerate(logits):
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        out[b, order[before < p]] = True
    return out


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
    greedy = sample_tokens(logits, keys, 0, SamplingConfig())
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(logits).argmax(-1))


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_config_rejects(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)
