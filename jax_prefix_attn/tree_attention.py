"""Tree attention: exact attention for a batch of sequences whose prefixes form a forest.

``tree_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, *, suffix_lengths, ...)``
computes, for every sequence ``b``, ``reference.attention`` of its ``Tq`` queries over its
full context ``concat(spans of tree.path(b)) ++ suffix_k[b, :suffix_lengths[b]]`` with the
bottom-right causal rule (queries are the last ``Tq`` context tokens), without ever
materialising those contexts: shared spans are read once for all the rows below them.

Schedules (``impl``):

* ``"levelwise"`` (Hydragen section 3.3): one launch per tree depth; item = (node, block of
  the rows of every sequence below it) looping over the node's span; partials merged along
  each path.
* ``"flatten"`` (DeFT-Flatten): node KV flattened depth-first into ``block_kv``-token chunks,
  each paired with its rows; one launch computes a partial per (chunk, row block); a
  tree-topology-aware static reduction merges them per row.
* ``"hybrid"`` (decoding, ``Tq == 1``): the root read by several sequences through the
  shared-prefix path's prefix kernel (Mosaic GPU on Hopper), the other shared nodes through the
  tree kernel, and each sequence's exclusive node (e.g. a tree-of-thought leaf) streamed in
  place by the decode suffix kernel together with its suffix, which merges everything in its
  epilogue (:func:`_hybrid`; ``"hybrid_interpret"``: the same kernels in interpret mode).
* ``"auto"``: :func:`auto_path`.  On the GPU, a single-level forest (every sequence hangs from
  a root, non-empty suffixes) goes to ``shared_prefix_attention`` (one prefix group per root);
  when decoding, a shallow forest (at most ``tree.SHALLOW_MAX_TOKENS`` path tokens below each
  sequence's root, e.g. speculative token trees) goes to the shallow path (the roots through
  the shared-prefix path, those few tokens gathered into a per-sequence suffix, the real
  suffix merged by the decode suffix kernel), other trees to the hybrid schedule where the
  cost model prefers it (``meta.hybrid``); otherwise the cheaper of the
  two schedules by :func:`jax_prefix_attn.tree.schedule_cost` (decided when the metadata is
  built: KV bytes, flops, program waves, partial-state traffic, and the longest single item,
  which is what node-granular schedules lose on unbalanced trees).
* ``"reference"``: gathers each sequence's context and calls ``reference.attention``.
* ``"pallas_interpret"``: the flatten kernel in Pallas interpret mode (CPU tests).
* ``"nodes"`` (benchmark baseline, DeFT-Node analogue): every node one item, one launch.

Off-GPU, ``"auto"``, ``"flatten"``, ``"levelwise"`` and ``"nodes"`` run a pure-JAX mirror of
the same schedule (same metadata, same reduction).  The per-sequence suffix is one more
launch: when decoding (``Tq == 1``), the suffix kernel of the shared path
(``pallas_kernels.suffix_attention``), which merges the tree's partial states in its epilogue
and writes the output in q's layout; otherwise the tree kernel in node mode (split along the
suffix, flash-decoding style), merged with the tree partials in XLA.

Differentiable: gradients (w.r.t. ``q``, pools and suffixes) of the ``"flatten"``,
``"levelwise"``, ``"nodes"``, ``"hybrid"`` and ``"pallas_interpret"`` schedules come from
backward kernels (``BACKWARD = "kernels"``, session 17): the tree part through
:func:`pallas_kernels.tree_attention_bwd.tree_grads` over the flatten schedule's metadata
(whichever schedule ran the forward), the suffix part through
:func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`, both with the merged ``out`` /
``lse`` saved by the forward, so nothing of size rows x keys is materialised (a draft token
tree's suffix part is differentiated through its pure-JAX partial state, as its forward).  The
pure-JAX paths (off the GPU) and ``BACKWARD = "mirror"`` differentiate the pure-JAX mirror of
the flatten schedule instead (recomputed in the backward pass; it materialises the scores of
every work item), and so does grad of grad (the kernel backward has its own ``custom_vjp``
whose backward differentiates the mirror's gradient).  The single-level and shallow paths run
through :func:`jax_prefix_attn.shared_prefix_attention` (its backward kernels) and, on the
shallow path, the decode suffix merge, whose own ``custom_vjp`` runs the suffix part's backward
kernel with the merged statistics (session 16: before it, gradients through the shallow path
failed on the GPU).

Speculative decoding token trees (``draft_parents``): the ``Tq`` queries of a sequence may be
draft tokens forming a tree (the last ``Tq`` suffix tokens); each then sees the shared path,
the committed suffix, and only its ancestors among the drafts (the shared path is still read
once per chunk for every draft of every sequence; the draft-masked suffix part is pure JAX).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import reference
from jax_prefix_attn._validation import (is_concrete, check_array, check_bool, check_gqa, check_impl,
                                         check_lengths, check_sm_scale)
from jax_prefix_attn.tree import (CHUNK, KV_START, LENGTH, NEVER, NTILES, OFF0, POS0, ROW_START, TIN, TOUT,
                                  PrefixTree, Schedule, TreeMetadata, build_tree_metadata)

__all__ = ["tree_attention", "IMPLS", "auto_path"]

IMPLS = ("auto", "levelwise", "flatten", "hybrid", "reference", "pallas_interpret", "hybrid_interpret", "nodes")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# --------------------------------------------------------------------------- validation


def _validate(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, sm_scale, impl):
    check_impl(impl, IMPLS)
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_array("k_pool", k_pool, 3, layout="[pool_tokens, heads_kv, head_dim]")
    check_array("v_pool", v_pool, 3, layout="[pool_tokens, heads_kv, head_dim]")
    check_array("suffix_k", suffix_k, 4, layout="[batch, suffix_len, heads_kv, head_dim]")
    check_array("suffix_v", suffix_v, 4, layout="[batch, suffix_len, heads_kv, head_dim]")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must have the same shape, got {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}")
    if suffix_k.shape != suffix_v.shape:
        raise ValueError(f"suffix_k and suffix_v must have the same shape, got {tuple(suffix_k.shape)} and "
                         f"{tuple(suffix_v.shape)}")
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("suffix_k", suffix_k), ("suffix_v", suffix_v)):
        if x.dtype != k_pool.dtype:
            raise TypeError(f"{name} must have dtype {k_pool.dtype} like k_pool, got {x.dtype}")
    b, tq, hq, d = q.shape
    if k_pool.shape[2] != d or suffix_k.shape[3] != d:
        raise ValueError(f"head_dim must agree: q has {d}, k_pool {k_pool.shape[2]}, suffix_k {suffix_k.shape[3]}")
    if k_pool.shape[1] != suffix_k.shape[2]:
        raise ValueError(f"k_pool and suffix_k must have the same heads_kv, got {k_pool.shape[1]} and "
                         f"{suffix_k.shape[2]}")
    check_gqa(hq, k_pool.shape[1])
    if suffix_k.shape[0] != b:
        raise ValueError(f"suffix_k must have batch {b} (one suffix per sequence, like q), got {suffix_k.shape[0]}")
    if tq < 1:
        raise ValueError(f"q must have at least one query per sequence, got seq_q={tq}")
    check_lengths("suffix_lengths", suffix_lengths, b, suffix_k.shape[1])
    check_sm_scale(sm_scale)
    if isinstance(tree, PrefixTree):
        if tree.num_seqs != b:
            raise ValueError(f"tree attaches {tree.num_seqs} sequences (len(leaf_of_seq)) but q has batch {b}")
        tree.check_pool(k_pool.shape[0])
    elif isinstance(tree, TreeMetadata):
        if tree.num_seqs != b or tree.tq != tq or tree.group != hq // k_pool.shape[1]:
            raise ValueError(f"tree metadata was built for (num_seqs, tq, group) = "
                             f"{(tree.num_seqs, tree.tq, tree.group)}, but the inputs have "
                             f"{(b, tq, hq // k_pool.shape[1])}; rebuild it with build_tree_metadata")
        if tree.pool_size != k_pool.shape[0]:
            raise ValueError(f"tree metadata was built for a pool of {tree.pool_size} tokens, but k_pool has "
                             f"{k_pool.shape[0]}")
    else:
        raise TypeError(f"tree must be a PrefixTree or a TreeMetadata, got {type(tree).__name__}")


def _check_draft_parents(draft_parents, b: int, tq: int, suffix_lengths):
    """Validate ``draft_parents`` (``[Tq]`` or ``[B, Tq]`` ints) and return it as ``[B, Tq]`` int32."""
    if draft_parents is None:
        return None
    if not hasattr(draft_parents, "shape"):
        draft_parents = np.asarray(draft_parents)
    check_array("draft_parents", draft_parents, (1, 2), floating=False, layout="[seq_q] or [batch, seq_q]")
    if draft_parents.shape[-1] != tq or (draft_parents.ndim == 2 and draft_parents.shape[0] != b):
        raise ValueError(f"draft_parents must have shape [{tq}] or [{b}, {tq}], got {tuple(draft_parents.shape)}")
    if is_concrete(draft_parents):
        vals = np.asarray(draft_parents).reshape(-1, tq)
        t = np.arange(tq)[None, :]
        bad = (vals < -1) | (vals >= t)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(f"draft_parents[..., {j}] = {int(vals[i, j])}: a draft's parent must be -1 or an "
                             f"earlier draft in [0, {j})")
    if is_concrete(suffix_lengths) and np.asarray(suffix_lengths).size and np.asarray(suffix_lengths).min() < tq:
        raise ValueError(f"with draft_parents the {tq} draft tokens are the last suffix tokens: suffix_lengths must "
                         f"be >= {tq}, got minimum {int(np.asarray(suffix_lengths).min())}")
    dp = jnp.asarray(draft_parents, jnp.int32)
    return jnp.broadcast_to(dp, (b, tq)) if dp.ndim == 1 else dp


# --------------------------------------------------------------------------- row tables


def _row_tables(meta: TreeMetadata, suffix_lengths):
    """Sorted-order ``(row_key, row_limit)`` per row (``[R_pad]``) and suffix-order limits."""
    b, tq = meta.num_seqs, meta.tq
    n_rows = b * tq
    srow = meta.sorted_rows                                    # [R_pad], n_rows for padding
    real = srow < n_rows
    seq = jnp.where(real, srow // tq, 0)
    t = jnp.where(real, srow % tq, 0)
    s_len = suffix_lengths.astype(jnp.int32)
    limit = meta.seq_path_len[seq] + s_len[seq] - tq + t
    limit = jnp.where(real, limit, -1)
    return meta.row_key, limit


def _q_sorted(q, meta: TreeMetadata, hkv: int):
    """``q [B, Tq, Hq, D]`` -> sorted-row layout ``[Hkv, R_pad * G, D]`` (padding rows zero)."""
    b, tq, hq, d = q.shape
    g = hq // hkv
    rows = q.reshape(b * tq, hkv, g, d)
    rows = jnp.concatenate([rows, jnp.zeros((1, hkv, g, d), q.dtype)], axis=0)
    qs = rows[meta.sorted_rows]                                # [R_pad, Hkv, G, D]
    return jnp.transpose(qs, (1, 0, 2, 3)).reshape(hkv, -1, d)


# --------------------------------------------------------------------------- partials


def _mirror_partials(sched: Schedule, q_hmd, k_nhd, v_nhd, key_m, lim_m, *, group: int, scale: float):
    """Pure-JAX twin of ``pallas_kernels.tree_attention.tree_partials`` (same metadata)."""
    items = sched.items
    c = sched.block_kv
    m = sched.block_rows * group
    hkv, _, d = q_hmd.shape
    n_pool = k_nhd.shape[0]
    hi = jax.lax.Precision.HIGHEST
    mi = items[:, ROW_START][:, None] * group + jnp.arange(m)[None, :]    # [W, M]
    q = q_hmd[:, mi]                                                      # [Hkv, W, M, D]
    key = key_m[mi][..., None]                                            # [W, M, 1]
    lim = lim_m[mi][..., None]
    if sched.mode == "flatten":
        nt = sched.max_tiles
        t = jnp.arange(nt)
        live = t[None, :] < items[:, NTILES][:, None]                      # [W, T]
        chunk = jnp.minimum(items[:, CHUNK][:, None] + t[None, :], sched.tok.shape[0] - 1)
        pos = (sched.chunk_start[chunk][:, :, None] + jnp.arange(c)[None, None, :]).reshape(chunk.shape[0], -1)
        tok = jnp.transpose(sched.tok[chunk], (0, 2, 1, 3)).reshape(chunk.shape[0], 3, -1)   # [W, 3, T*C]
        tok_ok = (tok[:, 0] != NEVER) & jnp.repeat(live, c, axis=1)        # [W, T*C]
        vis = (tok[:, None, 0] <= key) & (key < tok[:, None, 1]) & (tok[:, None, 2] <= lim)
        vis = vis & tok_ok[:, None, :]
    else:
        nt = sched.max_tiles
        t = jnp.arange(nt)
        nominal = items[:, KV_START][:, None] + t[None, :] * c                # [W, T]
        start = jnp.minimum(nominal, n_pool - c)
        pos3 = start[:, :, None] + jnp.arange(c)[None, None, :]            # [W, T, C]
        base = (items[:, KV_START] - items[:, OFF0])[:, None, None]
        off = pos3 - base
        lo = items[:, OFF0][:, None, None] + t[None, :, None] * c
        ok = (off >= lo) & (off < jnp.minimum(lo + c, items[:, LENGTH][:, None, None]))
        ok = ok & (t[None, :, None] < items[:, NTILES][:, None, None])
        pos = pos3.reshape(pos3.shape[0], -1)                              # [W, T*C]
        ok = ok.reshape(ok.shape[0], 1, -1)
        tpos = (items[:, POS0][:, None, None] + off).reshape(off.shape[0], 1, -1)
        node = (items[:, TIN][:, None, None] <= key) & (key < items[:, TOUT][:, None, None])
        vis = node & ok & (tpos <= lim)                                    # [W, M, T*C]
        tok_ok = ok[:, 0]                                                  # [W, T*C]
    k = jnp.where(tok_ok[:, :, None, None], k_nhd[pos], 0)                # [W, K, Hkv, D]
    v = jnp.where(tok_ok[:, :, None, None], v_nhd[pos], 0)                # garbage outside items
    s = jnp.einsum("hwmd,wkhd->hwmk", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
    s = jnp.where(vis[None], s, -jnp.inf)
    mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(vis[None], jnp.exp(s - mx), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o = jnp.einsum("hwmk,wkhd->hwmd", p / l_safe, v.astype(jnp.float32), precision=hi)
    lse = jnp.where(has, mx + jnp.log(l_safe), -jnp.inf)[..., 0]
    return jnp.transpose(o, (1, 0, 2, 3)), jnp.transpose(lse, (1, 0, 2))   # [W, Hkv, M, D], [W, Hkv, M]


def _pad_pool(k_nhd, v_nhd, c: int):
    n = k_nhd.shape[0]
    if n >= c:
        return k_nhd, v_nhd
    pad = ((0, c - n), (0, 0), (0, 0))
    return jnp.pad(k_nhd, pad), jnp.pad(v_nhd, pad)


def _partial_dtype(dtype):
    """Partial outputs are stored in the input dtype when it is 16-bit (half the traffic; they are
    normalised, so this adds about one rounding of the output), float32 otherwise."""
    return jnp.float32 if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(dtype)


def _partials(sched: Schedule, q_hmd, k_nhd, v_nhd, key_m, lim_m, *, group, scale, backend):
    k_nhd, v_nhd = _pad_pool(k_nhd, v_nhd, sched.block_kv)
    pdt = _partial_dtype(q_hmd.dtype)
    if backend == "mirror":
        o, lse = _mirror_partials(sched, q_hmd, k_nhd, v_nhd, key_m, lim_m, group=group, scale=scale)
        return o.astype(pdt), lse
    from pallas_kernels.tree_attention import tree_partials  # noqa: PLC0415
    return tree_partials(q_hmd, k_nhd, v_nhd, sched.items, sched.tok, sched.chunk_start, key_m, lim_m,
                         mode=sched.mode,
                         group=group, block_rows=sched.block_rows, block_kv=sched.block_kv, sm_scale=scale,
                         interpret=(backend == "interpret"), out_dtype=pdt)


def _gather_parts(sched: Schedule, o, lse, group: int):
    """Per original row: ``lse [R, P, Hkv, G]`` and ``o [R, P, Hkv, G, D]`` of its partials."""
    w, hkv, m, d = o.shape
    br = sched.block_rows
    parts = sched.parts                                       # [R, P]
    valid = parts >= 0
    idx = jnp.where(valid, parts, 0)
    wi, si = idx // br, idx % br
    o5 = o.reshape(w, hkv, br, group, d)
    l4 = lse.reshape(w, hkv, br, group)
    og = o5[wi, :, si]                                        # [R, P, Hkv, G, D]
    lg = l4[wi, :, si]                                        # [R, P, Hkv, G]
    lg = jnp.where(valid[..., None, None], lg, -jnp.inf)
    return og, lg


def _suffix_partials(q, suffix_k, suffix_v, suffix_lengths, meta: TreeMetadata, *, scale, backend,
                     block_kv: int):
    """Suffix part: node-mode items (sequence, split) over the flattened suffix pool.

    Returns ``o [B, Tq, S, Hkv, G, D]`` and ``lse [B, Tq, S, Hkv, G]`` (``S`` splits)."""
    b, tq, hq, d = q.shape
    smax, hkv = suffix_k.shape[1], suffix_k.shape[2]
    g = hq // hkv
    c = block_kv
    lo_rows = max(1, -(-16 // g))
    br = 1 << max(0, max(tq, lo_rows) - 1).bit_length()
    tiles = -(-smax // c)
    # Split long suffixes when there are few sequences (flash-decoding): aim for ~4 waves.
    n_split = int(min(tiles, max(1, -(-(4 * 132) // max(1, b * hkv)))))
    tiles_per = -(-tiles // n_split)
    n_split = -(-tiles // tiles_per)
    span = tiles_per * c
    s_len = suffix_lengths.astype(jnp.int32)
    bi = jnp.repeat(jnp.arange(b, dtype=jnp.int32), n_split)
    si = jnp.tile(jnp.arange(n_split, dtype=jnp.int32), b)
    off0 = si * span
    remaining = jnp.maximum(s_len[bi] - off0, 0)
    nt = jnp.minimum(-(-remaining // c), tiles_per)
    z = jnp.zeros_like(bi)
    items = jnp.stack([bi * smax + off0, nt, bi * tq, bi, bi + 1, z, s_len[bi], off0, z], axis=1)
    n_rows = b * tq
    rb = jnp.arange(n_rows + br, dtype=jnp.int32)
    real = rb < n_rows
    seq = jnp.where(real, rb // tq, 0)
    key = jnp.where(real, seq, -1)
    lim = jnp.where(real, s_len[seq] - tq + rb % tq, -1)
    key_m = jnp.repeat(key, g)
    lim_m = jnp.repeat(lim, g)
    qo = jnp.concatenate([q.reshape(n_rows, hkv, g, d), jnp.zeros((br, hkv, g, d), q.dtype)], axis=0)
    q_hmd = jnp.transpose(qo, (1, 0, 2, 3)).reshape(hkv, -1, d)
    sched = Schedule(items=items, tok=jnp.full((1, 3, c), NEVER, jnp.int32), parts=None, mode="node",
                     block_rows=br, block_kv=c, max_tiles=1 << max(0, tiles_per - 1).bit_length(),
                     chunk_start=jnp.zeros((1,), jnp.int32))
    kf = suffix_k.reshape(b * smax, hkv, d)
    vf = suffix_v.reshape(b * smax, hkv, d)
    o, lse = _partials(sched, q_hmd, kf, vf, key_m, lim_m, group=g, scale=scale, backend=backend)
    o = o.reshape(b, n_split, hkv, br, g, d)[:, :, :, :tq]
    lse = lse.reshape(b, n_split, hkv, br, g)[:, :, :, :tq]
    return jnp.transpose(o, (0, 3, 1, 2, 4, 5)), jnp.transpose(lse, (0, 3, 1, 2, 4))


def draft_ancestors(draft_parents_bt, tq: int):
    """``anc [B, Tq, Tq]`` bool: ``anc[b, t, u]`` iff draft token ``u`` is ``t`` or an ancestor of ``t``
    (parents ``-1`` attach to the committed context).  Pointer closure by repeated squaring."""
    par = draft_parents_bt.astype(jnp.int32)
    u = jnp.arange(tq)
    a = (u[None, None, :] == u[None, :, None]) | (u[None, None, :] == par[:, :, None])
    a = a.astype(jnp.float32)
    for _ in range(max(1, (tq - 1).bit_length())):
        a = jnp.minimum(a + jnp.einsum("btu,buv->btv", a, a), 1.0)
    return a > 0


def _masked_attention(q_bthd, k_bshd, v_bshd, mask_bts, scale: float):
    """Exact attention with an explicit visibility mask ``[B, Tq, S]`` (float32 math, reference rules:
    ``lse=-inf``, ``out=0`` where nothing is visible)."""
    b, tq, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    hi = jax.lax.Precision.HIGHEST
    qf = q_bthd.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    vis = mask_bts[:, None, None]                                          # [B, 1, 1, Tq, S]
    kf = jnp.where(jnp.any(mask_bts, axis=1)[:, :, None, None], k_bshd.astype(jnp.float32), 0.0)
    vf = jnp.where(jnp.any(mask_bts, axis=1)[:, :, None, None], v_bshd.astype(jnp.float32), 0.0)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=hi) * scale
    s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / l_safe, vf, precision=hi)      # [B, Tq, Hkv, G, D]
    lse = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)[..., 0]           # [B, Hkv, G, Tq]
    return o, jnp.transpose(lse, (0, 3, 1, 2))


def _draft_suffix_partials(q, suffix_k, suffix_v, suffix_lengths, draft_anc, scale: float):
    """Suffix part when the ``Tq`` queries form a draft token tree (the last ``Tq`` suffix tokens):
    query ``t`` sees committed suffix tokens ``j < S_b - Tq`` and draft tokens on its own branch."""
    b, tq = q.shape[:2]
    smax = suffix_k.shape[1]
    s_len = suffix_lengths.astype(jnp.int32)[:, None, None]
    j = jnp.arange(smax)[None, None, :]
    first = s_len - tq                                                     # first draft position
    du = jnp.clip(j - first, 0, tq - 1)                                    # [B, 1, S]
    on_branch = jnp.take_along_axis(draft_anc, jnp.broadcast_to(du, (b, tq, smax)), axis=2)
    mask = (j < s_len) & ((j < first) | on_branch)
    o, lse = _masked_attention(q, suffix_k, suffix_v, mask, scale)
    return o[:, :, None], lse[:, :, None]


def _merge(parts_o, parts_l):
    """Merge lists of ``o [..., P, Hkv, G, D]`` / ``lse [..., P, Hkv, G]`` over every P axis."""
    m = None
    for l in parts_l:
        mm = jnp.max(l, axis=-3)
        m = mm if m is None else jnp.maximum(m, mm)
    m = jax.lax.stop_gradient(m)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total, acc = 0.0, 0.0
    for o, l in zip(parts_o, parts_l):
        w = jnp.exp(l - m[..., None, :, :])
        w = jnp.where(l == -jnp.inf, 0.0, w)
        total = total + jnp.sum(w, axis=-3)
        o = jnp.where((w > 0)[..., None], o.astype(jnp.float32), 0.0)
        acc = acc + jnp.sum(w[..., None] * o, axis=-4)
    has = total > 0
    t_safe = jnp.where(has, total, 1.0)
    return acc / t_safe[..., None], jnp.where(has, m + jnp.log(t_safe), -jnp.inf)


def _forward(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents=None, *,
             scale: float, schedule: str, backend: str):
    if schedule == "hybrid":
        return _hybrid(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale=scale, backend=backend)
    b, tq, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    key, lim = _row_tables(meta, suffix_lengths)
    key_m = jnp.repeat(key, g)
    lim_m = jnp.repeat(lim, g)
    q_hmd = _q_sorted(q, meta, hkv)
    if schedule == "flatten":
        scheds = [meta.flatten]
    elif schedule == "nodes":
        scheds = [meta.nodes]
    else:
        scheds = list(meta.levels)
    parts_o, parts_l = [], []
    for sc in scheds:
        o, lse = _partials(sc, q_hmd, k_pool, v_pool, key_m, lim_m, group=g, scale=scale, backend=backend)
        og, lg = _gather_parts(sc, o, lse, g)
        parts_o.append(og.reshape(b, tq, *og.shape[1:]))
        parts_l.append(lg.reshape(b, tq, *lg.shape[1:]))
    if draft_parents is not None:
        so, sl = _draft_suffix_partials(q, suffix_k, suffix_v, suffix_lengths,
                                        draft_ancestors(draft_parents, tq), scale)
        parts_o.append(so)
        parts_l.append(sl)
    elif suffix_k.shape[1] > 0 and tq == 1 and backend in ("pallas", "interpret") and d >= 16 \
            and not d & (d - 1):
        # Decoding: the tree's partials are merged here (XLA), then one suffix launch attends
        # each sequence's suffix and merges that state in its epilogue, writing the output in
        # q's layout (pallas_kernels.suffix_attention).
        o_t, l_t = _merge(parts_o, parts_l)                    # [B, 1, Hkv, G, D], [B, 1, Hkv, G]
        return _decode_suffix_merging(q, o_t.astype(_partial_dtype(q.dtype)), l_t, suffix_k,
                                      suffix_v, suffix_lengths, scale=scale,
                                      interpret=backend == "interpret")
    elif suffix_k.shape[1] > 0:
        so, sl = _suffix_partials(q, suffix_k, suffix_v, suffix_lengths, meta, scale=scale, backend=backend,
                                  block_kv=meta.flatten.block_kv)
        parts_o.append(so)
        parts_l.append(sl)
    out, lse = _merge(parts_o, parts_l)                        # [B, Tq, Hkv, G, D], [B, Tq, Hkv, G]
    return out.reshape(b, tq, hq, d).astype(q.dtype), lse.reshape(b, tq, hq)


def _single_level(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                  impl: str):
    """Every sequence hangs from a root: ``shared_prefix_attention`` with one prefix group per root
    (the roots' spans gathered into ``[G, root_pad, Hkv, D]``; a copy of the shared tokens only)."""
    from jax_prefix_attn.shared_prefix import shared_prefix_attention  # noqa: PLC0415
    pk, pv = _root_spans(meta, k_pool, v_pool)
    return shared_prefix_attention(q, pk, pv, suffix_k, suffix_v, suffix_lengths=suffix_lengths,
                                   prefix_lengths=meta.root_span[:, 1], seq_to_prefix=meta.seq_root,
                                   sm_scale=scale, return_lse=True, impl=impl)


def _root_spans(meta: TreeMetadata, k_pool, v_pool):
    """The roots' spans gathered into ``[G, root_pad, Hkv, D]`` (zeros past each root's length)."""
    start, length = meta.root_span[:, 0], meta.root_span[:, 1]
    idx = jnp.minimum(start[:, None] + jnp.arange(meta.root_pad)[None, :], k_pool.shape[0] - 1)  # [G, P]
    valid = (jnp.arange(meta.root_pad)[None, :] < length[:, None])[..., None, None]
    return jnp.where(valid, k_pool[idx], 0), jnp.where(valid, v_pool[idx], 0)


def _as_incoming(o, lse, hq: int, hkv: int):
    """A normalised state ``o [B, ..., Hq, D]`` / ``lse [B, ..., Hq]`` (one query per sequence, any
    head grouping) in the layout the decode suffix kernel merges: ``([1, Hkv, B * G + pad, D],
    [1, Hkv, B * G + pad], stride G)``, padded because the kernel reads whole row tiles past the
    last sequence."""
    from pallas_kernels.suffix_attention import suffix_rows  # noqa: PLC0415
    b, d = o.shape[0], o.shape[-1]
    g = hq // hkv
    pad = suffix_rows(hq, hkv) - g
    o_in = jnp.transpose(o.reshape(b, hkv, g, d), (1, 0, 2, 3)).reshape(1, hkv, b * g, d)
    l_in = jnp.transpose(lse.reshape(b, hkv, g), (1, 0, 2)).reshape(1, hkv, b * g)
    return (jnp.pad(o_in, ((0, 0), (0, 0), (0, pad), (0, 0))),
            jnp.pad(l_in, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf), g)


def _shallow(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *, scale: float,
             impl: str, interpret: bool = False):
    """Shallow trees (``meta.shallow_pad > 0``), decoding (``Tq == 1``): the roots through
    shared-prefix attention with each sequence's few path tokens below its root gathered into a
    per-sequence suffix ``[B, shallow_pad, Hkv, D]``; then, when there is a suffix, the decode
    suffix kernel attends it and merges that state in its epilogue.  With one query per sequence
    every key is visible, so the order of the keys does not matter."""
    idx, n = meta.shallow_idx, meta.shallow_len
    valid = (jnp.arange(meta.shallow_pad)[None, :] < n[:, None])[..., None, None]
    nk = jnp.where(valid, k_pool[idx], 0)
    nv = jnp.where(valid, v_pool[idx], 0)
    out, lse = _single_level(q, meta, k_pool, v_pool, nk, nv, n, scale=scale, impl=impl)
    if suffix_k.shape[1] == 0:
        return out, lse
    return _decode_suffix_merging(q, out, lse, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                  interpret=interpret)


def _decode_suffix_merging(q, o, lse, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                           interpret: bool):
    """``Tq == 1``: attend each sequence's suffix and merge the state ``(o, lse)`` (normalised,
    ``[B, 1, Hq(, D)]`` in any head grouping ``Hkv x G``) in the decode suffix kernel's epilogue
    (``pallas_kernels.suffix_attention``).  Returns ``(out [B, 1, Hq, D] in q's dtype,
    lse [B, 1, Hq])``.  Differentiable (:func:`_suffix_merge_bwd`: the suffix part through the
    backward kernels with the merged statistics, the incoming state through the merge's
    weights), so the paths that end in it (shallow trees) have gradients on the GPU too."""
    return _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, float(scale),
                         bool(interpret))


