"""The layer layout a model runs with: ``"stacked"`` (one array per weight with a leading layer
axis, run by ``lax.scan``) or ``"list"`` (one tree per layer, unrolled), for parameters and for
a :class:`~models.kv_cache.PrefixCache` built in either layout (:mod:`models.generate`);
:func:`layer_loop` runs one layer body over the layers of either layout, optionally
rematerialised (the cache-free scoring paths: :mod:`models.prompt_logprobs`,
:mod:`models.training.logprobs`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models import kv_cache as kvc
from models.kv_cache import PrefixCache
from models.llama import Llama

__all__ = ["LAYOUTS", "layer_loop", "match_prefix_layout", "resolve_layout"]

LAYOUTS = ("auto", "stacked", "list")


def _want_list(layers, layout: str) -> bool:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "auto":  # list layout on GPU, otherwise keep what the caller has
        return (not kvc.is_stacked(layers)) or jax.default_backend() == "gpu"
    return layout == "list"


def _unstack_tree(layers, n: int) -> list:
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n)]


def _stack_tree(layers) -> dict:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)


def resolve_layout(model: Llama, params: dict, layout: str = "auto") -> dict:
    """Parameters in the layer layout :func:`models.generate.generate` runs with.

    ``layout``: ``"stacked"`` (``lax.scan`` over layers), ``"list"`` (unrolled layers, one KV
    buffer per layer) or ``"auto"`` (default): the list layout on GPU -- measured ~3x faster per
    layer on an H200, XLA copies each layer's slice out of stacked arrays inside the scan -- and
    the parameters' own layout elsewhere (on CPU the list layout ran ~1.7x faster per token for
    SmolLM2 but compiled ~2.3x longer, 30 unrolled layers; see ``models/__init__.py``).  The
    conversion is kept by :meth:`Llama.params_in_layout` for the last parameter tree seen, so
    repeated calls with the same (stacked) parameters convert once.
    """
    return model.params_in_layout(params, stacked=not _want_list(params["layers"], layout))


def match_prefix_layout(prefix: PrefixCache, params: dict) -> PrefixCache:
    """A prefix cache in the parameters' layer layout (converted if it was built with the other)."""
    if kvc.is_stacked(prefix.layers) == kvc.is_stacked(params["layers"]):
        return prefix
    if kvc.is_stacked(prefix.layers):
        n = len(params["layers"])
        if not prefix.lengths:
            return prefix.replace(layers=[{"k": (), "v": ()} for _ in range(n)])
        return prefix.replace(layers=_unstack_tree(prefix.layers, n))
    if not prefix.lengths:
        return prefix.replace(layers={"k": (), "v": ()})
    return prefix.replace(layers=_stack_tree(prefix.layers))


def layer_loop(body, carry, layers, remat: bool, policy):
    """``carry = body(carry, lp)`` over the layers: ``lax.scan`` (stacked) or unrolled (list),
    each layer rematerialised in the backward when ``remat``."""
    stacked = kvc.is_stacked(layers)
    fn = jax.checkpoint(body, policy=policy, prevent_cse=not stacked) if remat else body
    if stacked:
        return jax.lax.scan(lambda c, lp: (fn(c, lp), None), carry, layers)[0]
    for lp in layers:
        carry = fn(carry, lp)
    return carry
