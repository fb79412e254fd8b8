"""Llama parameters: Hugging Face checkpoints, HF-named state dicts, random initialisation.

Parameter pytree (a plain dict; matrices ``[in, out]``, i.e. torch ``Linear.weight`` transposed)::

    {"embed": [V, H],
     "layers": {"attn_norm": [L, H], "wq": [L, H, Hq*D], "wk": [L, H, Hkv*D], "wv": [L, H, Hkv*D],
                "wo": [L, Hq*D, H], "mlp_norm": [L, H], "w_gate": [L, H, F], "w_up": [L, H, F],
                "w_down": [L, F, H]},
     "final_norm": [H],
     "lm_head": [H, V]}          # absent when config.tie_word_embeddings (the embedding is used)

``"layers"`` is *stacked* (leading ``L`` axis, layer loop = ``lax.scan``) as built here;
:func:`unstack_layers` turns it into a list of ``L`` per-layer dicts (unrolled layer loop, each
layer's KV buffer its own array: the layout for GPU decoding benchmarks), :func:`stack_layers`
back.

Entry points:

* :func:`params_from_hf_state_dict(config, state_dict, dtype)` -- from a mapping of Hugging
  Face names (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
  ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm.weight``,
  ``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``)
  to numpy arrays (any float dtype, incl. ``ml_dtypes.bfloat16``).  Strict: missing names,
  unexpected names and wrongly-shaped tensors raise ``ValueError`` listing them.  Tolerated:
  ``lm_head.weight`` when the embeddings are tied (checked for shape, then ignored: the tied
  embedding is used) and the ``rotary_emb.inv_freq`` buffers of old checkpoints (recomputed from
  the config).  This is also the entry point for other formats (e.g. GGUF readers that produce an
  HF-named state dict plus :meth:`~models.config.LlamaConfig.from_hf_config`).
* :func:`load_hf_checkpoint(path, dtype)` -> ``(config, params)`` -- a Hugging Face Llama
  checkpoint directory: ``config.json`` plus ``model.safetensors`` or sharded
  ``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json``.
* :func:`init_params(config, key, dtype)` -- random weights (benchmarks, tests).
"""
from __future__ import annotations

import json
import os
import types
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.sharding import place_params

__all__ = ["hf_param_shapes", "init_params", "load_hf_checkpoint", "params_from_hf_state_dict",
           "read_safetensors", "safetensors_files", "stack_layers", "unstack_layers"]

_LAYER_MAP = types.MappingProxyType({  # ours -> (HF suffix under model.layers.{i}., transpose)
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
})


def hf_param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected Hugging Face tensor names and (torch) shapes for ``config``."""
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (hq, h),
        "self_attn.k_proj.weight": (hkv, h), "self_attn.v_proj.weight": (hkv, h),
        "self_attn.o_proj.weight": (h, hq), "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _check_names(config: LlamaConfig, names, shape_of) -> None:
    expected = hf_param_shapes(config)
    tolerated = set()
    if config.tie_word_embeddings:
        tolerated.add("lm_head.weight")
    names = set(names)
    unexpected = sorted(n for n in names - set(expected) - tolerated if not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(expected) - names)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    wrong = []
    for n in sorted(names & (set(expected) | tolerated)):
        want = expected.get(n, (config.vocab_size, config.hidden_size))
        got = tuple(shape_of(n))
        if got != want:
            wrong.append(f"{n}: got {got}, expected {want}")
    if wrong:
        problems.append(f"wrongly shaped tensors ({len(wrong)}): {wrong[:8]}{' ...' if len(wrong) > 8 else ''}")
    if problems:
        raise ValueError("state dict does not match the Llama config: " + "; ".join(problems))


def params_from_hf_state_dict(config: LlamaConfig, state_dict: Mapping[str, np.ndarray], dtype=jnp.float32, *,
                              mesh=None) -> dict:
    """Parameters (stacked layout) from a Hugging Face-named state dict of numpy arrays.

    ``mesh`` (a ``("data", "model")`` mesh of :func:`models.sharding.make_mesh`): each device
    receives only its block of each tensor, cut, padded and cast on the host
    (:func:`models.sharding.place_params`); the model is never whole on one device."""
    _check_names(config, state_dict.keys(), lambda n: np.shape(state_dict[n]))
    if mesh is not None:
        return place_params(config, lambda name, layer: _hf_tensor(state_dict, name, layer), mesh, dtype)

    def get(name, transpose):
        x = np.asarray(state_dict[name])
        x = x.astype(np.float32) if x.dtype != np.float32 else x
        return x.T if transpose else x

    def to_dev(x):
        return jnp.asarray(x, dtype=dtype)

    layers = {}
    for ours, (hf, tr) in _LAYER_MAP.items():
        layers[ours] = to_dev(np.stack([get(f"model.layers.{i}.{hf}", tr)
                                        for i in range(config.num_hidden_layers)]))
    params = {"embed": to_dev(get("model.embed_tokens.weight", False)), "layers": layers,
              "final_norm": to_dev(get("model.norm.weight", False))}
    if not config.tie_word_embeddings:
        params["lm_head"] = to_dev(get("lm_head.weight", True))
    return params


_TOP_MAP = types.MappingProxyType({  # ours -> (HF name, transpose)
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
})


def _hf_tensor(state_dict: Mapping[str, np.ndarray], name: str, layer: int | None) -> np.ndarray:
    """Host array of our parameter ``name`` (of ``layer``) in ``[in, out]`` orientation (a view)."""
    if layer is None:
        hf, transpose = _TOP_MAP[name]
    else:
        suffix, transpose = _LAYER_MAP[name]
        hf = f"model.layers.{layer}.{suffix}"
    x = np.asarray(state_dict[hf])
    return x.T if transpose else x


def safetensors_files(path: str) -> list[str]:
    """The weight files of a Hugging Face checkpoint directory (its index's shards, else
    ``model.safetensors``, else every ``*.safetensors``); ``ValueError`` when there is none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, fn) for fn in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not found:
        raise ValueError(f"no safetensors weights in {path!r} (expected model.safetensors or "
                         f"model.safetensors.index.json)")
    return [os.path.join(path, fn) for fn in found]