def _part_cotangents(o_part, l_part, out, lse, d_out, d_lse):
    """Cotangents of one part ``(o_part, l_part)`` of a merged state ``(out, lse)`` (same shapes,
    ``D`` last; float32): with ``w = exp(l_part - lse)``, ``d o_part = w d_out`` and
    ``d l_part = w (<d_out, o_part - out> + d_lse)`` (``w = 0`` where the part saw nothing)."""
    f32 = jnp.float32
    lse = lse.astype(f32)
    w = jnp.where(jnp.isfinite(l_part), jnp.exp(l_part - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    d_out = d_out.astype(f32)
    d_l = w * (jnp.sum(d_out * (o_part.astype(f32) - out.astype(f32)), axis=-1) + d_lse.astype(f32))
    return w[..., None] * d_out, d_l


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret):
    return _suffix_merge_kernel(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                interpret=interpret)


def _suffix_merge_fwd(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret):
    out, lse_out = _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret)
    return (out, lse_out), (q, o, lse, suffix_k, suffix_v, suffix_lengths, out, lse_out)


def _suffix_merge_bwd(scale, interpret, res, cts):
    """With ``lse_out = log(e^lse + e^l_s)`` and ``out = w o + (1 - w) o_s``, ``w = e^(lse -
    lse_out)``: ``d o = w dout``, ``d lse = w (<dout, o - out> + dlse_out)``; the suffix part is
    a flash backward with the merged statistics (``delta = <dout, out> - dlse_out``)."""
    from pallas_kernels.suffix_attention_bwd import suffix_part_grads  # noqa: PLC0415
    q, o, lse, suffix_k, suffix_v, suffix_lengths, out, lse_out = res
    d_out, d_lse_out = cts
    b, _, hq, d = q.shape
    f32 = jnp.float32
    o_b = o.reshape(b, 1, hq, d).astype(f32)
    l_b = lse.reshape(b, 1, hq).astype(f32)
    dout, dlo = d_out.astype(f32), d_lse_out.astype(f32)
    d_o, d_l = _part_cotangents(o_b, l_b, out, lse_out, dout, dlo)         # [B, 1, Hq(, D)]
    d_o = d_o.reshape(o.shape).astype(o.dtype)
    d_l = d_l.reshape(lse.shape)
    delta = jnp.sum(dout * out.astype(f32), axis=-1) - dlo
    dq, dk, dv = suffix_part_grads(q, dout.astype(q.dtype), lse_out, delta, suffix_k, suffix_v,
                                   suffix_lengths, scale=scale, interpret=interpret)
    f0 = np.zeros(np.shape(suffix_lengths), jax.dtypes.float0)
    return dq, d_o, d_l.astype(lse.dtype), dk, dv, f0


