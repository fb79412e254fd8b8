"""models.deepseek against transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: tiny
random checkpoints saved with save_pretrained (safetensors) and read back with our loader;
prefill logits, greedy continuations through the absorbed latent-cache decode with a shared
prompt, routing ties, the config reader and the loader's errors."""
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.deepseek import (Deepseek, DeepseekConfig, greedy_generate, init_latent_cache,  # noqa: E402
                             init_params, load_hf_checkpoint, params_from_hf_state_dict)
from models.deepseek.moe import route  # noqa: E402
from models.deepseek.rope import rope_inv_freq  # noqa: E402

V = 97
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.9,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
              max_position_embeddings=256, initializer_range=0.2, eos_token_id=None)
CASES = {
    # DeepSeek-V2: direct q projection, softmax scores, greedy top-2 of 4, YaRN
    "v2_direct_q": ("DeepseekV2", dict(COMMON, q_lora_rank=None, n_routed_experts=4, n_shared_experts=1,
                                       num_experts_per_tok=2, topk_method="greedy", rope_parameters=YARN)),
    # DeepSeek-V2: low-rank q, group-limited greedy, two shared experts, routed scaling
    "v2_groups": ("DeepseekV2", dict(COMMON, q_lora_rank=12, n_routed_experts=6, n_shared_experts=2,
                                     num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=3,
                                     topk_group=2, routed_scaling_factor=1.5, rope_parameters=YARN)),
    # DeepSeek-V3: low-rank q, sigmoid + noaux_tc with a correction bias, normalised top-k, YaRN
    "v3": ("DeepseekV3", dict(COMMON, q_lora_rank=12, n_routed_experts=8, n_shared_experts=1,
                              num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              rope_parameters=YARN)),
    # DeepSeek-V3 without YaRN, rotate-half RoPE, direct q projection
    "v3_plain": ("DeepseekV3", dict(COMMON, q_lora_rank=None, n_routed_experts=4, n_shared_experts=1,
                                    num_experts_per_tok=2, n_group=2, topk_group=1, rope_interleave=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
}


def _hf_model(family: str, kw: dict, seed: int):
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{family}Config")(**kw)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms and correction biases away from their initial constants
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.2 * torch.randn_like(mod.e_score_correction_bias))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (HF model, checkpoint dir)."""
    out = {}
    for i, (name, (family, kw)) in enumerate(CASES.items()):
        model = _hf_model(family, kw, seed=i)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, str(path))
    return out


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _forward(model, params, tokens):
    """``model.forward`` as one jitted program (op by op it dispatches hundreds of small ops)."""
    return jax.jit(model.forward)(params, tokens)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(checkpoints, case):
    hf, path = checkpoints[case]
    config, params = load_hf_checkpoint(path)
    family = CASES[case][0]
    assert config.architecture == f"{family}ForCausalLM"
    assert config.q_lora_rank == CASES[case][1]["q_lora_rank"]
    tokens = np.random.default_rng(1).integers(0, V, (2, 19))   # past YaRN's original 8 positions
    got = _forward(Deepseek(config), params, tokens)
    assert got.shape == (2, 19, V) and got.dtype == jnp.float32
    assert _rel(got, _hf_logits(hf, tokens)) < 1e-4


@pytest.mark.parametrize("case", ["v2_direct_q", "v3"])
def test_greedy_shared_prompt_decode_matches_transformers_generate(checkpoints, case):
    hf, path = checkpoints[case]
    config, params = load_hf_checkpoint(path)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, V, 9).tolist()
    continuations = [rng.integers(0, V, 3).tolist(), [], rng.integers(0, V, 1).tolist()]
    ours = greedy_generate(Deepseek(config), params, prompt, continuations, 5)
    for cont, got in zip(continuations, ours):
        ids = torch.tensor([prompt + cont])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:].tolist()
        assert got == want


def test_absorbed_decode_logits_match_forward_with_grouped_prompts(checkpoints):
    """Two prompts of different lengths stored once each (``seq_to_prefix``), ragged suffixes
    appended in one call and one decode step: every logit row equals the non-absorbed forward
    over the sequence's whole token list."""
    _, path = checkpoints["v3"]
    config, params = load_hf_checkpoint(path)
    model = Deepseek(config)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, 10).tolist(), rng.integers(0, V, 6).tolist()]
    padded = np.zeros((2, 10), np.int32)
    padded[0], padded[1, :6] = prompts[0], prompts[1]
    prefix = model.prefill_prefix_jit(params, padded, np.array([10, 6], np.int32))
    s2p = [1, 0, 1]
    conts = [rng.integers(0, V, 4).tolist(), rng.integers(0, V, 2).tolist(), rng.integers(0, V, 1).tolist()]
    tokens = np.zeros((3, 4), np.int32)
    for i, c in enumerate(conts):
        tokens[i, 4 - len(c):] = c
    cache = init_latent_cache(config, prefix, np.array(s2p, np.int32), capacity=8)
    logits, cache = model.extend_jit(params, cache, tokens, np.array([len(c) for c in conts], np.int32))
    nxt = np.array([5, 6, 7], np.int32)
    logits2, cache = model.decode_step_jit(params, cache, nxt)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 3, 2])
    seqs = [prompts[s2p[i]] + conts[i] + [int(nxt[i])] for i in range(3)]
    padded = np.zeros((3, max(map(len, seqs))), np.int32)   # right padding: causal, rows unaffected
    for i, seq in enumerate(seqs):
        padded[i, :len(seq)] = seq
    full = np.asarray(_forward(model, params, padded))
    for i in range(3):
        n = len(seqs[i])
        assert _rel(logits[i], full[i, n - 2]) < 1e-4
        assert _rel(logits2[i], full[i, n - 1]) < 1e-4
    # sequence 0 hangs from prompt 1: the prompt's last logits are its row at position 5
    np.testing.assert_allclose(prefix.last_logits[1], full[0, 5], rtol=1e-5, atol=1e-5)


