"""DeepSeek-V2/V3 parameters: Hugging Face checkpoints, HF-named state dicts, random weights.

Parameter pytree (a plain dict; matrices ``[in, out]``, i.e. torch ``Linear.weight``
transposed; ``layers`` is a list, one dict per layer, since dense and MoE layers differ)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": [{"attn_norm": [H], "mlp_norm": [H],
                 "wq": [H, Hn*(Dn+Dr)]                       (q_lora_rank None), or
                 "wq_a": [H, Rq], "q_a_norm": [Rq], "wq_b": [Rq, Hn*(Dn+Dr)],
                 "wkv_a": [H, R+Dr], "kv_a_norm": [R], "wkv_b": [R, Hn*(Dn+Dv)], "wo": [Hn*Dv, H],
                 dense layer: "w_gate", "w_up": [H, F], "w_down": [F, H];
                 MoE layer:   "router": [H, E], "e_score_correction_bias": [E] (noaux_tc),
                              "experts_gate", "experts_up": [E, H, I], "experts_down": [E, I, H],
                              "shared_gate", "shared_up": [H, n_shared*I], "shared_down": [n_shared*I, H]
                }, ...]}

Entry points:

* :func:`hf_param_shapes(config)` -- the Hugging Face tensor names and (torch) shapes.
* :func:`params_from_hf_state_dict(config, state_dict, dtype)` -- strict: missing, unexpected
  and wrongly shaped tensors raise one ``ValueError`` naming them (a wrongly shaped tensor with
  the checkpoint's and the config's shapes); ``rotary_emb.inv_freq`` buffers are ignored.  The
  experts are read per expert (``mlp.experts.{j}.{gate,up,down}_proj.weight``, the checkpoint
  layout) or fused as transformers >= 5 holds them in memory
  (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``).
* :func:`load_hf_checkpoint(path, dtype)` -> ``(config, params)`` -- ``config.json`` plus
  ``model.safetensors`` or sharded safetensors with ``model.safetensors.index.json``.
* :func:`init_params(config, seed, dtype)` -- random weights (benchmarks, tests).
"""
from __future__ import annotations

import os
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from models.deepseek.config import DeepseekConfig
from models.weights import read_safetensors, safetensors_files

__all__ = ["hf_param_shapes", "init_params", "load_hf_checkpoint", "params_from_hf_state_dict"]


def _layer_shapes(config: DeepseekConfig, i: int) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """ours -> (HF suffix under ``model.layers.{i}.``, torch shape, transpose) for layer ``i``."""
    c = config
    h, hn, r, dr = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    out = {"attn_norm": ("input_layernorm.weight", (h,), False),
           "mlp_norm": ("post_attention_layernorm.weight", (h,), False),
           "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", (r + dr, h), True),
           "kv_a_norm": ("self_attn.kv_a_layernorm.weight", (r,), False),
           "wkv_b": ("self_attn.kv_b_proj.weight", (hn * (c.qk_nope_head_dim + c.v_head_dim), r), True),
           "wo": ("self_attn.o_proj.weight", (h, hn * c.v_head_dim), True)}
    q_out = hn * c.qk_head_dim
    if c.q_lora_rank is None:
        out["wq"] = ("self_attn.q_proj.weight", (q_out, h), True)
    else:
        out["wq_a"] = ("self_attn.q_a_proj.weight", (c.q_lora_rank, h), True)
        out["q_a_norm"] = ("self_attn.q_a_layernorm.weight", (c.q_lora_rank,), False)
        out["wq_b"] = ("self_attn.q_b_proj.weight", (q_out, c.q_lora_rank), True)
    if not c.is_moe_layer(i):
        f = c.intermediate_size
        out.update(w_gate=("mlp.gate_proj.weight", (f, h), True), w_up=("mlp.up_proj.weight", (f, h), True),
                   w_down=("mlp.down_proj.weight", (h, f), True))
        return out
    e, f = c.n_routed_experts, c.moe_intermediate_size
    out["router"] = ("mlp.gate.weight", (e, h), True)
    if c.topk_method == "noaux_tc":
        out["e_score_correction_bias"] = ("mlp.gate.e_score_correction_bias", (e,), False)
    for j in range(e):
        out[f"experts_gate.{j}"] = (f"mlp.experts.{j}.gate_proj.weight", (f, h), True)
        out[f"experts_up.{j}"] = (f"mlp.experts.{j}.up_proj.weight", (f, h), True)
        out[f"experts_down.{j}"] = (f"mlp.experts.{j}.down_proj.weight", (h, f), True)
    if c.n_shared_experts:
        fs = f * c.n_shared_experts
        out.update(shared_gate=("mlp.shared_experts.gate_proj.weight", (fs, h), True),
                   shared_up=("mlp.shared_experts.up_proj.weight", (fs, h), True),
                   shared_down=("mlp.shared_experts.down_proj.weight", (h, fs), True))
    return out