_suffix_merge.defvjp(_suffix_merge_fwd, _suffix_merge_bwd)


def _suffix_merge_kernel(q, o, lse, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                         interpret: bool):
    from pallas_kernels.suffix_attention import suffix_decode_merge  # noqa: PLC0415
    o_in, l_in, g = _as_incoming(o, lse, q.shape[2], suffix_k.shape[2])
    out, lse = suffix_decode_merge(q[:, 0].astype(suffix_k.dtype), suffix_k, suffix_v, suffix_lengths,
                                   (o_in, l_in), in_stride=g, scale=scale, interpret=interpret)
    return out[:, None].astype(q.dtype), lse[:, None]


def _hybrid(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *, scale: float,
            backend: str):
    """Hybrid decode schedule (``Tq == 1``; ``meta.excl_span`` built), at most three launches:

    1. the root (``meta.hybrid_root``: one root read by several sequences) through the shared
       path's prefix kernel (``pallas_kernels.prefix_attention.decode_prefix_partials``: every
       sequence's query heads as the rows of one matrix product per kv head, the Mosaic GPU
       kernel on a Hopper GPU), its span gathered to a ``root_pad`` bucket (a copy of the
       root only);
    2. the other shared nodes (``meta.mid``, node or flatten mode, whichever the cost model
       prefers) through the tree kernel, their partials merged per sequence in XLA;
    3. the decode suffix kernel: each sequence streams the node only it reads (``excl_span``,
       in place in the pool, e.g. a tree-of-thought leaf) and its own suffix in one online
       softmax, and merges the partial states of 1 and 2 in its epilogue.

    With one query per sequence every key is visible, so the order of the keys does not matter.
    Returns ``(out [B, 1, Hq, D] in q's dtype, lse [B, 1, Hq])``."""
    from pallas_kernels.prefix_attention import DECODE_SUFFIX_TILING, decode_prefix_partials  # noqa: PLC0415
    from pallas_kernels.suffix_attention import suffix_decode_merge  # noqa: PLC0415
    hq = q.shape[2]
    hkv = k_pool.shape[1]
    g = hq // hkv
    interpret = backend == "interpret"
    kdt = k_pool.dtype
    q1 = q[:, 0].astype(kdt)
    sources = []
    if meta.hybrid_root:
        pk, pv = _root_spans(meta, k_pool, v_pool)
        o_r, l_r, stride = decode_prefix_partials(q1, pk[0], pv[0], meta.root_span[0, 1], scale=scale,
                                                  interpret=interpret)
        sources.append((o_r, l_r, stride, None))
    if meta.mid is not None:
        key, lim = _row_tables(meta, suffix_lengths)
        o, lse = _partials(meta.mid, _q_sorted(q1[:, None], meta, hkv), k_pool, v_pool, jnp.repeat(key, g),
                           jnp.repeat(lim, g), group=g, scale=scale, backend=backend)
        og, lg = _gather_parts(meta.mid, o, lse, g)           # [B, P, Hkv, G, D], [B, P, Hkv, G]
        o_m, l_m = _merge([og], [lg])                          # [B, Hkv, G, D], [B, Hkv, G]
        sources.append(_as_incoming(o_m.astype(_partial_dtype(kdt)), l_m, hq, hkv) + (None,))
    span = (k_pool, v_pool, meta.excl_span[:, 0], meta.excl_span[:, 1])
    out, lse = suffix_decode_merge(q1, suffix_k, suffix_v, suffix_lengths.astype(jnp.int32), sources, span=span,
                                   scale=scale, interpret=interpret, **DECODE_SUFFIX_TILING)
    return out[:, None].astype(q.dtype), lse[:, None]


