"""``completion_logprobs`` for the DeepSeek family: prompts run once and the completions attend
their prompt's latents as a grouped shared prefix (absorbed MLA), against every completion behind
its own copy of its prompt and against log-softmax of the plain forward; gradients of both
forms agree, under ``jax.jit`` and with rematerialisation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.deepseek import Deepseek, DeepseekConfig, init_params
from models.training.logprobs import completion_logprobs

CONFIG = DeepseekConfig.from_hf_config({
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 53, "hidden_size": 32,
    "intermediate_size": 24, "moe_intermediate_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": 6,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "first_k_dense_replace": 1,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                     "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 0, "eos_token_id": 1})


@pytest.fixture(scope="module")
def model_params():
    return Deepseek(CONFIG, impl="reference"), init_params(CONFIG, seed=3, dtype=jnp.float32, std=0.2)


def _batch(seed):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, CONFIG.vocab_size, (3, 7))
    plen = np.array([7, 2, 5])
    comps = rng.integers(2, CONFIG.vocab_size, (3, 4, 5))
    clen = np.array([[5, 0, 2, 5], [1, 5, 3, 4], [5, 5, 0, 1]])
    return prompts, plen, comps, clen


def test_shared_and_flat_equal_the_plain_forward(model_params):
    model, params = model_params
    prompts, plen, comps, clen = _batch(0)
    shared = np.asarray(completion_logprobs(model, params, prompts, plen, comps, clen, impl="shared"))
    flat = np.asarray(completion_logprobs(model, params, prompts, plen, comps, clen, impl="flat"))
    np.testing.assert_allclose(shared, flat, rtol=1e-5, atol=1e-5)
    # The plain forward of every (prompt, completion) sequence, right-padded to one length and
    # run as one jitted batch: the forward is causal and routes each token on its own, so a
    # position's logits do not depend on the padding after it.
    seqs = [(g, n) for g in range(3) for n in range(4) if clen[g, n] > 0]
    width = prompts.shape[1] + comps.shape[2]
    tokens = np.zeros((len(seqs), width), np.int64)
    for i, (g, n) in enumerate(seqs):
        row = np.concatenate([prompts[g, :plen[g]], comps[g, n, :clen[g, n]]])
        tokens[i, :len(row)] = row
    lps = np.asarray(jax.jit(lambda p, t: jax.nn.log_softmax(model.forward(p, t), axis=-1))(params, tokens))
    for g in range(3):
        for n in range(4):
            assert (shared[g, n, clen[g, n]:] == 0).all()
    for i, (g, n) in enumerate(seqs):
        c = clen[g, n]
        want = [float(lps[i, plen[g] - 1 + t, comps[g, n, t]]) for t in range(c)]
        np.testing.assert_allclose(shared[g, n, :c], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_of_shared_equal_flat(model_params, remat):
    model, params = model_params
    prompts, plen, comps, clen = _batch(1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(comps.shape), jnp.float32)

    def loss(impl):
        return jax.jit(jax.value_and_grad(lambda p: jnp.sum(w * completion_logprobs(
            model, p, prompts, plen, comps, clen, impl=impl, remat=remat))))
    (v_s, g_s), (v_f, g_f) = loss("shared")(params), loss("flat")(params)
    np.testing.assert_allclose(v_s, v_f, rtol=1e-5)
    leaves_s, leaves_f = jax.tree_util.tree_leaves(g_s), jax.tree_util.tree_leaves(g_f)
    assert len(leaves_s) == len(leaves_f)
    for a, b in zip(leaves_s, leaves_f):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    assert float(jnp.abs(g_s["layers"][1]["router"]).max()) > 0
    assert float(jnp.abs(g_s["layers"][0]["wkv_b"]).max()) > 0


def test_entropy_and_validation(model_params):
    model, params = model_params
    prompts, plen, comps, clen = _batch(4)
    lp, ent = completion_logprobs(model, params, prompts, plen, comps, clen, return_entropy=True)
    assert lp.shape == ent.shape == comps.shape
    assert (np.asarray(ent)[clen[..., None] > np.arange(5)] > 0).all()
    with pytest.raises(ValueError, match=r"completion_tokens: token ids within the lengths must be in "
                                         r"\[0, 53\)"):
        completion_logprobs(model, params, prompts, plen, comps + 100, clen)
    with pytest.raises(TypeError, match="model must be a models.Llama or a family with completion_hidden"):
        completion_logprobs(object(), params, prompts, plen, comps, clen)


def test_grpo_step_trains_a_deepseek_model(model_params):
    """One GRPO optimizer step (``models.training.rl.make_train_step``) on the DeepSeek family: the loss
    is finite and the step moves the parameters that the completions' log-probabilities use."""
    optax = pytest.importorskip("optax")
    from models.training.rl import GRPOBatch, group_advantages, make_train_step  # noqa: PLC0415
    model, params = model_params
    prompts, plen, comps, clen = _batch(5)
    rewards = jnp.asarray(np.random.default_rng(6).standard_normal(clen.shape), jnp.float32)
    batch = GRPOBatch(jnp.asarray(prompts), jnp.asarray(plen), jnp.asarray(comps), jnp.asarray(clen),
                      group_advantages(rewards))
    optimizer = optax.sgd(1e-2)
    step = make_train_step(model, optimizer, donate=False)
    new, _, metrics = step(params, optimizer.init(params), batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    moved = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), new, params)
    assert moved["layers"][0]["wkv_b"] > 0 and moved["embed"] > 0
