"""Backward pass of tree attention's flatten schedule (DeFT-Flatten) in Pallas (Triton lowering):
the gradients of the *tree part* of tree attention, given the statistics of the whole attention
(tree and suffix merged).

As for shared-prefix attention (:mod:`pallas_kernels.prefix_attention_bwd`), each part of a
merged attention is differentiated as a flash backward with the *merged* statistics
(FlashAttention-2: ``p = exp(s - lse)``, ``ds = p (dp - delta)``, ``delta = rowsum(dO * O) -
dlse``), so the partial states and their tree-aware reduction need no backward of their own.
The work follows the forward's flatten schedule (:mod:`pallas_kernels.tree_attention`: items
pair a run of ``block_kv``-token chunks of the pool with a block of query rows, and a token is
visible to a row by the interval test on depth-first numbers plus the path-position test):

* ``dK``/``dV``: one program per (chunk, kv head, ``block_k``-column slice of the chunk) loops
  over the items that read the chunk.  The flatten schedule lists the items of one chunk group
  (consecutive chunks with the same rows) consecutively, one per row block, so a chunk's items
  are a contiguous range of the item table (:func:`chunk_item_ranges`); a chunk of the root is
  read by every row block below it, and its gradient is summed over all of them inside the
  program (a row block per loop step, or a slice of one when a step's tile does not fit the
  shared memory it is given).  Outputs ``[NC, Hkv, C, D]`` in k's dtype, gathered into the pool by XLA through
  the inverse of the chunk windows when each pool token is at most one chunk's (no two nodes'
  spans overlap: ``disjoint``), else summed into it by a scatter-add; the columns of a window
  that are not its chunk's tokens are dropped.
* ``dQ``: one program per (item, kv head) loops over the item's chunks, as the forward does
  (per row slice of the item, and in steps of part of a chunk, when its tile does not fit the
  shared memory it is given: :mod:`pallas_kernels.tree_attention_tiles`),
  and writes a partial ``[W, Hkv, M, D]`` (float32, or the inputs' dtype when 16-bit); XLA sums
  each row's partials through the schedule's reduction map ``parts`` (a gather, as the
  forward's merge: a row block's partials come from the items of every chunk group above it).

Nothing of size ``rows x keys`` is materialised (the pure-JAX mirror's autodiff materialises
the scores of every work item).  Tokens outside a chunk's window and keys no row sees never
reach a gradient, whatever the pool holds there (NaN included): selects, and K/V zeroed on
the columns that are not the chunk's tokens.

Layouts (the forward's): ``q_hmd, do_hmd [Hkv, Rq * group, D]`` (sorted rows, query vector ``m``
= row ``m // group``), ``lse_hm, delta_hm [Hkv, Rq * group]`` float32 (merged statistics;
``lse = -inf`` where a row sees nothing), ``k/v [N, Hkv, D]``, ``row_key/row_limit [Rq * group]``,
the schedule's ``items [W, 9]``, ``tok [NC, 3, C]``, ``chunk_start [NC]`` and ``parts [R, P]``.
Returns ``dq [R, Hkv, group, D]`` float32 in the original row order (``b * Tq + t``) and ``dk, dv
[N, Hkv, D]`` in k's dtype.  Static: the shapes, ``group``, ``block_rows``, ``block_kv``, the
column blocks, ``scale``; the tree itself is dynamic data (trees whose metadata buckets agree
share one compilation).

Tilings: 32-column steps for both kernels, with 4 warps for dK/dV (8 are faster only with
Hq=8/Hkv=1) and 8 for dQ, the fastest of the settings timed on the trees of
``bench/tree_attention_grad.py`` (``docs/performance.md``, "Kernel design measurements").

:func:`tree_grads_reference` is the dense pure-JAX computation of the same gradients from the
token tables alone (no items): the independent check of the kernels' item walk.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention import CHUNK, NEVER, NTILES, ROW_START
from pallas_kernels.tree_attention_tiles import dkv_rows, dq_tile

__all__ = ["tree_grads", "tree_grads_reference", "chunk_item_ranges"]

_LOG2E = math.log2(math.e)


def _dot(a, b, fp32: bool, trans_b: bool = False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    prec = lax.Precision.HIGHEST if fp32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def chunk_item_ranges(items_w9, n_chunks: int):
    """For each chunk ``c < n_chunks``: ``(first, count, tile)`` int32 ``[NC]``: the items that
    read it are ``first .. first + count - 1`` (one per row block of its chunk group), and it is
    their ``tile``-th chunk.  ``count = 0`` for padding chunks.  Relies on the flatten schedule's
    layout (checked by the tests): items sorted by their first chunk, one chunk group's items
    consecutive with rows ``row_start + i * block_rows``, padding items (``ntiles = 0``) last,
    and an item's chunks adjacent windows of the pool (``chunk_start`` of its ``t``-th chunk =
    the first's ``+ t * block_kv``)."""
    ntiles = items_w9[:, NTILES]
    big = jnp.int32(NEVER)
    first_chunk = jnp.where(ntiles > 0, items_w9[:, CHUNK], big)                   # [W] sorted
    c = jnp.arange(n_chunks, dtype=jnp.int32)
    # (``compare_all``: one fused comparison of every chunk with every item, no loop; the
    # default binary search is a loop of small steps on the device)
    last = jnp.searchsorted(first_chunk, c, side="right", method="compare_all").astype(jnp.int32) - 1
    lc = jnp.maximum(last, 0)                                                      # CHUNK <= c
    g0 = first_chunk[lc]
    live = (last >= 0) & (c < g0 + ntiles[lc])
    first = jnp.searchsorted(first_chunk, g0, side="left", method="compare_all").astype(jnp.int32)
    count = jnp.where(live, last - first + 1, 0)
    return first, count.astype(jnp.int32), jnp.where(live, c - g0, 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- dk / dv

def _dkv_kernel(first_ref, count_ref, items_ref, tok_ref, cs_ref, key_ref, lim_ref, q_ref, do_ref,
                lse_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref, *, group: int, block_m: int,
                rows: int, bk: int, scale: float, fp32: bool):
    """One (chunk, kv head, column slice): ``k/v [bk, D]`` of the slice; loops over the items
    (row blocks of ``block_m`` query vectors) that read the chunk, ``rows`` query vectors per
    step."""
    c = pl.program_id(0)
    h = pl.program_id(1)
    j0 = pl.program_id(2) * bk
    scale2 = scale * _LOG2E
    start = cs_ref[c] + j0
    t_tin = tok_ref[c, 0, pl.ds(j0, bk)][:, None]                 # [bk, 1]
    t_tout = tok_ref[c, 1, pl.ds(j0, bk)][:, None]
    t_pos = tok_ref[c, 2, pl.ds(j0, bk)][:, None]
    ok = t_tin != NEVER
    k = k_ref[pl.ds(start, bk), h, :]
    v = v_ref[pl.ds(start, bk), h, :]
    k = jnp.where(ok, k, jnp.zeros_like(k))                       # not this chunk's tokens:
    v = jnp.where(ok, v, jnp.zeros_like(v))                       # anything, NaN included
    first = first_ref[c]
    # a chunk group's items are consecutive row blocks: affine row offsets (no load in the loop's
    # address chain, so the compiler can pipeline the q / dO loads)
    m_first = items_ref[first, ROW_START] * group

    def body(i, carry):
        dk, dv = carry
        m0 = m_first + i * rows                                    # (the items' rows are contiguous)
        q = q_ref[h, pl.ds(m0, rows), :]                           # [M, D]
        do = do_ref[h, pl.ds(m0, rows), :]
        lse2 = lse_ref[h, pl.ds(m0, rows)][None, :] * _LOG2E      # [1, M]
        delta = delta_ref[h, pl.ds(m0, rows)][None, :]
        key = key_ref[pl.ds(m0, rows)][None, :]
        lim = lim_ref[pl.ds(m0, rows)][None, :]
        vis = (t_tin <= key) & (key < t_tout) & (t_pos <= lim)     # [bk, M]
        s_t = _dot(k, q, fp32, trans_b=True)                       # [bk, M]
        p_t = jnp.where(vis, jnp.exp2(s_t * scale2 - lse2), 0.0)
        dv = dv + _dot(p_t.astype(do.dtype), do, fp32)
        dp_t = _dot(v, do, fp32, trans_b=True)
        ds_t = jnp.where(vis, p_t * (dp_t - delta), 0.0)
        dk = dk + _dot(ds_t.astype(q.dtype), q, fp32)
        return dk, dv

    d = k_ref.shape[-1]
    carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    steps = count_ref[c] * (block_m // rows) if rows < block_m else count_ref[c]
    dk, dv = lax.fori_loop(0, steps, body, carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- dq

def _dq_kernel(items_ref, tok_ref, cs_ref, key_ref, lim_ref, q_ref, do_ref, lse_ref, delta_ref,
               k_ref, v_ref, dq_ref, *, group: int, rows: int, row_split: int, block_kv: int, step: int,
               bk: int, scale: float, fp32: bool):
    """One (item, kv head[, row slice]): ``rows`` query vectors ``[M, D]`` over the item's
    ``ntiles`` chunks, ``step`` keys per loop step in ``bk``-column slices."""
    w = pl.program_id(0)
    h = pl.program_id(1)
    scale2 = scale * _LOG2E
    m0 = items_ref[w, ROW_START] * group
    if row_split > 1:
        m0 = m0 + pl.program_id(2) * rows
    chunk0 = items_ref[w, CHUNK]
    q = q_ref[h, pl.ds(m0, rows), :]
    do = do_ref[h, pl.ds(m0, rows), :]
    lse2 = lse_ref[h, pl.ds(m0, rows)][:, None] * _LOG2E           # [M, 1]
    delta = delta_ref[h, pl.ds(m0, rows)][:, None]
    key = key_ref[pl.ds(m0, rows)][:, None]
    lim = lim_ref[pl.ds(m0, rows)][:, None]
    nsub = block_kv // step

    start0 = cs_ref[chunk0]  # an item's chunks are adjacent pool windows: affine starts

    def body(t, dq):
        if nsub == 1:
            chunk, s0 = chunk0 + t, 0
        else:  # step t: keys [s0, s0 + step) of the item's chunk t // nsub
            chunk, s0 = chunk0 + lax.div(t, jnp.int32(nsub)), lax.rem(t, jnp.int32(nsub)) * step
        for j in range(0, step, bk):                               # static column slices
            j0 = s0 + j
            start = start0 + t * step + j
            t_tin = tok_ref[chunk, 0, pl.ds(j0, bk)]
            t_tout = tok_ref[chunk, 1, pl.ds(j0, bk)][None, :]
            t_pos = tok_ref[chunk, 2, pl.ds(j0, bk)][None, :]
            ok = (t_tin != NEVER)[:, None]                        # [bk, 1]
            k = k_ref[pl.ds(start, bk), h, :]
            v = v_ref[pl.ds(start, bk), h, :]
            k = jnp.where(ok, k, jnp.zeros_like(k))
            v = jnp.where(ok, v, jnp.zeros_like(v))
            vis = (t_tin[None, :] <= key) & (key < t_tout) & (t_pos <= lim)   # [M, bk]
            s = _dot(q, k, fp32, trans_b=True)
            p = jnp.where(vis, jnp.exp2(s * scale2 - lse2), 0.0)
            dp = _dot(do, v, fp32, trans_b=True)
            ds = jnp.where(vis, p * (dp - delta), 0.0)
            dq = dq + _dot(ds.astype(k.dtype), k, fp32)
        return dq

    d = q_ref.shape[-1]
    steps = items_ref[w, NTILES] * nsub if nsub > 1 else items_ref[w, NTILES]
    dq = lax.fori_loop(0, steps, body, jnp.zeros((rows, d), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- entry

def _chunks_to_pool(dkv_c, tok_c3c, chunk_start_c, n: int, disjoint: bool):
    """``[NC, Hkv, C, D]`` per-chunk gradients -> ``[N, Hkv, D]`` (tokens in no chunk get 0).
    ``disjoint`` (each pool token is at most one chunk's: no two nodes' spans overlap): a gather
    through the inverse of the chunk windows; else a float32 scatter-add, so that a token that
    several nodes' spans share gets the sum of their gradients."""
    nc, hkv, c, d = dkv_c.shape
    pos = chunk_start_c[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]       # [NC, C]
    pos = jnp.where(tok_c3c[:, 0, :] != NEVER, pos, n).reshape(-1)
    flat = jnp.transpose(dkv_c, (0, 2, 1, 3)).reshape(nc * c, hkv, d)
    if not disjoint:
        acc = jnp.zeros((n, hkv, d), jnp.float32).at[pos].add(flat.astype(jnp.float32), mode="drop")
        return acc.astype(dkv_c.dtype)
    src = jnp.full((n,), -1, jnp.int32).at[pos].set(jnp.arange(nc * c, dtype=jnp.int32), mode="drop")
    return jnp.where((src >= 0)[:, None, None], flat[jnp.maximum(src, 0)], jnp.zeros((), dkv_c.dtype))


def _full(shape, nd: int):
    return pl.BlockSpec(shape, (lambda i, j: (0,) * len(shape)) if nd == 2
                        else (lambda i, j, l: (0,) * len(shape)))


def _dkv_call(first, count, items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd, v_nhd, *,
              group, block_m, rows, bk, block_kv, scale, fp32, interpret, params):
    """The dK/dV kernel: ``[NC, Hkv, C, D]`` per-chunk ``(dk, dv)`` in k's dtype (a token's
    gradient within one chunk is complete; only tokens that several nodes' spans share are
    summed afterwards, by :func:`_chunks_to_pool`)."""
    nc, hkv, d = tok.shape[0], q_hmd.shape[0], q_hmd.shape[-1]
    ins = (first, count, items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd, v_nhd)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, group=group, block_m=block_m, rows=rows, bk=bk, scale=scale, fp32=fp32),
        grid=(nc, hkv, block_kv // bk),
        in_specs=[_full(x.shape, 3) for x in ins],
        out_specs=[pl.BlockSpec((None, None, bk, d), lambda i, j, l: (i, j, l, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((nc, hkv, block_kv, d), k_nhd.dtype)] * 2,
        interpret=interpret, compiler_params=params, name="tree_grads_dkv",
    )(*ins)


def _dq_call(items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd, v_nhd, *, group, block_m,
             rows, step, bk, block_kv, scale, fp32, interpret, params):
    """The dQ kernel: ``[W, Hkv, M, D]`` per-item partials (float32, or q's dtype when it is
    16-bit: half the traffic, one more rounding per partial, as the forward's partials); an
    item's rows over ``block_m // rows`` programs."""
    w, hkv, d = items.shape[0], q_hmd.shape[0], q_hmd.shape[-1]
    ins = (items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd, v_nhd)
    row_split = block_m // rows
    if row_split == 1:
        grid, nd, out_index = (w, hkv), 2, (lambda i, j: (i, j, 0, 0))
    else:
        grid, nd, out_index = (w, hkv, row_split), 3, (lambda i, j, r: (i, j, r, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, group=group, rows=rows, row_split=row_split, block_kv=block_kv, step=step,
                          bk=bk, scale=scale, fp32=fp32),
        grid=grid,
        in_specs=[_full(x.shape, nd) for x in ins],
        out_specs=pl.BlockSpec((None, None, rows, d), out_index),
        out_shape=jax.ShapeDtypeStruct((w, hkv, block_m, d), jnp.float32 if fp32 else q_hmd.dtype),
        interpret=interpret, compiler_params=params, name="tree_grads_dq",
    )(*ins)


def tree_grads(q_hmd, do_hmd, lse_hm, delta_hm, k_nhd, v_nhd, items_w9, tok_c3c, chunk_start_c,
               parts_rp, row_key_m, row_limit_m, *, group: int, block_rows: int, block_kv: int,
               sm_scale: float, block_k: int | None = None, dq_block_k: int | None = None,
               interpret: bool = False, num_warps: int = 4, dq_num_warps: int = 8,
               num_stages: int = 2, disjoint: bool = False, smem_bytes: int | None = None):
    """Gradients of the tree part (flatten schedule); see the module docstring for layouts.

    ``block_k`` / ``dq_block_k``: key columns per step of the dK/dV / dQ kernel (divisors of
    ``block_kv``, powers of two >= 16; None: 32, or ``block_kv`` if smaller).  ``disjoint``
    (static): no two nodes' spans share a pool token (``not PrefixTree.spans_overlap``), so the
    per-chunk ``dK``/``dV`` reach the pool by a gather; otherwise (the safe default) by a
    scatter-add that sums a shared token's gradients.  ``smem_bytes`` (the device's shared
    memory per CTA; None: no bound): the programs hold the tiles of
    :mod:`pallas_kernels.tree_attention_tiles` (:func:`~pallas_kernels.tree_attention_tiles.dkv_rows`,
    :func:`~pallas_kernels.tree_attention_tiles.dq_tile`) so that their estimated shared memory
    fits: fewer query vectors per dK/dV step, dQ rows over several programs, fewer keys per dQ
    step and, last, narrower dQ column slices.  Returns ``(dq, dk, dv)``."""
    hkv, mq, d = q_hmd.shape
    n = k_nhd.shape[0]
    block_m = block_rows * group
    bk = min(32, block_kv) if block_k is None else int(block_k)
    bq = min(32, block_kv) if dq_block_k is None else int(dq_block_k)
    for name, val in (("block_k", bk), ("dq_block_k", bq)):
        if val < 16 or val & (val - 1) or block_kv % val:
            raise ValueError(f"{name} must be a power of two >= 16 dividing block_kv={block_kv}, got {val}")
    for name, val in (("block_kv", block_kv), ("block_rows * group", block_m)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if n < block_kv:
        raise ValueError(f"the pool must hold at least block_kv={block_kv} tokens, got {n}")
    for name, arr, shape in (("do_hmd", do_hmd, q_hmd.shape), ("lse_hm", lse_hm, (hkv, mq)),
                             ("delta_hm", delta_hm, (hkv, mq)), ("v_nhd", v_nhd, k_nhd.shape),
                             ("k_nhd", k_nhd, (n, hkv, d))):
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    w = items_w9.shape[0]
    nc = tok_c3c.shape[0]
    fp32 = jnp.dtype(q_hmd.dtype) == jnp.float32
    def params(warps):
        return None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)
    items = items_w9.astype(jnp.int32)
    tok = tok_c3c.astype(jnp.int32)
    cs = chunk_start_c.astype(jnp.int32)
    key = row_key_m.astype(jnp.int32)
    lim = row_limit_m.astype(jnp.int32)
    lse = lse_hm.astype(jnp.float32)
    delta = delta_hm.astype(jnp.float32)
    first, count, _ = chunk_item_ranges(items, nc)
    static = dict(group=group, block_m=block_m, block_kv=block_kv, scale=float(sm_scale), fp32=fp32,
                  interpret=interpret)
    dkv_m = dkv_rows(block_m, bk, d, q_hmd.dtype, smem_bytes)
    dq_m, dq_step, bq = dq_tile(block_m, block_kv, bq, d, q_hmd.dtype, smem_bytes)
    dk_c, dv_c = _dkv_call(first, count, items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd,
                           v_nhd, rows=dkv_m, bk=bk, params=params(num_warps), **static)
    dq_w = _dq_call(items, tok, cs, key, lim, q_hmd, do_hmd, lse, delta, k_nhd, v_nhd, rows=dq_m, step=dq_step,
                    bk=bq, params=params(dq_num_warps), **static)

    # item partials -> original rows through the schedule's reduction map (a gather and a sum
    # over each row's parts, as the forward's merge: no scatter)
    valid = parts_rp >= 0
    idx = jnp.where(valid, parts_rp, 0)
    dq5 = dq_w.reshape(w, hkv, block_rows, group, d)
    dq = jnp.sum(jnp.where(valid[..., None, None, None], dq5[idx // block_rows, :, idx % block_rows]
                           .astype(jnp.float32), 0.0), axis=1)                   # [R, Hkv, G, D]
    return dq, _chunks_to_pool(dk_c, tok, cs, n, disjoint), _chunks_to_pool(dv_c, tok, cs, n, disjoint)


def tree_grads_reference(q_hmd, do_hmd, lse_hm, delta_hm, k_nhd, v_nhd, tok_c3c, chunk_start_c,
                         sorted_rows, row_key_m, row_limit_m, *, n_rows: int, sm_scale: float):
    """Dense pure-JAX :func:`tree_grads` (float32, ``precision=HIGHEST``): every (row, pool token)
    pair, each token's ``(tin, tout, pos)`` taken from the chunk token tables (tokens in no chunk
    are seen by nobody), rows back to their original order through ``sorted_rows [R_pad]``
    (``n_rows`` for padding rows) instead of the items and their reduction map."""
    hkv, mq, d = q_hmd.shape
    n = k_nhd.shape[0]
    nc, _, c = tok_c3c.shape
    hi = lax.Precision.HIGHEST
    pos = chunk_start_c[:, None].astype(jnp.int32) + jnp.arange(c, dtype=jnp.int32)[None, :]
    pos = jnp.where(tok_c3c[:, 0, :] != NEVER, pos, n).reshape(-1)
    tin = jnp.full((n,), NEVER, jnp.int32).at[pos].set(tok_c3c[:, 0, :].reshape(-1), mode="drop")
    tout = jnp.zeros((n,), jnp.int32).at[pos].set(tok_c3c[:, 1, :].reshape(-1), mode="drop")
    tpos = jnp.zeros((n,), jnp.int32).at[pos].set(tok_c3c[:, 2, :].reshape(-1), mode="drop")
    key = row_key_m[None, :, None]
    lim = row_limit_m[None, :, None]
    vis = (tin[None, None, :] <= key) & (key < tout[None, None, :]) & (tpos[None, None, :] <= lim)
    seen = jnp.any(vis, axis=(0, 1))[:, None, None]                          # [N, 1, 1]
    q = q_hmd.astype(jnp.float32)
    do = do_hmd.astype(jnp.float32)
    k = jnp.where(seen, k_nhd.astype(jnp.float32), 0.0)
    v = jnp.where(seen, v_nhd.astype(jnp.float32), 0.0)
    s = jnp.einsum("hmd,nhd->hmn", q, k, precision=hi) * sm_scale
    lse = lse_hm.astype(jnp.float32)[..., None]
    empty = lse == -jnp.inf  # (a NaN lse gives NaN gradients)
    p = jnp.where(vis, jnp.exp(s - jnp.where(empty, 0.0, lse)), 0.0)
    p = jnp.where(empty, 0.0, p)
    dp = jnp.einsum("hmd,nhd->hmn", do, v, precision=hi)
    ds = jnp.where(vis, p * (dp - delta_hm.astype(jnp.float32)[..., None]), 0.0)
    dq = jnp.einsum("hmn,nhd->hmd", ds, k, precision=hi) * sm_scale
    dk = jnp.einsum("hmn,hmd->nhd", ds, q, precision=hi) * sm_scale
    dv = jnp.einsum("hmn,hmd->nhd", p, do, precision=hi)
    g = mq // sorted_rows.shape[0]
    dq = jnp.transpose(dq.reshape(hkv, -1, g, d), (1, 0, 2, 3))                # [R_pad, Hkv, G, D]
    dq = jnp.zeros((n_rows, hkv, g, d), jnp.float32).at[sorted_rows].add(dq, mode="drop")
    return dq, dk, dv