def _use_shallow(meta: TreeMetadata, q) -> bool:
    d = q.shape[-1]
    return (meta.shallow_pad > 0 and meta.tq == 1 and q.shape[1] == 1 and d >= 16 and not d & (d - 1)
            and q.dtype in (jnp.float32, jnp.bfloat16, jnp.float16))


def _hybrid_ok(meta: TreeMetadata, q) -> str | None:
    """``None`` when the hybrid schedule can run, else why not."""
    d = q.shape[-1]
    if meta.excl_span is None or q.shape[1] != 1:
        return f"it decodes one query per sequence (seq_q == 1), got seq_q={q.shape[1]}"
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype must be float32, bfloat16 or float16, got {q.dtype}"
    return None


def _use_single_level(meta: TreeMetadata, q, suffix_k) -> bool:
    d = q.shape[-1]
    return (meta.single_level and suffix_k.shape[1] > 0 and d >= 16 and not d & (d - 1)
            and q.dtype in (jnp.float32, jnp.bfloat16, jnp.float16))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _tree_attn(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
               backend):
    return _forward(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale=scale,
                    schedule=schedule, backend=backend)


def _tree_attn_fwd(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
                   backend):
    out = _tree_attn(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
                     backend)
    res = (q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out)
    return out, res


# Gradients of the Pallas paths: "kernels" (default) runs the flatten schedule's backward kernels
# (pallas_kernels.tree_attention_bwd) and the suffix part's with the merged statistics (a draft
# token tree's suffix part: autodiff of its pure-JAX partial state, as its forward);
# "mirror" differentiates the pure-JAX mirror of the flatten schedule (which materialises the
# scores of every work item).  The pure-JAX paths (backend "mirror", off the GPU) always take
# the mirror.
BACKWARD = "kernels"


