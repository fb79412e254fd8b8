"""Gather oracle of tree attention (``impl="reference"``): every sequence's context (path spans
then suffix) gathered on the device from host index tables, then
:func:`jax_prefix_attn.reference.attention` (or a dense masked attention for draft token trees).
It materialises ``[B, L_max, Hkv, D]`` contexts: a test oracle, not a fast path.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import reference
from jax_prefix_attn.prefix_tree import PrefixTree
from jax_prefix_attn.tree_drafts import draft_ancestors, masked_attention

__all__ = ["tree_reference_attention"]


def tree_reference_attention(q, tree: PrefixTree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale,
                             draft_parents=None):
    """``(out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq])`` of ``tree_attention`` by gathering
    each sequence's context (``draft_parents``: ``[B, Tq]`` int32 or ``None``)."""
    b = q.shape[0]
    smax = suffix_k.shape[1]
    paths = [tree.path_token_indices(i) for i in range(b)]
    pmax = max(1, max(p.shape[0] for p in paths))
    idx = np.zeros((b, pmax), np.int64)
    plen = np.zeros((b,), np.int32)
    for i, p in enumerate(paths):
        idx[i, : p.shape[0]] = p
        plen[i] = p.shape[0]
    kp = k_pool[jnp.asarray(idx)]                              # [B, Pmax, Hkv, D]
    vp = v_pool[jnp.asarray(idx)]
    # Place each sequence's suffix right after its path: position p in [0, Pmax + Smax).
    tot = pmax + smax
    j = jnp.arange(tot)[None, :]
    plen_j = jnp.asarray(plen)[:, None]
    in_path = j < plen_j
    sj = jnp.clip(j - plen_j, 0, max(smax - 1, 0))
    if smax > 0:
        ks = jnp.take_along_axis(suffix_k, sj[:, :, None, None], axis=1)
        vs = jnp.take_along_axis(suffix_v, sj[:, :, None, None], axis=1)
    else:
        ks = jnp.zeros((b, tot) + k_pool.shape[1:], k_pool.dtype)
        vs = ks
    pj = jnp.clip(j, 0, pmax - 1)
    kpp = jnp.take_along_axis(kp, pj[:, :, None, None], axis=1)
    vpp = jnp.take_along_axis(vp, pj[:, :, None, None], axis=1)
    k = jnp.where(in_path[..., None, None], kpp, ks)
    v = jnp.where(in_path[..., None, None], vpp, vs)
    lengths = jnp.asarray(plen) + suffix_lengths.astype(jnp.int32)
    if draft_parents is None:
        return reference.attention(q, k, v, causal=True, kv_lengths=lengths, sm_scale=scale)
    tq = q.shape[1]
    anc = draft_ancestors(draft_parents, tq)
    first = (lengths - tq)[:, None, None]
    jj = jnp.arange(tot)[None, None, :]
    du = jnp.clip(jj - first, 0, tq - 1)
    on_branch = jnp.take_along_axis(anc, jnp.broadcast_to(du, (b, tq, tot)), axis=2)
    mask = (jj < lengths[:, None, None]) & ((jj < first) | on_branch)
    o, lse = masked_attention(q, k, v, mask, scale)
    return o.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[:3])
