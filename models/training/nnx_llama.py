"""The Llama as a Flax NNX module: ``nnx.Param`` leaves over the functional decoder.

:class:`NNXLlama` holds the same parameters as the plain tree of :mod:`models.weights`, each
array wrapped in an ``nnx.Param``, under the same names::

    model.embed, model.final_norm, model.lm_head (None when tied)
    model.layers.<name>          stacked layers: a LayerParams whose Params are [L, ...]
    model.layers[i].<name>       list layout: an nnx.List of per-layer LayerParams

Its computations are the functional decoder's (:class:`~models.llama.Llama`, ``model.llama``)
applied to :meth:`NNXLlama.to_params`, so the functional forward, prefill, decode and
:func:`models.generate` keep working on the plain tree and both forms give identical numbers.

Conversions (no copies: the same arrays are shared):

* plain tree -> module: ``NNXLlama(config, params)``, or the loaders
  :meth:`NNXLlama.from_hf_checkpoint`, :meth:`NNXLlama.from_gguf`, :meth:`NNXLlama.init`;
* module -> plain tree: ``model.to_params()``;
* ``nnx.split(model, nnx.Param)`` -> ``(graphdef, state)``; :func:`params_from_state(state)` is
  the plain tree of a state, ``nnx.merge(graphdef, state)`` the module again;
  ``model.load_params(params)`` writes a plain tree into the module's Params.

Training: ``nnx.Optimizer(model, optax.adamw(...), wrt=nnx.Param)`` with :func:`grpo_train_step`
(one ``nnx.jit`` step: GRPO loss, gradients with respect to the Params, optimizer update in
place), or plain ``optax`` on the state ``nnx.split`` returns (or on ``to_params()``, with
:func:`models.training.rl.make_train_step`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import kv_cache as kvc
from models.config import LlamaConfig
from models.gguf import default_gguf_path, load_gguf
from models.llama import Llama
from models.training.logprobs import completion_logprobs
from models.training.rl import GRPOBatch, GRPOConfig, grpo_objective
from models.weights import init_params, load_hf_checkpoint, params_from_hf_state_dict

__all__ = ["LAYER_PARAMS", "LayerParams", "NNXLlama", "grpo_train_step", "params_from_state"]

#: Names of one layer's parameters (the keys of the plain tree's ``"layers"``).
LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


class LayerParams(nnx.Module):
    """One layer's parameters (list layout) or all layers' stacked ``[L, ...]`` (stacked layout)."""

    def __init__(self, tree: dict):
        missing = [n for n in LAYER_PARAMS if n not in tree]
        if missing:
            raise ValueError(f"layer parameters are missing {missing}; expected {list(LAYER_PARAMS)}")
        for name in LAYER_PARAMS:
            setattr(self, name, nnx.Param(tree[name]))

    def to_dict(self) -> dict:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


class NNXLlama(nnx.Module):
    """A Llama decoder with ``nnx.Param`` leaves (see the module docstring).

    ``impl`` and ``interpret`` are those of :class:`~models.llama.Llama`; ``model.llama`` is the
    functional decoder it runs.
    """

    def __init__(self, config: LlamaConfig, params: dict, *, impl: str = "auto", interpret: bool = False):
        if not isinstance(params, dict) or "embed" not in params or "layers" not in params:
            raise TypeError(f"params must be the parameter dict of models.weights, got {type(params).__name__}")
        self.llama = Llama(config, impl=impl, interpret=interpret)
        self.config = config
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = None if params.get("lm_head") is None else nnx.Param(params["lm_head"])
        layers = params["layers"]
        if kvc.is_stacked(layers):
            self.layers = LayerParams(layers)
        else:
            self.layers = nnx.List([LayerParams(lp) for lp in layers])

    # ------------------------------------------------------------------ conversions
    def to_params(self) -> dict:
        """The plain parameter tree (the Params' current arrays)."""
        if isinstance(self.layers, LayerParams):
            layers = self.layers.to_dict()
        else:
            layers = [lp.to_dict() for lp in self.layers]
        out = {"embed": self.embed[...], "layers": layers, "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        return out

    def load_params(self, params: dict) -> None:
        """Write a plain tree of the module's structure, shapes and layout into its Params."""
        _, state = nnx.split(self, nnx.Param)
        current = params_from_state(state)
        want, got = jax.tree_util.tree_structure(current), jax.tree_util.tree_structure(params)
        if want != got:
            raise ValueError(f"params has structure {got}, the module holds {want}")
        bad = [f"{jax.tree_util.keystr(path)}: {tuple(b.shape)} (expected {tuple(a.shape)})"
               for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(current), jax.tree_util.tree_leaves(params))
               if tuple(a.shape) != tuple(b.shape)]
        if bad:
            raise ValueError(f"params has wrongly shaped leaves: {bad}")
        pure = dict(params)
        if not kvc.is_stacked(pure["layers"]):
            pure["layers"] = dict(enumerate(pure["layers"]))
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(self, state)

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_hf_checkpoint(cls, path, dtype=jnp.float32, **kw) -> "NNXLlama":
        """A Hugging Face Llama checkpoint directory (:func:`models.load_hf_checkpoint`)."""
        config, params = load_hf_checkpoint(path, dtype)
        return cls(config, params, **kw)

    @classmethod
    def from_gguf(cls, path: str | None = None, dtype=jnp.float32, **kw) -> "NNXLlama":
        """A Llama GGUF file (default: the built-in SmolLM2-135M-Instruct)."""
        hf_config, state = load_gguf(default_gguf_path() if path is None else path, "float32")
        config = LlamaConfig.from_hf_config(hf_config)
        return cls(config, params_from_hf_state_dict(config, state, dtype), **kw)

    @classmethod
    def init(cls, config: LlamaConfig, key: jax.Array, dtype=jnp.float32, **kw) -> "NNXLlama":
        """Random weights (:func:`models.init_params`)."""
        return cls(config, init_params(config, key, dtype), **kw)

    # ------------------------------------------------------------------ computations
    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Logits ``[B, T, V]`` float32 of a causal forward pass (:meth:`Llama.forward`)."""
        return self.llama.forward(self.to_params(), tokens_bt)

    def completion_logprobs(self, prompt_tokens, prompt_lengths, completion_tokens, completion_lengths,
                            **kw) -> Any:
        """:func:`models.training.logprobs.completion_logprobs` with this module's parameters."""
        return completion_logprobs(self.llama, self.to_params(), prompt_tokens, prompt_lengths, completion_tokens,
                                   completion_lengths, **kw)


def params_from_state(state: nnx.State) -> dict:
    """The plain parameter tree of an ``nnx.split(model, nnx.Param)`` state (the list layout's
    integer-keyed layers become a list)."""
    tree = nnx.to_pure_dict(state)
    layers = tree["layers"]
    if isinstance(layers, dict) and layers and all(isinstance(k, int) for k in layers):
        tree["layers"] = [layers[i] for i in range(len(layers))]
    return tree


@nnx.jit(static_argnames=("config",))
def grpo_train_step(model: NNXLlama, optimizer: nnx.Optimizer, batch: GRPOBatch,
                    config: GRPOConfig = GRPOConfig()) -> dict:
    """One GRPO step on an :class:`NNXLlama`: loss and gradients with respect to its
    ``nnx.Param`` leaves, then ``optimizer.update`` (in place).  Returns the metrics of
    :func:`models.training.rl.grpo_loss` plus ``loss``."""
    def loss_fn(m: NNXLlama):
        return grpo_objective(m.llama, m.to_params(), batch, config)

    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return dict(metrics, loss=loss)