def _tree_attn_bwd(scale, schedule, backend, res, cts):
    q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, (out, lse) = res
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    zero_meta = jax.tree_util.tree_map(f0, meta)
    zero_dp = None if draft_parents is None else f0(draft_parents)
    if BACKWARD not in ("kernels", "mirror"):
        raise ValueError(f"BACKWARD must be 'kernels' or 'mirror', got {BACKWARD!r}")
    if BACKWARD == "kernels" and backend in ("pallas", "interpret"):
        d_out, d_lse = cts
        dq, dkp, dvp, dks, dvs = _grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                                                    draft_parents, out, lse, d_out, d_lse, scale,
                                                    backend == "interpret")
    else:
        dq, dkp, dvp, dks, dvs = _mirror_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                                               draft_parents, cts, scale)
    return dq, zero_meta, dkp, dvp, dks, dvs, f0(suffix_lengths), zero_dp


def _mirror_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, cts, scale):
    """Autodiff of the pure-JAX mirror of the flatten schedule (differentiable again)."""
    def f(q, k_pool, v_pool, suffix_k, suffix_v):
        return _forward(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale=scale,
                        schedule="flatten", backend="mirror")

    _, vjp = jax.vjp(f, q, k_pool, v_pool, suffix_k, suffix_v)
    return vjp(tuple(cts))


