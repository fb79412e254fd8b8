"""Functional KV cache: pytrees passed into and returned from every model call (no hidden state).

Two registered dataclasses (``flax.struct.dataclass``):

:class:`PrefixCache` -- the shared prefix levels, stored once ("system KV cache" of
RelayAttention; Hydragen's shared prefix).  Level ``l`` holds ``G_l`` distinct prefix nodes,
``G_0 | G_1 | ...``: node ``g`` of level ``l`` is a child of node ``g // (G_l // G_{l-1})`` of
level ``l-1`` (children are contiguous).  Per layer and level: keys/values
``[G_l, P_l, Hkv, D]`` (``P_l`` = the longest node of the level; rows ``>= lengths[l][g]`` are
padding).  Also the logits after each node of the deepest level, ``last_logits [G_last, V]``,
so that sequences whose prompt is just their prefix path can start sampling.  A prefilled
:class:`PrefixCache` can be reused by any number of later batches.

:class:`KVCache` -- a decoding batch of ``B`` sequences: the :class:`PrefixCache` it hangs
from (sequence ``b`` uses node ``b // (B // G_l)`` of level ``l``), plus a per-sequence suffix
buffer ``[B, S_max, Hkv, D]`` per layer, the number of valid suffix entries ``lengths [B]`` and
``pos_offset [B]``, the RoPE position of suffix entry 0 (= the length of the sequence's prefix
path: suffix positions continue after the prefix).  ``backend`` (static) says how attention
reads it:

* ``"shared"`` / ``"none"``: prefix levels + suffix as above;
* ``"flat"``: no prefix levels; every sequence's buffer starts with its own copy of its whole
  prefix path (``pos_offset = 0``), the FlashAttention baseline of the papers.

Layer layout follows the parameters (see :mod:`models.weights`): either *stacked* -- every
per-layer leaf has a leading ``[L, ...]`` axis and the layer loop is a ``lax.scan`` -- or a
*list* of ``L`` per-layer pytrees with an unrolled layer loop (each layer's buffer is its own
array, so XLA updates it in place and kernels read it without slicing copies; this is the
layout used for GPU benchmarks).  Per layer the tree is ``{"k": ..., "v": ...}`` where for a
:class:`PrefixCache` the values are tuples over levels.

Shapes are static; all lengths are int32 device arrays, so every function here is jit-friendly.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from models.config import LlamaConfig

__all__ = ["BACKENDS", "KVCache", "PrefixCache", "abstract_kv_cache", "empty_prefix_cache", "flatten_prefix",
           "init_kv_cache", "is_stacked", "layer_map", "num_layers", "write_suffix"]

BACKENDS = ("shared", "flat", "none")


def is_stacked(layers: Any) -> bool:
    """True for the stacked layout (leading ``[L]`` axis), False for a list of per-layer trees."""
    return not isinstance(layers, (list, tuple))


def num_layers(layers: Any) -> int:
    if not is_stacked(layers):
        return len(layers)
    leaves = jax.tree_util.tree_leaves(layers)
    return leaves[0].shape[0]


def layer_map(fn: Callable, *trees: Any, stacked: bool, num_layers: int | None = None) -> Any:
    """Apply ``fn`` per layer to trees in the stacked (vmapped) or list layout.

    ``num_layers`` is required for the stacked layout when the trees may hold no array (e.g. the
    prefix cache of a plain batch, whose levels are empty tuples): ``vmap`` cannot infer ``L``.
    """
    if stacked:
        return jax.vmap(fn, axis_size=num_layers)(*trees)
    return [fn(*xs) for xs in zip(*trees)]


@struct.dataclass
class PrefixCache:
    """Shared prefix levels (see module docstring)."""
    layers: Any                      # per layer {"k": tuple_l [G_l, P_l, Hkv, D], "v": ...}
    lengths: tuple                   # tuple_l int32 [G_l]
    last_logits: Any                 # float32 [G_last, V] or None when there is no level
    # host copy of the node lengths per level (static), set only for the tree-attention option
    # (``Llama(shared_impl="tree")``): tree metadata needs concrete spans
    tree_nodes: tuple | None = struct.field(pytree_node=False, default=None)

    @property
    def num_levels(self) -> int:
        return len(self.lengths)

    def level_sizes(self) -> tuple[int, ...]:
        """``(G_0, G_1, ...)``: number of distinct nodes per level."""
        return tuple(int(l.shape[0]) for l in self.lengths)

    def path_lengths(self, batch: int) -> jax.Array:
        """Prefix path length ``[batch]`` int32 of each of ``batch`` sequences hanging from it."""
        total = jnp.zeros((batch,), jnp.int32)
        for lengths_g in self.lengths:
            g = lengths_g.shape[0]
            total = total + jnp.repeat(lengths_g, batch // g, total_repeat_length=batch)
        return total


@struct.dataclass
class KVCache:
    """A decoding batch's cache (see module docstring)."""
    prefix: PrefixCache
    layers: Any                      # per layer {"k": [B, S_max, Hkv, D], "v": ...}
    lengths: jax.Array               # int32 [B] valid suffix entries
    pos_offset: jax.Array            # int32 [B] RoPE position of suffix entry 0
    backend: str = struct.field(pytree_node=False, default="shared")

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        """``S_max``: suffix buffer length."""
        leaf = jax.tree_util.tree_leaves(self.layers)[0]
        return int(leaf.shape[-3])


