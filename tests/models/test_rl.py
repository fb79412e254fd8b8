"""GRPO: group advantages, the loss's normalisations against NumPy, the loss gradient through the
shared path against autodiff of a plain-JAX flat implementation (dense logits of each
[prompt; completion] row), the jitted optax train step, and input validation."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax

from helpers import rel_err, tiny_config, tiny_state_dict
from models import Llama, LlamaConfig, params_from_hf_state_dict
from models.training.logprobs import completion_logprobs
from models.training.rl import GRPOBatch, GRPOConfig, group_advantages, grpo_loss, grpo_objective, make_train_step

G, N, P, C = 2, 3, 6, 5


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    config = LlamaConfig.from_hf_config(dict(cfg, model_type="llama"))
    params = params_from_hf_state_dict(config, tiny_state_dict(cfg, seed=5), jnp.float32)
    rng = np.random.default_rng(7)
    v = cfg["vocab_size"]
    plen = np.array([6, 2])
    clen = np.array([[5, 1, 3], [2, 5, 4]])
    batch = GRPOBatch(prompt_tokens=jnp.asarray(rng.integers(0, v, (G, P)), jnp.int32),
                      prompt_lengths=jnp.asarray(plen, jnp.int32),
                      completion_tokens=jnp.asarray(rng.integers(0, v, (G, N, C)), jnp.int32),
                      completion_lengths=jnp.asarray(clen, jnp.int32),
                      advantages=group_advantages(rng.standard_normal((G, N))))
    model = Llama(config)
    lp = np.asarray(completion_logprobs(model, params, batch.prompt_tokens, batch.prompt_lengths,
                                        batch.completion_tokens, batch.completion_lengths))
    # old log-probs off by up to +-0.4 so that some ratios fall outside [0.8, 1.2] and clip
    old = lp + rng.uniform(-0.4, 0.4, lp.shape).astype(np.float32)
    ref = lp + rng.uniform(-0.5, 0.5, lp.shape).astype(np.float32)
    batch = batch.replace(old_logprobs=jnp.asarray(old), ref_logprobs=jnp.asarray(ref))
    return dict(model=model, params=params, batch=batch, plen=plen, clen=clen)


def test_group_advantages():
    r = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    r[2] = 1.5                                       # a group without signal
    a = np.asarray(group_advantages(r))
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
    assert (a[2] == 0).all()
    np.testing.assert_allclose(group_advantages(r, scale_by_std=False), r - r.mean(1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(r[0])


@pytest.mark.parametrize("normalisation", ["token", "sequence", "constant"])
def test_loss_normalisations_match_numpy(normalisation):
    rng = np.random.default_rng(1)
    lp = -rng.uniform(0.1, 3, (G, N, C)).astype(np.float32)
    old = lp + rng.uniform(-0.5, 0.5, lp.shape).astype(np.float32)
    ref = lp + rng.uniform(-0.5, 0.5, lp.shape).astype(np.float32)
    adv = rng.standard_normal((G, N)).astype(np.float32)
    clen = np.array([[5, 0, 3], [2, 5, 1]])
    cfg = GRPOConfig(clip_eps=0.1, clip_eps_high=0.3, kl_beta=0.05, normalisation=normalisation)
    loss, metrics = grpo_loss(lp, adv, clen, cfg, old_logprobs=old, ref_logprobs=ref)
    mask = np.arange(C)[None, None] < clen[..., None]
    ratio = np.exp(lp - old)
    per_tok = -np.minimum(ratio * adv[..., None], np.clip(ratio, 0.9, 1.3) * adv[..., None])
    per_tok += 0.05 * (np.exp(ref - lp) - (ref - lp) - 1)
    per_tok = np.where(mask, per_tok, 0)
    if normalisation == "token":
        want = per_tok.sum() / mask.sum()
    elif normalisation == "constant":
        want = per_tok.sum() / per_tok.size
    else:
        n_tok = mask.sum(-1)
        want = (per_tok.sum(-1)[n_tok > 0] / n_tok[n_tok > 0]).mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["tokens"]) == mask.sum()
    assert 0 < float(metrics["clip_fraction"]) < 1


def _flat_rows(batch, plen):
    """Host-built rows ``[prompt[:L]; completion; 0...]`` ``[G*N, P+C]`` and the positions whose
    logits predict each completion token ``[G*N, C]``."""
    rows, idx = [], []
    pt, ct = np.asarray(batch.prompt_tokens), np.asarray(batch.completion_tokens)
    for g in range(G):
        for n in range(N):
            toks = np.concatenate([pt[g, :plen[g]], ct[g, n]])
            rows.append(np.pad(toks, (0, P + C - len(toks))))
            idx.append(plen[g] - 1 + np.arange(C))
    return jnp.asarray(np.stack(rows)), jnp.asarray(np.stack(idx))


def _flat_reference_loss(model, params, batch, rows, idx, clen, config):
    """Plain JAX: dense logits of each row (Llama.forward), log-softmax, the GRPO formula
    written out with a token-level mean."""
    tgt = batch.completion_tokens.reshape(G * N, C)
    mask = jnp.asarray(np.arange(C)[None] < clen.reshape(-1, 1))
    ls = jax.nn.log_softmax(model.forward(params, rows), -1)                       # [B, P+C, V]
    lp = jnp.take_along_axis(jnp.take_along_axis(ls, idx[..., None], 1), tgt[..., None], 2)[..., 0]
    old, ref = batch.old_logprobs.reshape(G * N, C), batch.ref_logprobs.reshape(G * N, C)
    adv = jnp.repeat(batch.advantages.reshape(-1), C).reshape(G * N, C)
    ratio = jnp.exp(lp - old)
    eps = config.clip_eps
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps, 1 + eps) * adv)
    kl = jnp.exp(ref - lp) - (ref - lp) - 1
    return jnp.sum(jnp.where(mask, -obj + config.kl_beta * kl, 0)) / mask.sum()


def test_loss_gradient_equals_flat_autodiff(setup):
    model, params, batch = setup["model"], setup["params"], setup["batch"]
    cfg = GRPOConfig(kl_beta=0.1, impl="shared")
    ours = jax.jit(jax.value_and_grad(lambda p: grpo_objective(model, p, batch, cfg)[0]))
    rows, idx = _flat_rows(batch, setup["plen"])
    want = jax.jit(jax.value_and_grad(lambda p: _flat_reference_loss(model, p, batch, rows, idx, setup["clen"], cfg)))
    (l1, g1), (l2, g2) = ours(params), want(params)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    errs = [rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2))]
    assert max(errs) < 1e-4, errs
    print(f"\nGRPO grad rel err vs flat autodiff: max {max(errs):.2e}")


def test_train_step_reduces_loss(setup):
    """make_train_step with optax.adamw: the first step's loss is the objective at the initial
    parameters, the parameters move, the loss falls over three steps (fixed old log-probs; the
    flat path, cheaper to compile: the shared path's gradient is checked above)."""
    model, params, batch = setup["model"], setup["params"], setup["batch"]
    cfg = GRPOConfig(kl_beta=0.1, impl="flat")
    opt = optax.adamw(3e-3)
    step = make_train_step(model, opt, cfg)
    objective = jax.jit(lambda q: grpo_objective(model, q, batch, cfg)[0])
    start = float(objective(params))
    p = jax.tree_util.tree_map(jnp.copy, params)        # the step donates its inputs
    state = opt.init(p)
    losses = []
    for _ in range(3):
        p, state, metrics = step(p, state, batch)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert abs(losses[0] - start) < 1e-5
    assert losses[2] < losses[0], losses
    assert float(objective(p)) < losses[0]
    assert all(a.dtype == b.dtype for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(params)))


def test_bad_inputs_raise(setup):
    lp = jnp.zeros((G, N, C))
    adv, clen = jnp.zeros((G, N)), jnp.ones((G, N), jnp.int32)
    for kw, word in ((dict(clip_eps=-0.1), "clip_eps"), (dict(kl_beta=-1.0), "kl_beta"),
                     (dict(normalisation="batch"), "normalisation"), (dict(impl="tree"), "impl"),
                     (dict(clip_eps_high=-1.0), "clip_eps_high")):
        with pytest.raises(ValueError, match=word):
            GRPOConfig(**kw)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, adv[:1], clen)
    with pytest.raises(ValueError, match="completion_lengths"):
        grpo_loss(lp, adv, clen[:, :2])
    with pytest.raises(ValueError, match="old_logprobs"):
        grpo_loss(lp, adv, clen, old_logprobs=lp[:, :, :2])
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, adv, clen, GRPOConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="logprobs"):
        grpo_loss(lp[0], adv, clen)
    with pytest.raises(TypeError, match="optimizer"):
        make_train_step(setup["model"], object())
    with pytest.raises(TypeError, match="batch"):
        grpo_objective(setup["model"], setup["params"], {"prompt_tokens": 1})