def _kernel_grads(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out,
                  lse, d_out, d_lse, *, scale: float, interpret: bool):
    """Gradients through the backward kernels: the tree part by the flatten schedule's
    (:func:`pallas_kernels.tree_attention_bwd.tree_grads`, whatever schedule ran the forward),
    the suffix part by :func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`, both with
    the merged ``out``/``lse``; ``dq`` is the sum of the two parts'."""
    from pallas_kernels.suffix_attention_bwd import suffix_part_grads  # noqa: PLC0415
    from pallas_kernels.tree_attention_bwd import tree_grads  # noqa: PLC0415
    b, tq, hq, d = q.shape
    n, hkv = k_pool.shape[:2]
    g = hq // hkv
    f32 = jnp.float32
    lse = lse.astype(f32)
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1) - d_lse.astype(f32)   # [B, Tq, Hq]
    d_out = d_out.astype(q.dtype)
    sched = meta.flatten
    key, lim = _row_tables(meta, suffix_lengths)
    stat = lambda x: _q_sorted(x[..., None], meta, hkv)[..., 0]  # noqa: E731  [Hkv, R_pad * G]
    kp, vp = _pad_pool(k_pool, v_pool, sched.block_kv)
    dq, dk, dv = tree_grads(_q_sorted(q, meta, hkv), _q_sorted(d_out, meta, hkv), stat(lse), stat(delta), kp, vp,
                            sched.items, sched.tok, sched.chunk_start, sched.parts, jnp.repeat(key, g),
                            jnp.repeat(lim, g), group=g, block_rows=sched.block_rows, block_kv=sched.block_kv,
                            sm_scale=scale, interpret=interpret, disjoint=not meta.spans_overlap)
    dq = dq.reshape(b, tq, hq, d)                                               # (original row order)
    if draft_parents is not None:
        # the draft-masked suffix part (pure JAX, as its forward), through its partial state's
        # cotangents under the merge
        def part(q_, sk, sv):
            o, l = _draft_suffix_partials(q_, sk, sv, suffix_lengths, draft_ancestors(draft_parents, tq), scale)
            return o[:, :, 0], l[:, :, 0]                                # [B, Tq, Hkv, G(, D)]
        (o_s, l_s), vjp = jax.vjp(part, q, suffix_k, suffix_v)
        shp = (b, tq, hkv, g)
        d_o, d_l = _part_cotangents(o_s, l_s, out.reshape(shp + (d,)), lse.reshape(shp),
                                    d_out.reshape(shp + (d,)), d_lse.reshape(shp))
        dq_x, dks, dvs = vjp((d_o.astype(o_s.dtype), d_l))
        dq = dq + dq_x.astype(f32)
    elif suffix_k.shape[1] > 0:
        dq_x, dks, dvs = suffix_part_grads(q, d_out, lse, delta, suffix_k, suffix_v, suffix_lengths,
                                           scale=scale, interpret=interpret)
        dq = dq + dq_x.astype(f32)
    else:
        dks, dvs = jnp.zeros_like(suffix_k), jnp.zeros_like(suffix_v)
    return (dq.astype(q.dtype), dk[:n].astype(k_pool.dtype), dv[:n].astype(v_pool.dtype),
            dks.astype(suffix_k.dtype), dvs.astype(suffix_v.dtype))