def test_moe_routing_ties_match_transformers(tmp_path):
    """Experts whose router rows are equal score exactly the same for every token; the rows come
    in tied pairs and each pair (a V3 group too) is selected whole with top-2, so both
    implementations must pick the same experts and weights (softmax and sigmoid routers)."""
    for family, kw in (CASES["v2_direct_q"], CASES["v3"]):
        hf = _hf_model(family, dict(kw, num_experts_per_tok=2), seed=5)
        with torch.no_grad():
            for mod in hf.modules():
                if type(mod).__name__.endswith("TopkRouter"):
                    base = torch.randn(mod.weight.shape[0] // 4, mod.weight.shape[1])
                    mod.weight.copy_(torch.cat([torch.stack([b, b, -b, -b]) for b in base]))
                    if hasattr(mod, "e_score_correction_bias"):
                        mod.e_score_correction_bias.zero_()
        hf.save_pretrained(tmp_path / family)
        config, params = load_hf_checkpoint(tmp_path / family)
        x = np.random.default_rng(7).standard_normal((11, 32)).astype(np.float32)
        lp = params["layers"][1]
        experts, weights = route(config, lp["router"], lp.get("e_score_correction_bias"), jnp.asarray(x))
        experts = np.sort(np.asarray(experts), axis=1)
        assert np.all(experts[:, 0] // 2 == experts[:, 1] // 2) and np.all(experts[:, 0] != experts[:, 1])
        np.testing.assert_array_equal(weights[:, 0], weights[:, 1])
        tokens = np.random.default_rng(6).integers(0, V, (2, 7))
        assert _rel(_forward(Deepseek(config), params, tokens), _hf_logits(hf, tokens)) < 1e-4


def test_route_breaks_ties_toward_lower_expert():
    config = DeepseekConfig(architecture="DeepseekV2ForCausalLM", vocab_size=8, hidden_size=2,
                            intermediate_size=4, num_hidden_layers=1, num_attention_heads=1,
                            kv_lora_rank=2, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2,
                            moe_intermediate_size=2, n_routed_experts=4, num_experts_per_tok=1)
    router = jnp.array([[0.0, 1.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    experts, weights = route(config, router, None, jnp.array([[1.0, 0.0]]))
    assert experts.tolist() == [[1]]
    np.testing.assert_allclose(weights, [[math.e / (2 * math.e + 1 + math.e ** 0.5)]], rtol=1e-6)


@pytest.mark.parametrize("rope", [YARN, dict(YARN, truncate=False, mscale=None, mscale_all_dim=None),
                                  dict(YARN, beta_fast=4, beta_slow=2, factor=2.0)])
def test_yarn_frequencies_and_scales_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    kw = dict(COMMON, q_lora_rank=None, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
              rope_parameters={k: v for k, v in rope.items() if v is not None}, qk_rope_head_dim=16)
    hf_cfg = transformers.DeepseekV3Config(**kw, n_group=1, topk_group=1)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours = DeepseekConfig.from_hf_config(hf_cfg.to_dict())
    np.testing.assert_allclose(rope_inv_freq(ours), inv.numpy(), rtol=1e-6)
    assert math.isclose(ours.rope_scaling.cos_sin_factor, factor, rel_tol=1e-12)
    attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, 0)
    assert math.isclose(ours.softmax_scale, attn.scaling, rel_tol=1e-12)


# --------------------------------------------------------------------------- config reader

V2_LITE = {  # DeepSeek-V2-Lite's config.json (original layout: rope_theta + rope_scaling "type")
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}


def test_config_reads_original_deepseek_layout():
    c = DeepseekConfig.from_hf_config(V2_LITE)
    assert (c.architecture, c.q_lora_rank, c.kv_lora_rank, c.n_routed_experts) == \
        ("DeepseekV2ForCausalLM", None, 512, 64)
    assert (c.scoring_func, c.topk_method, c.eos_token_ids) == ("softmax", "greedy", (100001,))
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert math.isclose(c.softmax_scale, 192 ** -0.5 * mscale ** 2, rel_tol=1e-12)
    assert c.rope_scaling.cos_sin_factor == 1.0
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    v3 = dict(V2_LITE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
              scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
              num_nextn_predict_layers=1, ep_size=1, norm_topk_prob=True, moe_layer_freq=2)
    c3 = DeepseekConfig.from_hf_config(v3)
    assert (c3.scoring_func, c3.topk_method, c3.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert [c3.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


@pytest.mark.parametrize("change,words", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, ("unsupported architecture", "LlamaForCausalLM")),
    ({"architectures": None, "model_type": "mixtral"}, ("unsupported model_type", "mixtral")),
    ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config",)),
    ({"hidden_act": "gelu"}, ("hidden_act",)),
    ({"norm_topk_prob": True}, ("norm_topk_prob", "DeepseekV2ForCausalLM")),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ("rope_type", "linear")),
    ({"some_new_field": 1}, ("unknown", "some_new_field")),
    ({"topk_method": "group_limited_greedy", "n_group": 5}, ("n_group", "64")),
    ({"num_experts_per_tok": 65}, ("num_experts_per_tok",)),
    ({"kv_lora_rank": None}, ("missing", "kv_lora_rank")),
    ({"scoring_func": "relu"}, ("scoring_func", "relu")),
])
def test_config_errors(change, words):
    raw = dict(V2_LITE, **change)
    with pytest.raises(ValueError) as e:
        DeepseekConfig.from_hf_config({k: v for k, v in raw.items() if v is not None or k != "architectures"})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# --------------------------------------------------------------------------- loader errors

def test_loader_reports_config_tensor_mismatch(checkpoints, tmp_path):
    _, path = checkpoints["v2_direct_q"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["kv_lora_rank"] = 20
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(bad)
    msg = str(e.value)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight: checkpoint has (20, 32), config expects (24, 32)" in msg
    assert "DeepseekV2ForCausalLM" in msg
    cfg["kv_lora_rank"] = 16
    cfg["architectures"] = ["Qwen2MoeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture .*Qwen2MoeForCausalLM"):
        load_hf_checkpoint(bad)
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_checkpoint(os.path.join(path, "config.json"))


def test_state_dict_missing_and_unexpected_tensors(checkpoints):
    hf, path = checkpoints["v3"]
    config, params = load_hf_checkpoint(path)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}   # experts fused, as in memory
    from_memory = params_from_hf_state_dict(config, sd)
    np.testing.assert_array_equal(from_memory["layers"][2]["experts_up"], params["layers"][2]["experts_up"])
    np.testing.assert_array_equal(from_memory["layers"][1]["experts_down"], params["layers"][1]["experts_down"])
    del sd["model.layers.2.mlp.gate.e_score_correction_bias"]
    sd["model.layers.3.mlp.gate.weight"] = np.zeros((8, 32), np.float32)
    with pytest.raises(ValueError) as e:
        params_from_hf_state_dict(config, sd)
    msg = str(e.value)
    assert "missing tensors (1): ['model.layers.2.mlp.gate.e_score_correction_bias']" in msg
    assert "unexpected tensors (1): ['model.layers.3.mlp.gate.weight']" in msg


def test_latent_cache_of_wrong_rank_is_reported(checkpoints):
    _, path = checkpoints["v2_direct_q"]
    config, params = load_hf_checkpoint(path)
    model = Deepseek(config)
    prefix = model.prefill_prefix_jit(params, np.array([[1, 2, 3]]))
    cache = init_latent_cache(config.replace(kv_lora_rank=8), prefix, np.zeros(2, np.int32), 4)
    with pytest.raises(ValueError, match=r"cache.latent\[0\] must have shape \[batch=2, S_max, kv_lora_rank=16\], "
                       r"got \(2, 4, 8\)"):
        model.decode_step(params, cache, np.array([1, 2]))


def test_init_params_decode_and_gradients():
    """Random weights of a V2-Lite-shaped toy: greedy decoding runs, and the gradient of the
    forward (MLA, ragged_dot experts, routing) matches a central finite difference."""
    config = DeepseekConfig.from_hf_config(dict(V2_LITE, hidden_size=32, intermediate_size=24,
                                                kv_lora_rank=8, moe_intermediate_size=8, n_routed_experts=4,
                                                num_experts_per_tok=2, num_hidden_layers=2,
                                                num_attention_heads=2, qk_nope_head_dim=4,
                                                qk_rope_head_dim=4, v_head_dim=4, vocab_size=50,
                                                eos_token_id=1, bos_token_id=0))
    params = init_params(config, seed=0, dtype=jnp.float32, std=0.2)
    model = Deepseek(config)
    out = greedy_generate(model, params, [3, 4, 5], [[6], [7, 8]], 2)
    assert len(out) == 2 and all(len(o) == 2 and all(0 <= t < 50 for t in o) for o in out)
    tokens = np.array([[3, 9, 4, 1, 7]])
    w = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 50)), jnp.float32)
    loss = jax.jit(lambda p: jnp.sum(model.forward(p, tokens) * w))
    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["layers"][1]["experts_gate"]).max()) > 0
    assert float(jnp.abs(grads["layers"][1]["router"]).max()) > 0
    rng = np.random.default_rng(1)
    d = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    eps = 1e-3
    shifted = lambda sgn: jax.tree_util.tree_map(lambda x, v: x + sgn * eps * v, params, d)  # noqa: E731
    fd = (loss(shifted(1)) - loss(shifted(-1))) / (2 * eps)
    lin = sum(jnp.sum(g * v) for g, v in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(d)))
    np.testing.assert_allclose(fd, lin, rtol=2e-2)