def read_safetensors(files: list[str]) -> dict[str, np.ndarray]:
    """Every tensor of ``files`` as host numpy arrays; a name in two shards is a ``ValueError``."""
    from safetensors import safe_open  # noqa: PLC0415

    out: dict[str, np.ndarray] = {}
    for fn in files:
        # framework="flax" reads bfloat16 too (numpy has no native bf16); arrays come back as jax
        # arrays on the default device and are turned into host numpy here.
        with safe_open(fn, framework="flax") as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"tensor {name!r} appears in more than one shard ({fn})")
                out[name] = np.asarray(jax.device_get(f.get_tensor(name)))
    return out


def load_hf_checkpoint(path: str | os.PathLike, dtype=jnp.float32, *, mesh=None) -> tuple[LlamaConfig, dict]:
    """``(config, params)`` from a Hugging Face Llama checkpoint directory (``mesh``: placed in
    their shards, as :func:`params_from_hf_state_dict`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    config = LlamaConfig.from_hf_config(path)
    state = read_safetensors(safetensors_files(path))
    return config, params_from_hf_state_dict(config, state, dtype, mesh=mesh)


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.bfloat16, *, std: float = 0.02) -> dict:
    """Random parameters (stacked layout): normal(std) matrices, norms ``1 + normal(0.1)``."""
    h, f, d, L = config.hidden_size, config.intermediate_size, config.head_dim, config.num_hidden_layers
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"wq": (L, h, hq), "wk": (L, h, hkv), "wv": (L, h, hkv), "wo": (L, hq, h),
              "w_gate": (L, h, f), "w_up": (L, h, f), "w_down": (L, f, h)}
    keys = jax.random.split(key, len(shapes) + 5)
    layers = {name: (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
              if np.prod(shape) < (1 << 26) else
              jax.random.normal(k, shape, dtype) * jnp.asarray(std, dtype)
              for k, (name, shape) in zip(keys, shapes.items())}
    layers["attn_norm"] = (1 + 0.1 * jax.random.normal(keys[-5], (L, h), jnp.float32)).astype(dtype)
    layers["mlp_norm"] = (1 + 0.1 * jax.random.normal(keys[-4], (L, h), jnp.float32)).astype(dtype)
    params = {"embed": jax.random.normal(keys[-3], (config.vocab_size, h), dtype),
              "layers": layers,
              "final_norm": (1 + 0.1 * jax.random.normal(keys[-2], (h,), jnp.float32)).astype(dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = (std * jax.random.normal(keys[-1], (h, config.vocab_size), jnp.float32)).astype(dtype)
    return params


def unstack_layers(params: dict) -> dict:
    """Stacked ``"layers"`` -> list of ``L`` per-layer dicts (unrolled layer loop)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = dict(params)
    out["layers"] = [jax.tree_util.tree_map(lambda x, i=i: x[i], layers) for i in range(n)]
    return out


def stack_layers(params: dict) -> dict:
    """List of per-layer dicts -> stacked ``"layers"`` (``lax.scan`` layer loop)."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    return out
