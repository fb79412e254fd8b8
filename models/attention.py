"""Attention of new tokens over a :class:`~models.kv_cache.KVCache` layer: the one place the
decoder calls :mod:`jax_prefix_attn`.

:func:`cache_attention` computes, for queries ``q [B, T, Hq, D]`` (the newest ``T`` tokens of
each sequence, already written into the suffix buffer), exact causal attention over each
sequence's prefix path followed by its suffix:

* ``backend="flat"``: the buffer holds the whole sequence; one
  :func:`jax_prefix_attn.attention` call (flash kernel on GPU) with ``kv_lengths``.  Where the
  library's planner says so (:func:`jax_prefix_attn.planner.use_flat_decode`: decoding, ``T <=
  FLAT_DECODE_MAX_TQ``, on GPU) it calls
  :func:`jax_prefix_attn.shared_prefix_attention` with ``impl="flat"`` instead: its ragged split-KV
  decode kernel puts the ``Hq/Hkv`` query heads of a kv head in one tile, so each key/value is read
  once per kv head rather than once per query head.  The buffer is passed as the per-sequence
  "suffix" behind a one-row dummy prefix of length 0 (no key of it is visible), which is exactly
  causal attention over ``buffer[:lengths]``: every sequence still reads its own full copy;
* ``backend="shared"``: prefix levels are stored once (see :mod:`models.kv_cache`).  The deepest
  level and the suffix go through :func:`jax_prefix_attn.shared_prefix_attention` (grouped
  prefixes with ``seq_to_prefix``); every shallower level (e.g. the shared root of a two-level
  batch) is attended with Hydragen's inter-sequence batching -- the queries of all ``n`` sequences
  under one node are folded into one query block, ``q.reshape(G, n*T, Hq, D)`` against that
  node's keys, one non-causal :func:`jax_prefix_attn.attention` call -- and all parts are merged
  exactly with :func:`jax_prefix_attn.merge_attention_states`.  With ``tree_nodes`` (option
  ``Llama(shared_impl="tree")``) all levels and the suffix go through one
  :func:`jax_prefix_attn.tree_attention` call instead (:func:`tree_cache_attention`).

``impl``: ``"auto"`` (each library call picks its kernels on a GPU, the pure-JAX reference
elsewhere) or ``"reference"`` (pure JAX everywhere); ``interpret`` is passed to every library
call (the kernels it runs run in Pallas interpret mode).  The "none" backend never gets here
(see :mod:`models.llama`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_prefix_attn
from jax_prefix_attn.planner import FLAT_DECODE_MAX_TQ, use_flat_decode

__all__ = ["FLAT_DECODE_MAX_TQ", "cache_attention", "flat_decode_attention", "level_attention", "prefix_tree",
           "tree_cache_attention"]


def flat_decode_attention(q_bthd: jax.Array, k_bshd: jax.Array, v_bshd: jax.Array, lengths_b: jax.Array,
                          *, impl: str = "flat", interpret: bool = False) -> jax.Array:
    """Causal attention ``[B, T, Hq, D]`` of the newest ``T`` tokens over ``buffer[b, :lengths[b]]``
    through :func:`jax_prefix_attn.shared_prefix_attention` (``impl``: ``"flat"`` = the ragged
    decode kernel, or any impl it accepts; ``interpret`` as there); the buffer is the suffix
    behind an empty (length-0) dummy prefix."""
    b, _, _, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    dtype = q_bthd.dtype
    dummy = jnp.zeros((1, 1, hkv, d), dtype)
    return jax_prefix_attn.shared_prefix_attention(
        q_bthd, dummy, dummy, k_bshd.astype(dtype), v_bshd.astype(dtype), suffix_lengths=lengths_b,
        prefix_lengths=jnp.zeros((1,), jnp.int32), seq_to_prefix=jnp.zeros((b,), jnp.int32), impl=impl,
        interpret=interpret)


def prefix_tree(tree_nodes: tuple, prefix_p: tuple, batch: int):
    """:class:`jax_prefix_attn.PrefixTree` of the prefix levels (host ints) and the flat-pool
    layout: level ``l``'s ``[G_l, P_l]`` buffer flattened, levels concatenated; node ``g`` of
    level ``l`` spans ``[off_l + g * P_l, + len)``; sequence ``b`` hangs from node
    ``b // (B // G_last)`` of the deepest level."""
    parents, starts, lengths, first = [], [], [], []
    off = 0
    for l, (lens, p) in enumerate(zip(tree_nodes, prefix_p)):
        g = len(lens)
        first.append(len(parents))
        for i, n in enumerate(lens):
            parents.append(-1 if l == 0 else first[l - 1] + i // (g // len(tree_nodes[l - 1])))
            starts.append(off + i * p)
            lengths.append(int(n))
        off += g * p
    g_last = len(tree_nodes[-1])
    leaf = [first[-1] + b // (batch // g_last) for b in range(batch)]
    return jax_prefix_attn.PrefixTree(parents, starts, lengths, leaf)


def tree_cache_attention(q_bthd, prefix_k: tuple, prefix_v: tuple, tree_nodes: tuple, k_bshd, v_bshd,
                         lengths_b, *, impl: str = "auto", interpret: bool = False) -> jax.Array:
    """The ``"shared"`` backend through :func:`jax_prefix_attn.tree_attention` (one call for all
    levels and the suffix).  The levels are concatenated into a flat pool per call: a copy of the
    prefix per layer per step, which the default levels path does not make."""
    dtype = q_bthd.dtype
    hkv, d = k_bshd.shape[2], k_bshd.shape[3]
    pool_k = jnp.concatenate([k.reshape(-1, hkv, d) for k in prefix_k]).astype(dtype)
    pool_v = jnp.concatenate([v.reshape(-1, hkv, d) for v in prefix_v]).astype(dtype)
    tree = prefix_tree(tree_nodes, tuple(k.shape[1] for k in prefix_k), q_bthd.shape[0])
    return jax_prefix_attn.tree_attention(q_bthd, tree, pool_k, pool_v, k_bshd.astype(dtype), v_bshd.astype(dtype),
                                          suffix_lengths=lengths_b, impl=impl, interpret=interpret)


def level_attention(q_bthd: jax.Array, k_gphd: jax.Array, v_gphd: jax.Array, lengths_g: jax.Array,
                    *, impl: str, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Non-causal attention of ``B`` sequences over the ``G`` nodes of one prefix level.

    Sequence ``b`` uses node ``b // (B // G)``.  The ``n = B // G`` sequences of a node are one
    query block (inter-sequence batching), so each node's keys are read once.
    Returns ``(out [B, T, Hq, D], lse [B, T, Hq])``.
    """
    b, t, hq, d = q_bthd.shape
    g = k_gphd.shape[0]
    qg = q_bthd.reshape(g, (b // g) * t, hq, d)
    out, lse = jax_prefix_attn.attention(qg, k_gphd, v_gphd, causal=False, kv_lengths=lengths_g, impl=impl,
                                         interpret=interpret)
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)


def cache_attention(q_bthd: jax.Array, prefix_k: tuple, prefix_v: tuple, prefix_lengths: tuple,
                    k_bshd: jax.Array, v_bshd: jax.Array, lengths_b: jax.Array, *, backend: str,
                    impl: str = "auto", interpret: bool = False, tree_nodes: tuple | None = None) -> jax.Array:
    """Attention output ``[B, T, Hq, D]`` (q's dtype) of the newest ``T`` tokens over the cache.

    Args:
      q_bthd: queries ``[B, T, Hq, D]`` (RoPE applied).
      prefix_k, prefix_v: tuples over levels of ``[G_l, P_l, Hkv, D]`` (empty for "flat").
      prefix_lengths: tuple over levels of int32 ``[G_l]``.
      k_bshd, v_bshd: suffix buffers ``[B, S_max, Hkv, D]`` including the new tokens.
      lengths_b: valid suffix entries ``[B]`` (including the new tokens).
      impl, interpret: see the module docstring.
      tree_nodes: host node lengths per level; when given (``Llama(shared_impl="tree")``) the
        "shared" backend goes through :func:`tree_cache_attention`.
    """
    k_bshd, v_bshd = k_bshd.astype(q_bthd.dtype), v_bshd.astype(q_bthd.dtype)  # the caches' dtype may differ
    if backend == "flat":
        if prefix_k:
            raise ValueError("the flat backend keeps no prefix levels; build its cache with flatten_prefix")
        if use_flat_decode(q_bthd.shape, q_bthd.dtype, k_bshd.shape[1], impl=impl):
            return flat_decode_attention(q_bthd, k_bshd, v_bshd, lengths_b, impl="flat", interpret=interpret)
        out, _ = jax_prefix_attn.attention(q_bthd, k_bshd, v_bshd, causal=True, kv_lengths=lengths_b, impl=impl,
                                           interpret=interpret)
        return out
    if backend != "shared":
        raise ValueError(f"cache_attention backend must be 'shared' or 'flat', got {backend!r}")
    if tree_nodes is not None and prefix_k:
        return tree_cache_attention(q_bthd, prefix_k, prefix_v, tree_nodes, k_bshd, v_bshd, lengths_b, impl=impl,
                                    interpret=interpret)
    dtype = q_bthd.dtype
    b = q_bthd.shape[0]
    outs, lses = [], []
    levels = list(zip(prefix_k, prefix_v, prefix_lengths))
    if levels:
        k_last, v_last, len_last = levels.pop()
        g = k_last.shape[0]
        out, lse = jax_prefix_attn.shared_prefix_attention(
            q_bthd, k_last.astype(dtype), v_last.astype(dtype), k_bshd, v_bshd, suffix_lengths=lengths_b,
            prefix_lengths=len_last, seq_to_prefix=jnp.arange(b, dtype=jnp.int32) // (b // g), return_lse=True,
            impl=impl, interpret=interpret)
    else:
        out, lse = jax_prefix_attn.attention(q_bthd, k_bshd, v_bshd, causal=True, kv_lengths=lengths_b, impl=impl,
                                             interpret=interpret)
    outs.append(out)
    lses.append(lse)
    for k_g, v_g, len_g in levels:
        out, lse = level_attention(q_bthd, k_g.astype(dtype), v_g.astype(dtype), len_g, impl=impl,
                                   interpret=interpret)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0]
    out, _ = jax_prefix_attn.merge_attention_states(outs, lses)
    return out
