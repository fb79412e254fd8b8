"""NNXLlama: nnx.Param leaves over the functional decoder; round trips plain tree <-> module <->
nnx.split state in both layer layouts, identical outputs, load_params checks, and one training
step that lowers a loss both with nnx.Optimizer and with plain optax on the split state."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from helpers import tiny_config, tiny_state_dict
from models import LlamaConfig, params_from_hf_state_dict, unstack_layers
from models.training.nnx_llama import NNXLlama, grpo_train_step, params_from_state
from models.training.logprobs import completion_logprobs
from models.training.rl import GRPOBatch, GRPOConfig, group_advantages, grpo_loss, grpo_objective

G, N, P, C = 2, 2, 5, 4


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(tie_word_embeddings=True)
    config = LlamaConfig.from_hf_config(dict(cfg, model_type="llama"))
    params = params_from_hf_state_dict(config, tiny_state_dict(cfg, seed=2), jnp.float32)
    rng = np.random.default_rng(4)
    v = cfg["vocab_size"]
    batch = GRPOBatch(prompt_tokens=jnp.asarray(rng.integers(0, v, (G, P)), jnp.int32),
                      prompt_lengths=jnp.asarray([5, 3], jnp.int32),
                      completion_tokens=jnp.asarray(rng.integers(0, v, (G, N, C)), jnp.int32),
                      completion_lengths=jnp.asarray([[4, 1], [2, 3]], jnp.int32),
                      advantages=group_advantages(rng.standard_normal((G, N))))
    return config, params, batch


def _same(a, b):
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["stacked", "list"])
def test_round_trips(setup, layout):
    config, stacked, _ = setup
    params = stacked if layout == "stacked" else unstack_layers(stacked)
    other = unstack_layers(stacked) if layout == "stacked" else stacked
    model = NNXLlama(config, params)
    assert model.lm_head is None                          # tied embeddings
    assert isinstance(model.embed, nnx.Param)
    _same(model.to_params(), params)
    graphdef, state = nnx.split(model, nnx.Param)
    assert all(isinstance(v, nnx.Param) for v in jax.tree_util.tree_leaves(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    _same(params_from_state(state), params)
    merged = nnx.merge(graphdef, state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(merged(tokens)), np.asarray(model.llama.forward(params, tokens)))
    doubled = jax.tree_util.tree_map(lambda x: 2 * x, params)
    model.load_params(doubled)
    _same(model.to_params(), doubled)
    with pytest.raises(ValueError, match="structure"):
        model.load_params(other)
    with pytest.raises(ValueError, match="shape"):
        model.load_params(dict(doubled, final_norm=jnp.ones((3,))))


def test_one_step_lowers_the_loss(setup):
    """Fixed old log-probs (the policy's own), adamw: one nnx.Optimizer step via
    grpo_train_step and one plain-optax step on the nnx.split state both lower the GRPO loss."""
    config, params, batch = setup
    cfg = GRPOConfig(impl="flat", remat=False)     # the shared path's gradients: test_rl.py
    model = NNXLlama(config, jax.tree_util.tree_map(jnp.copy, params))
    logprobs = jax.jit(lambda p: completion_logprobs(model.llama, p, batch.prompt_tokens, batch.prompt_lengths,
                                                     batch.completion_tokens, batch.completion_lengths))
    batch = batch.replace(old_logprobs=logprobs(params))

    def loss_of(p):
        return float(grpo_loss(logprobs(p), batch.advantages, batch.completion_lengths, cfg,
                               old_logprobs=batch.old_logprobs)[0])
    before = loss_of(params)

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = grpo_train_step(model, optimizer, batch, cfg)
    assert abs(float(metrics["loss"]) - before) < 1e-5
    after_nnx = loss_of(model.to_params())
    assert after_nnx < before, (before, after_nnx)

    graphdef, state = nnx.split(NNXLlama(config, params), nnx.Param)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(state)

    def loss_fn(state):
        m = nnx.merge(graphdef, state)
        return grpo_objective(m.llama, m.to_params(), batch, cfg)[0]
    grads = jax.jit(jax.grad(loss_fn))(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    state = optax.apply_updates(state, updates)
    after_optax = loss_of(params_from_state(state))
    assert after_optax < before, (before, after_optax)
    np.testing.assert_allclose(after_optax, after_nnx, rtol=1e-4)   # the same adamw step
