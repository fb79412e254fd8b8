"""Forward paths of tree attention: the schedules, the single-level and shallow paths and the
hybrid decode schedule.

``backend`` (static) says how the tree kernel runs: ``"pallas"`` (compiled Pallas GPU kernels),
``"interpret"`` (the same kernels in Pallas interpret mode) or ``"mirror"`` (the pure-JAX
mirror, :mod:`jax_prefix_attn.tree_mirror`).  Every path returns ``(out [B, Tq, Hq, D] in q's
dtype, lse [B, Tq, Hq] float32)``.

* :func:`schedule_forward` with ``"flatten"`` / ``"levelwise"`` / ``"nodes"``: the tree part
  as partial states of one launch per schedule (per depth for level-wise), gathered and merged
  per row in XLA.  The per-sequence suffix is one more launch: when decoding, the decode suffix
  kernel, which merges the tree's state in its epilogue
  (:func:`jax_prefix_attn.tree_suffix_merge.decode_suffix_merging`); otherwise the tree kernel
  in node mode over the suffixes (items of at most :data:`SUFFIX_MAX_BLOCK_M` query vectors,
  split along the suffix flash-decoding style), merged with the tree partials in XLA.  Every
  kernel launch gets the device's shared memory per CTA (:func:`kernel_smem_bytes`) and picks
  program tiles that fit it (:mod:`pallas_kernels.tree_attention_tiles`).
* :func:`hybrid_attention` (decoding): at most three launches, see its docstring.
* :func:`single_level_attention`, :func:`shallow_attention`: through
  :func:`jax_prefix_attn.shared_prefix_attention` with one prefix group per root.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax.numpy as jnp

from jax_prefix_attn.device import SMEM_PER_BLOCK, planning_device_info
from jax_prefix_attn.executor import decode_prefix_partials
from jax_prefix_attn.leaves.base import decode_suffix_tiling
from jax_prefix_attn.shared_prefix import shared_prefix_attention
from jax_prefix_attn.tree_drafts import draft_ancestors, draft_suffix_partials
from jax_prefix_attn.tree_layout import gather_parts, merge_states, pad_pool, partial_dtype, q_sorted, row_tables
from jax_prefix_attn.tree_metadata import TreeMetadata
from jax_prefix_attn.tree_mirror import mirror_partials
from jax_prefix_attn.tree_plan import tree_leaf
from jax_prefix_attn.tree_schedule import Schedule, next_pow2
from jax_prefix_attn.tree_suffix_merge import as_incoming, decode_suffix_merging
from pallas_kernels.suffix_attention import suffix_decode_merge
from pallas_kernels.tree_attention import NEVER, tree_partials

__all__ = ["partials", "kernel_smem_bytes", "suffix_partials", "schedule_forward", "root_spans",
           "single_level_attention", "shallow_attention", "hybrid_attention", "SUFFIX_MAX_BLOCK_M"]

# Query vectors per item of the suffix launch (the schedules' default ``max_block_m``): a
# sequence's rows beyond it go to more items, so the launch's tiles do not grow with ``Tq``.
SUFFIX_MAX_BLOCK_M = 128


def partials(sched: Schedule, q_hmd, k_nhd, v_nhd, key_m, lim_m, *, group, scale, backend,
             kernel_options: Mapping | None = None):
    """Partial states ``(o [W, Hkv, M, D], lse [W, Hkv, M])`` of one schedule's launch (sorted
    layouts of :mod:`jax_prefix_attn.tree_layout`); ``o`` in :func:`partial_dtype`.
    ``kernel_options`` (``num_warps``, ``num_stages``) go to the compiled kernel."""
    k_nhd, v_nhd = pad_pool(k_nhd, v_nhd, sched.block_kv)
    pdt = partial_dtype(q_hmd.dtype)
    if backend == "mirror":
        o, lse = mirror_partials(sched, q_hmd, k_nhd, v_nhd, key_m, lim_m, group=group, scale=scale)
        return o.astype(pdt), lse
    return tree_partials(q_hmd, k_nhd, v_nhd, sched.items, sched.tok, sched.chunk_start, key_m, lim_m,
                         mode=sched.mode, group=group, block_rows=sched.block_rows, block_kv=sched.block_kv,
                         sm_scale=scale, interpret=(backend == "interpret"), out_dtype=pdt,
                         smem_bytes=kernel_smem_bytes(), **dict(kernel_options or {}))


def kernel_smem_bytes() -> int:
    """Shared memory (bytes) one program of the tree kernels may allocate: the planning device's
    ``smem_per_block`` (:func:`jax_prefix_attn.device.planning_device_info`: an H100's off the
    GPU, so interpret mode runs the GPU's tiles), or the smallest of
    :data:`~jax_prefix_attn.device.SMEM_PER_BLOCK` on a GPU whose compute capability that table
    does not list.  The kernels pick their program tiles under it
    (:mod:`pallas_kernels.tree_attention_tiles`)."""
    return planning_device_info().smem_per_block or min(SMEM_PER_BLOCK.values())


def suffix_partials(q, suffix_k, suffix_v, suffix_lengths, meta: TreeMetadata, *, scale, backend,
                    block_kv: int):
    """Suffix part: node-mode items (sequence, block of its query rows, split of its suffix) over
    the flattened suffix pool.  A sequence's ``Tq`` rows are cut in blocks of at most
    :data:`SUFFIX_MAX_BLOCK_M` query vectors (whatever ``Tq``), and each item stops at the last
    key tile its rows may see (bottom-right causal rule), so long suffixes cost about half the
    tiles of the full square.

    Returns ``o [B, Tq, S, Hkv, G, D]`` and ``lse [B, Tq, S, Hkv, G]`` (``S`` splits)."""
    b, tq, hq, d = q.shape
    smax, hkv = suffix_k.shape[1], suffix_k.shape[2]
    g = hq // hkv
    c = block_kv
    lo_rows = max(1, -(-16 // g))
    br = min(next_pow2(max(tq, lo_rows)), max(lo_rows, SUFFIX_MAX_BLOCK_M // g))   # rows per item
    n_rb = -(-tq // br)
    tiles = -(-smax // c)
    # Split long suffixes when there are few programs (flash-decoding): aim for ~4 waves of
    # programs over the device's SMs.
    n_split = int(min(tiles, max(1, -(-(4 * planning_device_info().sm_count) // max(1, b * hkv * n_rb)))))
    tiles_per = -(-tiles // n_split)
    n_split = -(-tiles // tiles_per)
    span = tiles_per * c
    s_len = suffix_lengths.astype(jnp.int32)
    per_seq = n_rb * n_split
    bi = jnp.repeat(jnp.arange(b, dtype=jnp.int32), per_seq)                  # items (sequence, block, split)
    ri = jnp.tile(jnp.repeat(jnp.arange(n_rb, dtype=jnp.int32), n_split), b)
    si = jnp.tile(jnp.arange(n_split, dtype=jnp.int32), b * n_rb)
    off0 = si * span
    # keys the block's last row sees: suffix positions j <= s_len - Tq + t
    seen = jnp.clip(s_len[bi] - tq + jnp.minimum((ri + 1) * br, tq), 0, s_len[bi])
    remaining = jnp.maximum(seen - off0, 0)
    nt = jnp.minimum(-(-remaining // c), tiles_per)
    z = jnp.zeros_like(bi)
    items = jnp.stack([bi * smax + off0, nt, bi * tq + ri * br, bi, bi + 1, z, s_len[bi], off0, z], axis=1)
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
                     block_rows=br, block_kv=c, max_tiles=next_pow2(tiles_per),
                     chunk_start=jnp.zeros((1,), jnp.int32))
    kf = suffix_k.reshape(b * smax, hkv, d)
    vf = suffix_v.reshape(b * smax, hkv, d)
    o, lse = partials(sched, q_hmd, kf, vf, key_m, lim_m, group=g, scale=scale, backend=backend)
    o = jnp.transpose(o.reshape(b, n_rb, n_split, hkv, br, g, d), (0, 1, 4, 2, 3, 5, 6))
    lse = jnp.transpose(lse.reshape(b, n_rb, n_split, hkv, br, g), (0, 1, 4, 2, 3, 5))
    return (o.reshape(b, n_rb * br, n_split, hkv, g, d)[:, :tq],
            lse.reshape(b, n_rb * br, n_split, hkv, g)[:, :tq])


def schedule_forward(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                     draft_parents=None, *, scale: float, schedule: str, backend: str):
    """Tree attention by the ``"flatten"``, ``"levelwise"``, ``"nodes"`` or ``"hybrid"`` schedule
    (``backend``: ``"pallas"`` compiled kernels, ``"interpret"`` the kernels in interpret mode,
    ``"mirror"`` the pure-JAX mirror): the hybrid forward, or one tree-kernel launch per
    schedule of the metadata that the schedule's leaf ``launches``.
    ``(out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq])``."""
    if schedule == "hybrid":
        return hybrid_attention(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                backend=backend)
    b, tq, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    key, lim = row_tables(meta, suffix_lengths)
    key_m = jnp.repeat(key, g)
    lim_m = jnp.repeat(lim, g)
    q_hmd = q_sorted(q, meta, hkv)
    parts_o, parts_l = [], []
    for sc in tree_leaf(schedule).launches(meta):
        o, lse = partials(sc, q_hmd, k_pool, v_pool, key_m, lim_m, group=g, scale=scale, backend=backend)
        og, lg = gather_parts(sc, o, lse, g)
        parts_o.append(og.reshape(b, tq, *og.shape[1:]))
        parts_l.append(lg.reshape(b, tq, *lg.shape[1:]))
    if draft_parents is not None:
        so, sl = draft_suffix_partials(q, suffix_k, suffix_v, suffix_lengths,
                                       draft_ancestors(draft_parents, tq), scale)
        parts_o.append(so)
        parts_l.append(sl)
    elif suffix_k.shape[1] > 0 and tq == 1 and backend in ("pallas", "interpret") and d >= 16 \
            and not d & (d - 1):
        # Decoding: the tree's partials are merged here (XLA), then one suffix launch attends
        # each sequence's suffix and merges that state in its epilogue, writing the output in
        # q's layout (pallas_kernels.suffix_attention).
        o_t, l_t = merge_states(parts_o, parts_l)              # [B, 1, Hkv, G, D], [B, 1, Hkv, G]
        return decode_suffix_merging(q, o_t.astype(partial_dtype(q.dtype)), l_t, suffix_k,
                                     suffix_v, suffix_lengths, scale=scale,
                                     interpret=backend == "interpret")
    elif suffix_k.shape[1] > 0:
        so, sl = suffix_partials(q, suffix_k, suffix_v, suffix_lengths, meta, scale=scale, backend=backend,
                                 block_kv=meta.flatten.block_kv)
        parts_o.append(so)
        parts_l.append(sl)
    out, lse = merge_states(parts_o, parts_l)                  # [B, Tq, Hkv, G, D], [B, Tq, Hkv, G]
    return out.reshape(b, tq, hq, d).astype(q.dtype), lse.reshape(b, tq, hq)



def root_spans(meta: TreeMetadata, k_pool, v_pool):
    """The roots' spans gathered into ``[G, root_pad, Hkv, D]`` (zeros past each root's length)."""
    start, length = meta.root_span[:, 0], meta.root_span[:, 1]
    idx = jnp.minimum(start[:, None] + jnp.arange(meta.root_pad)[None, :], k_pool.shape[0] - 1)  # [G, P]
    valid = (jnp.arange(meta.root_pad)[None, :] < length[:, None])[..., None, None]
    return jnp.where(valid, k_pool[idx], 0), jnp.where(valid, v_pool[idx], 0)


def single_level_attention(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *,
                           scale: float, shared_impl: str = "auto", interpret: bool = False):
    """Every sequence hangs from a root (``meta.single_level``): ``shared_prefix_attention`` with
    one prefix group per root (the roots' spans gathered into ``[G, root_pad, Hkv, D]``; a copy of
    the shared tokens only).  ``shared_impl`` / ``interpret`` are that call's ``impl`` /
    ``interpret``."""
    pk, pv = root_spans(meta, k_pool, v_pool)
    return shared_prefix_attention(q, pk, pv, suffix_k, suffix_v, suffix_lengths=suffix_lengths,
                                   prefix_lengths=meta.root_span[:, 1], seq_to_prefix=meta.seq_root,
                                   sm_scale=scale, return_lse=True, impl=shared_impl, interpret=interpret)


def shallow_attention(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *,
                      scale: float, shared_impl: str = "auto", interpret: bool = False):
    """Shallow trees (``meta.shallow_pad > 0``), decoding (``Tq == 1``): the roots through
    shared-prefix attention with each sequence's few path tokens below its root gathered into a
    per-sequence suffix ``[B, shallow_pad, Hkv, D]``; then, when there is a suffix, the decode
    suffix kernel attends it and merges that state in its epilogue.  With one query per sequence
    every key is visible, so the order of the keys does not matter."""
    idx, n = meta.shallow_idx, meta.shallow_len
    valid = (jnp.arange(meta.shallow_pad)[None, :] < n[:, None])[..., None, None]
    nk = jnp.where(valid, k_pool[idx], 0)
    nv = jnp.where(valid, v_pool[idx], 0)
    out, lse = single_level_attention(q, meta, k_pool, v_pool, nk, nv, n, scale=scale, shared_impl=shared_impl,
                                      interpret=interpret)
    if suffix_k.shape[1] == 0:
        return out, lse
    return decode_suffix_merging(q, out, lse, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                 interpret=interpret)


def hybrid_attention(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                     backend: str, suffix_tiling: Mapping | None = None,
                     mid_kernel_options: Mapping | None = None):
    """Hybrid decode schedule (``Tq == 1``; ``meta.excl_span`` built), at most three launches:

    1. the root (``meta.hybrid_root``: one root read by several sequences) through the shared
       path's prefix kernel (:func:`jax_prefix_attn.executor.decode_prefix_partials`: every
       sequence's query heads as the rows of one matrix product per kv head, the Mosaic GPU
       kernel on a Hopper GPU), its span gathered to a ``root_pad`` bucket (a copy of the
       root only);
    2. the other shared nodes (``meta.mid``, node or flatten mode, whichever the cost model
       prefers) through the tree kernel, their partials merged per sequence in XLA;
    3. the decode suffix kernel: each sequence streams the node only it reads (``excl_span``,
       in place in the pool, e.g. a tree-of-thought leaf) and its own suffix in one online
       softmax, and merges the partial states of 1 and 2 in its epilogue.

    With one query per sequence every key is visible, so the order of the keys does not matter.
    ``suffix_tiling``: keyword arguments of the suffix launch (``block_k``, ``num_warps``,
    ``num_stages``; default the planning device's
    :func:`~jax_prefix_attn.leaves.base.decode_suffix_tiling`); ``mid_kernel_options``: of the
    tree-kernel launch (``num_warps``, ``num_stages``).  ``backend`` ``"mirror"`` is not supported (kernels only).
    Returns ``(out [B, 1, Hq, D] in q's dtype, lse [B, 1, Hq])``."""
    hq = q.shape[2]
    hkv = k_pool.shape[1]
    g = hq // hkv
    interpret = backend == "interpret"
    kdt = k_pool.dtype
    q1 = q[:, 0].astype(kdt)
    sources = []
    if meta.hybrid_root:
        pk, pv = root_spans(meta, k_pool, v_pool)
        o_r, l_r, stride = decode_prefix_partials(q1, pk[0], pv[0], meta.root_span[0, 1], scale=scale,
                                                  interpret=interpret)
        sources.append((o_r, l_r, stride, None))
    if meta.mid is not None:
        key, lim = row_tables(meta, suffix_lengths)
        o, lse = partials(meta.mid, q_sorted(q1[:, None], meta, hkv), k_pool, v_pool, jnp.repeat(key, g),
                          jnp.repeat(lim, g), group=g, scale=scale, backend=backend,
                          kernel_options=mid_kernel_options)
        og, lg = gather_parts(meta.mid, o, lse, g)             # [B, P, Hkv, G, D], [B, P, Hkv, G]
        o_m, l_m = merge_states([og], [lg])                    # [B, Hkv, G, D], [B, Hkv, G]
        sources.append(as_incoming(o_m.astype(partial_dtype(kdt)), l_m, hq, hkv) + (None,))
    span = (k_pool, v_pool, meta.excl_span[:, 0], meta.excl_span[:, 1])
    if suffix_tiling is None:
        suffix_tiling = dataclasses.asdict(decode_suffix_tiling(planning_device_info()))
    out, lse = suffix_decode_merge(q1, suffix_k, suffix_v, suffix_lengths.astype(jnp.int32), sources, span=span,
                                   scale=scale, interpret=interpret, **suffix_tiling)
    return out[:, None].astype(q.dtype), lse[:, None]
