"""Interleaved micro-batches: one model call over ``M`` independent groups of sequences, layer
by layer, so that on a tensor-parallel mesh the all-reduces of one group run while another
group computes.

On a ``model`` mesh axis each layer ends its attention and its MLP in a row-split projection
whose all-reduce the next op waits for: with one batch, every all-reduce sits on the critical
path (two per layer).  With the batch held as ``M`` groups (separate suffix buffers of
``B / M`` sequences each, hanging from the same prefix levels), :func:`extend_groups` runs per
layer the attention block of group 0, then of group 1, ..., then the MLP blocks likewise, so the
all-reduce of group ``m`` is in flight while group ``m + 1`` computes.  The all-reduces are
chained -- each one's input passes through an ``optimization_barrier`` with the previous
all-reduce's output -- so XLA neither merges the groups' all-reduces into one (which would put
them back on the critical path) nor reorders them; the barrier orders only the collectives,
never the compute that overlaps them.

Every group runs exactly the ops of :meth:`models.llama.Llama.extend` on its own rows, so each
group's results equal an ordinary call on that group alone.  The prefix levels must hold one node
each (on a mesh: one per data shard), because every group reads all of them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from models import kv_cache as kvc
from models.layers import lm_head, rms_norm
from models.llama import Llama
from models.kv_cache import PrefixCache

__all__ = ["Group", "extend_groups"]


class Group(NamedTuple):
    """One micro-batch: ``layers`` its per-layer suffix buffers (``[B_m, S_max, Hkv, D]``, list or
    stacked layout like the parameters), ``lengths_b`` / ``pos_offset_b`` int32 ``[B_m]``,
    ``tokens_bt`` int32 ``[B_m, T]`` left-padded new tokens, ``n_new_b`` int32 ``[B_m]``."""
    layers: Any
    lengths_b: jax.Array
    pos_offset_b: jax.Array
    tokens_bt: jax.Array
    n_new_b: jax.Array


class _Chain:
    """All-reduces in one chain: each waits for the previous one (see module docstring)."""

    def __init__(self, model: Llama):
        self.model = model
        self.last = None

    def sum(self, y: jax.Array) -> jax.Array:
        if self.model.model_axis is None:
            return y
        if self.last is not None:
            _, y = jax.lax.optimization_barrier((self.last, y))
        self.last = self.model.sum_shards(y)
        return self.last


def check_prefix(prefix: PrefixCache) -> None:
    """Raise ``ValueError`` unless every prefix level holds one node."""
    nodes = tuple(int(n.shape[0]) for n in prefix.lengths)
    if any(n != 1 for n in nodes):
        raise ValueError(f"interleaved groups need prefix levels of one node each (every group reads all of "
                         f"them), got levels of {nodes} nodes")


def extend_groups(model: Llama, params: dict, prefix: PrefixCache, groups: tuple[Group, ...], *,
                  backend: str) -> tuple[tuple, tuple, tuple]:
    """:meth:`models.llama.Llama.extend` of every group, interleaved layer by layer.

    Returns ``(logits, layers, new_lengths)``, tuples over groups: logits ``[B_m, V]`` float32 of
    each sequence's last column, the groups' new suffix buffers and lengths.
    """
    if not groups:
        raise ValueError("groups must hold at least one group")
    if backend not in ("shared", "none"):
        raise ValueError(f"backend must be 'shared' or 'none' (suffix buffers after prefix levels), got {backend!r}")
    if model.shared_impl == "tree":
        raise ValueError("interleaved groups attend through shared_impl='levels', got a model with 'tree'")
    check_prefix(prefix)
    for g in groups:
        kvc.check_layout(params["layers"], prefix.layers, g.layers)
    stacked = kvc.is_stacked(params["layers"])
    n_new = tuple(g.n_new_b.astype(jnp.int32) for g in groups)
    pos = tuple(model.positions(g.lengths_b, g.pos_offset_b, n, g.tokens_bt.shape[1]) for g, n in zip(groups, n_new))
    new_lengths = tuple(g.lengths_b + n for g, n in zip(groups, n_new))

    def layer(xs, lp, prefix_kv, suffix_kvs):
        chain = _Chain(model)
        xs, bufs = list(xs), []
        for m, g in enumerate(groups):
            attend, buf = model.cache_attend(prefix_kv, suffix_kvs[m], n_new_b=n_new[m], lengths_b=g.lengths_b,
                                             new_lengths_b=new_lengths[m], prefix_lengths=prefix.lengths,
                                             backend=backend)
            y, _ = model.attention_block(lp, xs[m], pos[m], attend)
            xs[m] = xs[m] + chain.sum(y).astype(xs[m].dtype)
            bufs.append(buf)
        for m in range(len(groups)):
            xs[m] = xs[m] + chain.sum(model.mlp_block(lp, xs[m])).astype(xs[m].dtype)
        return tuple(xs), tuple(bufs)

    xs = tuple(model.embed_tokens(params, g.tokens_bt) for g in groups)
    suffix = tuple(g.layers for g in groups)
    if stacked:
        xs, layers = jax.lax.scan(lambda h, a: layer(h, a[0], a[1], a[2]), xs, (params["layers"], prefix.layers,
                                                                              suffix))
    else:
        per_layer = []
        for i, lp in enumerate(params["layers"]):
            xs, bufs = layer(xs, lp, prefix.layers[i], tuple(s[i] for s in suffix))
            per_layer.append(bufs)
        layers = tuple([bufs[m] for bufs in per_layer] for m in range(len(groups)))
    logits = tuple(lm_head(rms_norm(x[:, -1], params["final_norm"], model.config.rms_norm_eps), params) for x in xs)
    return logits, layers, new_lengths