# First-order gradients through the kernels; differentiating them again (grad of grad) goes
# through the mirror's autodiff, which the Pallas kernels have no rule for.
@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13))
def _grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out,
                       d_lse, scale, interpret):
    return _kernel_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse,
                         d_out, d_lse, scale=scale, interpret=interpret)


def _grads_via_kernels_fwd(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse,
                           d_out, d_lse, scale, interpret):
    grads = _grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out,
                               lse, d_out, d_lse, scale, interpret)
    return grads, (q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out,
                   d_lse)


def _grads_via_kernels_bwd(scale, interpret, res, cts):
    q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out, d_lse = res
    # (out and lse are functions of the inputs: the mirror recomputes them, so their own
    # cotangents are zero and the inputs' carry the whole second-order term)
    _, vjp = jax.vjp(lambda q_, kp, vp, sk, sv, do, dl: _mirror_grads(
        q_, meta, kp, vp, sk, sv, suffix_lengths, draft_parents, (do, dl), scale),
        q, k_pool, v_pool, suffix_k, suffix_v, d_out, d_lse)
    dq, dkp, dvp, dks, dvs, dd_out, dd_lse = vjp(tuple(cts))
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return (dq, jax.tree_util.tree_map(f0, meta), dkp, dvp, dks, dvs, f0(suffix_lengths),
            None if draft_parents is None else f0(draft_parents),
            jnp.zeros_like(out), jnp.zeros_like(lse), dd_out, dd_lse)