def test_bfloat16_weights_prefill_and_decode(tmp_path):
    """bfloat16 weights and latent caches.  Every expert is routed (K = E), so that bfloat16
    rounding cannot flip a routing decision (a flip moves logits far more than rounding does)."""
    hf = _hf_model("DeepseekV3", dict(CASES["v3"][1], n_routed_experts=4, num_experts_per_tok=4,
                                      n_group=2, topk_group=2), seed=9)
    hf.save_pretrained(tmp_path)
    config, params = load_hf_checkpoint(tmp_path, jnp.bfloat16)
    assert params["layers"][1]["experts_gate"].dtype == jnp.bfloat16
    model = Deepseek(config)
    tokens = np.random.default_rng(8).integers(0, V, (1, 9))
    got = _forward(model, params, tokens)
    with torch.no_grad():
        want = hf.to(torch.bfloat16)(torch.tensor(tokens)).logits.float().numpy()
    assert got.dtype == jnp.float32 and _rel(got, want) < 5e-2
    prefix = model.prefill_prefix_jit(params, tokens[:, :8])
    assert prefix.latent[0].dtype == jnp.bfloat16
    cache = init_latent_cache(config, prefix, np.zeros(2, np.int32), capacity=2)
    logits, cache = model.decode_step_jit(params, cache, np.array([tokens[0, 8]] * 2, np.int32))
    assert cache.latent[2].dtype == jnp.bfloat16
    assert _rel(logits[0], got[0, 8]) < 5e-2 and _rel(logits[1], got[0, 8]) < 5e-2