def empty_prefix_cache(config: LlamaConfig, dtype, *, stacked: bool = True) -> PrefixCache:
    """A prefix cache with no level (plain batched decoding)."""
    per_layer = {"k": (), "v": ()}
    layers = per_layer if stacked else [dict(per_layer) for _ in range(config.num_hidden_layers)]
    return PrefixCache(layers=layers, lengths=(), last_logits=None)


def init_kv_cache(config: LlamaConfig, prefix: PrefixCache, batch: int, capacity: int, dtype, *,
                  backend: str = "shared", stacked: bool = True) -> KVCache:
    """Zeroed suffix buffers ``[B, capacity, Hkv, D]`` per layer hanging from ``prefix``.

    ``lengths`` start at 0 and ``pos_offset`` at each sequence's prefix path length.  For the
    ``"flat"`` backend use :func:`flatten_prefix` instead (it copies the prefix into the buffers).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    sizes = prefix.level_sizes()
    if sizes and batch % sizes[-1]:
        raise ValueError(f"batch ({batch}) must be a multiple of the number of nodes of the deepest "
                         f"prefix level ({sizes[-1]})")
    shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
    L = config.num_hidden_layers
    if stacked:
        layers = {"k": jnp.zeros((L,) + shape, dtype), "v": jnp.zeros((L,) + shape, dtype)}
    else:
        layers = [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(L)]
    return KVCache(prefix=prefix, layers=layers, lengths=jnp.zeros((batch,), jnp.int32),
                   pos_offset=prefix.path_lengths(batch), backend=backend)


def abstract_kv_cache(config: LlamaConfig, prefix: PrefixCache, batch: int, capacity: int, dtype, *,
                      backend: str = "shared", stacked: bool = True) -> KVCache:
    """``jax.ShapeDtypeStruct`` tree of :func:`init_kv_cache` (no allocation)."""
    return jax.eval_shape(lambda p: init_kv_cache(config, p, batch, capacity, dtype, backend=backend,
                                                  stacked=stacked), prefix)


def write_suffix(buf_bshd: jax.Array, new_bthd: jax.Array, lengths_b: jax.Array,
                 n_new_b: jax.Array) -> jax.Array:
    """Write the last ``n_new[b]`` of the ``T`` new rows of ``new`` at ``buf[b, lengths[b]:]``.

    ``new`` is left-padded: row ``t`` of sequence ``b`` is real when ``t >= T - n_new[b]``.
    Pad rows, rows of finished sequences (``n_new = 0``) and rows past ``S_max`` are dropped.
    """
    b, t = new_bthd.shape[:2]
    s = buf_bshd.shape[1]
    ti = jnp.arange(t, dtype=jnp.int32)[None, :]
    start = (t - n_new_b)[:, None]
    idx = jnp.where(ti >= start, lengths_b[:, None] + ti - start, s)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    return buf_bshd.at[rows, idx].set(new_bthd.astype(buf_bshd.dtype), mode="drop")


def flatten_prefix(config: LlamaConfig, prefix: PrefixCache, batch: int, capacity: int, dtype, *,
                   stacked: bool = True) -> KVCache:
    """A ``"flat"`` cache: each sequence's buffer starts with a copy of its whole prefix path.

    ``lengths[b]`` = path length, ``pos_offset = 0`` (buffer index = position).
    """
    path = prefix.path_lengths(batch)
    sizes = prefix.level_sizes()
    offsets, acc = [], jnp.zeros((batch,), jnp.int32)
    for lengths_g in prefix.lengths:
        offsets.append(acc)
        acc = acc + jnp.repeat(lengths_g, batch // lengths_g.shape[0], total_repeat_length=batch)

    def one_layer(pl):
        out = {}
        for name in ("k", "v"):
            buf = jnp.zeros((batch, capacity, config.num_key_value_heads, config.head_dim), dtype)
            for lvl, (kv_gphd, lengths_g, off_b) in enumerate(zip(pl[name], prefix.lengths, offsets)):
                g, p = kv_gphd.shape[:2]
                node_b = jnp.arange(batch) // (batch // sizes[lvl])
                src = kv_gphd[node_b]                                   # [B, P, Hkv, D]
                j = jnp.arange(p, dtype=jnp.int32)[None, :]
                idx = jnp.where(j < lengths_g[node_b][:, None], off_b[:, None] + j, capacity)
                rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, p))
                buf = buf.at[rows, idx].set(src.astype(dtype), mode="drop")
            out[name] = buf
        return out

    layers = layer_map(one_layer, prefix.layers, stacked=stacked, num_layers=config.num_hidden_layers)
    empty = empty_prefix_cache(config, dtype, stacked=stacked)
    return KVCache(prefix=empty, layers=layers, lengths=path, pos_offset=jnp.zeros((batch,), jnp.int32),
                   backend="flat")


def check_layout(params_layers: Any, *trees: Any) -> None:
    """Raise if caches and parameters disagree on the layer layout."""
    want = is_stacked(params_layers)
    for t in trees:
        if is_stacked(t) != want:
            raise ValueError(f"layer layout mismatch: parameters are {'stacked' if want else 'a list'} but a "
                             f"cache is {'stacked' if not want else 'a list'}; build caches from the same params")