def hf_param_shapes(config: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Expected Hugging Face tensor names and (torch) shapes for ``config``."""
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
              "model.norm.weight": (config.hidden_size,)}
    for i in range(config.num_hidden_layers):
        for hf, shape, _ in _layer_shapes(config, i).values():
            shapes[f"model.layers.{i}.{hf}"] = shape
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def _check_names(config: DeepseekConfig, names, shape_of) -> None:
    expected = hf_param_shapes(config)
    names = set(names)
    tolerated = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in names - set(expected) - tolerated if not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(expected) - names)
    wrong = []
    for n in sorted(names & (set(expected) | tolerated)):
        want = expected.get(n, (config.vocab_size, config.hidden_size))
        got = tuple(shape_of(n))
        if got != want:
            wrong.append(f"{n}: checkpoint has {got}, config expects {want}")
    problems = []
    for what, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                        ("wrongly shaped tensors", wrong)):
        if items:
            problems.append(f"{what} ({len(items)}): {items[:8]}{' ...' if len(items) > 8 else ''}")
    if problems:
        raise ValueError(f"state dict does not match the {config.architecture} config: " + "; ".join(problems))


def _split_fused_experts(state_dict: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """``state_dict`` with transformers' fused expert tensors split into per-expert ones."""
    fused = [n for n in state_dict if n.endswith("mlp.experts.gate_up_proj")]
    if not fused:
        return state_dict
    out = dict(state_dict)
    for name in fused:
        stem = name[:-len("gate_up_proj")]
        gate_up = np.asarray(out.pop(name))
        down = out.pop(stem + "down_proj", None)
        if down is None:
            raise ValueError(f"state dict has {name} but no {stem}down_proj")
        down = np.asarray(down)
        if gate_up.ndim != 3 or gate_up.shape[1] % 2 or down.ndim != 3 or down.shape[0] != gate_up.shape[0]:
            raise ValueError(f"fused experts {name} {gate_up.shape} and {stem}down_proj {down.shape} are not "
                             f"[E, 2I, H] and [E, H, I]")
        half = gate_up.shape[1] // 2
        for j in range(gate_up.shape[0]):
            out[f"{stem}{j}.gate_proj.weight"] = gate_up[j, :half]
            out[f"{stem}{j}.up_proj.weight"] = gate_up[j, half:]
            out[f"{stem}{j}.down_proj.weight"] = down[j]
    return out


def params_from_hf_state_dict(config: DeepseekConfig, state_dict: Mapping[str, np.ndarray],
                              dtype=jnp.float32) -> dict:
    """Parameters (layout in the module docstring) from a Hugging Face-named state dict."""
    state_dict = _split_fused_experts(state_dict)
    _check_names(config, state_dict.keys(), lambda n: np.shape(state_dict[n]))

    def get(name, transpose):
        x = np.asarray(state_dict[name]).astype(np.float32)
        return x.T if transpose else x

    layers = []
    for i in range(config.num_hidden_layers):
        lp, experts = {}, {"experts_gate": [], "experts_up": [], "experts_down": []}
        for ours, (hf, _, tr) in _layer_shapes(config, i).items():
            x = get(f"model.layers.{i}.{hf}", tr)
            if ours.startswith("experts_"):
                experts[ours.partition(".")[0]].append(x)
            else:
                lp[ours] = jnp.asarray(x, dtype)
        if config.is_moe_layer(i):
            lp.update({k: jnp.asarray(np.stack(v), dtype) for k, v in experts.items()})
            if "e_score_correction_bias" in lp:  # routing runs in float32
                lp["e_score_correction_bias"] = lp["e_score_correction_bias"].astype(jnp.float32)
        layers.append(lp)
    params = {"embed": jnp.asarray(get("model.embed_tokens.weight", False), dtype), "layers": layers,
              "final_norm": jnp.asarray(get("model.norm.weight", False), dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(get("lm_head.weight", True), dtype)
    return params


def load_hf_checkpoint(path: str | os.PathLike, dtype=jnp.float32) -> tuple[DeepseekConfig, dict]:
    """``(config, params)`` from a Hugging Face DeepSeek-V2/V3 checkpoint directory; the config
    is read (and an unknown architecture reported) before any weight."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    config = DeepseekConfig.from_hf_config(path)
    state = read_safetensors(safetensors_files(path))
    return config, params_from_hf_state_dict(config, state, dtype)


def init_params(config: DeepseekConfig, seed: int = 0, dtype=jnp.bfloat16, *, std: float = 0.02) -> dict:
    """Random parameters (NumPy generator of ``seed``): normal(std) matrices, norms
    ``1 + normal(0.1)``, zero correction bias."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in hf_param_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.1 * rng.standard_normal(shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            state[name] = np.zeros(shape, np.float32)
        else:
            state[name] = std * rng.standard_normal(shape, np.float32)
    return params_from_hf_state_dict(config, state, dtype)