_grads_via_kernels.defvjp(_grads_via_kernels_fwd, _grads_via_kernels_bwd)


_tree_attn.defvjp(_tree_attn_fwd, _tree_attn_bwd)


def auto_path(meta: TreeMetadata, q, suffix_k, *, draft_parents=None) -> str:
    """What ``impl="auto"`` runs for these (static) shapes: ``"single_level"``, ``"hybrid"``,
    ``"shallow"``, ``"levelwise"`` or ``"flatten"``.

    Off the GPU: ``meta.preferred`` (the pure-JAX mirror of that schedule).  On the GPU, in order:
    a single-level forest with a suffix axis goes to the shared-prefix path; when decoding, a
    shallow forest to the shallow path (H200, ``bench/results/tree_attention_h200.json``: on
    speculative trees of 32 / 64 / 256 drafts the hybrid schedule took 1.12x / 0.92x / 1.06x its
    time), else the hybrid schedule where the cost model prefers it
    (``meta.hybrid``); then ``meta.preferred``."""
    if not _on_gpu() or draft_parents is not None:
        return meta.preferred
    if _use_single_level(meta, q, suffix_k):
        return "single_level"
    if _use_shallow(meta, q):
        return "shallow"
    if meta.hybrid and _hybrid_ok(meta, q) is None:
        return "hybrid"
    return meta.preferred


def _reference_impl(q, tree: PrefixTree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale,
                    draft_parents=None):
    """Gather every sequence's context (path spans then suffix) and call the oracle."""
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
    o, lse = _masked_attention(q, k, v, mask, scale)
    return o.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[:3])


def tree_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, *, suffix_lengths, sm_scale=None,
                   return_lse: bool = False, impl: str = "auto", draft_parents=None):
    """Exact attention of a batch of sequences whose shared prefixes form a forest.

    Args:
      q: queries ``[B, Tq, Hq, D]``; the ``Tq`` queries of sequence ``b`` are the last ``Tq``
        tokens of its context.
      tree: a :class:`~jax_prefix_attn.tree.PrefixTree` with ``B`` sequences (metadata is built
        and cached on the host; pass it as a static / closed-over value under ``jit``), or a
        :class:`~jax_prefix_attn.tree.TreeMetadata` from ``build_tree_metadata`` (a pytree:
        pass it as a ``jit`` argument).
      k_pool, v_pool: flat shared KV pool ``[N_tokens, Hkv, D]`` holding every node's span.
      suffix_k, suffix_v: per-sequence suffixes ``[B, S_max, Hkv, D]`` (``S_max`` may be 0).
      suffix_lengths: int ``[B]`` valid suffix tokens (dynamic: no rebuild when they grow).
      sm_scale: score scale, default ``1/sqrt(D)``.
      return_lse: also return ``lse [B, Tq, Hq]`` (float32, natural log).
      impl: ``"auto"``, ``"levelwise"``, ``"flatten"``, ``"hybrid"`` (decoding only),
        ``"reference"``, ``"pallas_interpret"``, ``"hybrid_interpret"`` (or ``"nodes"``, the
        DeFT-Node baseline); see module doc.
      draft_parents: optional int ``[Tq]`` or ``[B, Tq]`` (speculative decoding token trees):
        the ``Tq`` queries are draft tokens forming a tree, stored as the last ``Tq`` suffix
        tokens (``suffix_lengths >= Tq``); ``draft_parents[t]`` is the parent draft (``< t``)
        or ``-1`` (child of the committed context).  Query ``t`` then sees the shared path, the
        committed suffix and only its own ancestors among the drafts (and itself) instead of
        the causal rule.  The suffix part of this mode is computed in pure JAX (no kernel).

    Returns:
      ``out [B, Tq, Hq, D]`` in ``q``'s dtype (and ``lse`` if ``return_lse``).  Semantics:
      ``reference.attention(q, ctx_k, ctx_v, causal=True, kv_lengths=path_len + suffix_lengths)``
      with ``ctx`` each sequence's concatenated path spans followed by its suffix.
    """
    _validate(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, sm_scale, impl)
    check_bool("return_lse", return_lse)
    draft_parents = _check_draft_parents(draft_parents, q.shape[0], q.shape[1], suffix_lengths)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if impl == "reference":
        if not isinstance(tree, PrefixTree):
            raise TypeError("impl='reference' needs a PrefixTree (it gathers the paths on the host), "
                            "got TreeMetadata")
        out, lse = _reference_impl(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale,
                                   draft_parents)
        return (out, lse) if return_lse else out
    if isinstance(tree, PrefixTree):
        meta = build_tree_metadata(tree, tq=q.shape[1], group=q.shape[2] // k_pool.shape[1],
                                   pool_size=k_pool.shape[0], device=False)  # host arrays: jit constants
    else:
        meta = tree
    meta = jax.tree_util.tree_map(jnp.asarray, meta)
    if impl in ("hybrid", "hybrid_interpret"):
        why = _hybrid_ok(meta, q) or ("it does not take draft_parents" if draft_parents is not None else None)
        if why is not None:
            raise ValueError(f"impl={impl!r} cannot run these inputs: {why}")
        if impl == "hybrid" and not _on_gpu():
            raise ValueError("impl='hybrid' runs Pallas GPU kernels and needs a GPU; use "
                             "impl='hybrid_interpret' on the CPU")
    if impl == "auto":
        impl = auto_path(meta, q, suffix_k, draft_parents=draft_parents)
    if impl == "single_level":
        out, lse = _single_level(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                 impl="auto")
        return (out, lse) if return_lse else out
    if impl == "shallow":
        out, lse = _shallow(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale=scale,
                            impl="auto")
        return (out, lse) if return_lse else out
    if impl == "pallas_interpret":
        schedule, backend = "flatten", "interpret"
    elif impl == "hybrid_interpret":
        schedule, backend = "hybrid", "interpret"
    else:
        schedule = impl
        backend = "pallas" if _on_gpu() else "mirror"
    out, lse = _tree_attn(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale,
                          schedule, backend)
    return (out, lse) if return_lse else out
