"""Tree attention partials in Pallas: one program per (work item, kv head), or per (work item,
kv head, row slice) when the item's tile does not fit the shared memory it is given.

Public entry: :func:`tree_partials`.  A *work item* pairs a window of a flat KV pool with a
block of ``block_rows`` query rows (KV-guided grouping, DeFT section 3.3) and produces the
partial attention state ``(o, lse)`` of those rows over the tokens of the window they may see.
Partials are merged afterwards by a deterministic gather + log-sum-exp reduction (done by
the caller with a static reduction map; no atomics).  A program holds the tile of
:func:`pallas_kernels.tree_attention_tiles.partials_tile`: all of the item's query vectors and
``block_kv`` keys per step, or, under a shared-memory bound, a slice of the rows and a fraction
of each chunk / tile per step of the same online softmax.

Item table ``items [W, 9]`` int32, columns
``(kv_start, ntiles, row_start, tin, tout, pos0, length, off0, chunk)``.  Two modes (static):

* ``"flatten"`` (DeFT-Flatten): the item reads ``ntiles`` consecutive chunks
  ``chunk, chunk + 1, ...``, each a window of ``block_kv`` pool tokens at
  ``chunk_start[chunk]`` with per-token visibility data ``tok[chunk] [3, block_kv]`` =
  ``(tin, tout, pos)`` (padding tokens have ``tin = NEVER = 2**30``).
* ``"node"`` (one node / one sequence suffix per item): the item loops over ``ntiles``
  tiles starting at pool token ``kv_start``, which is the node's offset ``off0``; token at
  node offset ``o`` is valid iff ``off0 + t * C <= o < min(off0 + (t + 1) * C, length)`` and
  carries ``(tin, tout, pos0 + o)``.  Tile windows are clamped inside the pool (so no
  out-of-bounds reads); the nominal-offset test keeps clamped tiles from double counting.

Query vector ``m`` (row ``r = m // group``) sees a token iff
``tin_tok <= row_key[m] < tout_tok`` and ``pos_tok <= row_limit[m]`` (the interval test on
depth-first numbers says "the token's node is an ancestor of the row's node"; the position
test is the bottom-right causal rule on the path).

Layouts: ``q [Hkv, Rq * group, D]`` (query vectors of row ``r``, heads ``h*group..``, at
``r * group + g``), ``k/v [N, Hkv, D]``, ``row_key/row_limit [Rq * group]`` int32.
Outputs ``o [W, Hkv, block_rows * group, D]`` in ``out_dtype`` (normalised; float32 by default,
the caller passes bfloat16 for bfloat16 inputs to halve partial-state traffic), ``lse [W, Hkv,
block_rows * group]`` float32 (``-inf`` and ``o = 0`` where nothing is visible).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention_tiles import partials_tile

__all__ = ["tree_partials", "ITEM_FIELDS", "NEVER", "KV_START", "NTILES", "ROW_START", "TIN", "TOUT", "POS0",
           "LENGTH", "OFF0", "CHUNK"]

# Columns of an item table ``items [W, 9]`` (int32).
ITEM_FIELDS = ("kv_start", "ntiles", "row_start", "tin", "tout", "pos0", "length", "off0", "chunk")
KV_START, NTILES, ROW_START, TIN, TOUT, POS0, LENGTH, OFF0, CHUNK = range(len(ITEM_FIELDS))
NEVER = 1 << 30  # ``tin`` of a token nobody sees (padding tokens of a chunk, padding items)


def _dot(a, b, fp32: bool, trans_b: bool = False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    prec = lax.Precision.HIGHEST if fp32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _kernel(items_ref, tok_ref, cs_ref, key_ref, lim_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
            mode: str, group: int, rows: int, cols: int, nsub: int, row_split: int, scale: float, fp32: bool):
    """One (item, kv head[, row slice]): ``rows`` query vectors over the item's tiles, ``cols``
    keys at a time (``nsub`` steps per ``block_kv`` chunk / tile)."""
    w = pl.program_id(0)
    h = pl.program_id(1)
    c = cols
    n_pool = k_ref.shape[0]
    kv_start = items_ref[w, KV_START]
    ntiles = items_ref[w, NTILES]
    m0 = items_ref[w, ROW_START] * group
    if row_split > 1:
        m0 = m0 + pl.program_id(2) * rows
    q = q_ref[h, pl.ds(m0, rows), :]                          # [M, D]
    key = key_ref[pl.ds(m0, rows)][:, None]                   # [M, 1]
    lim = lim_ref[pl.ds(m0, rows)][:, None]
    cols_c = lax.broadcasted_iota(jnp.int32, (1, c), 1)       # [1, C]

    if mode == "flatten":
        chunk0 = items_ref[w, CHUNK]
    else:
        i_tin = items_ref[w, TIN]
        i_tout = items_ref[w, TOUT]
        pos0 = items_ref[w, POS0]
        length = items_ref[w, LENGTH]
        off0 = items_ref[w, OFF0]
        base = kv_start - off0                                 # pool position of node offset 0
        node_vis = (i_tin <= key) & (key < i_tout)              # [M, 1]
        rows_c = lax.broadcasted_iota(jnp.int32, (c, 1), 0)    # [C, 1]

    def body(t, carry):
        acc, m, l = carry
        if mode == "flatten":
            if nsub == 1:
                chunk, cut = chunk0 + t, slice(None)
                start = cs_ref[chunk]
            else:  # step t: keys [j0, j0 + C) of the item's chunk t // nsub
                chunk = chunk0 + lax.div(t, jnp.int32(nsub))            # (t >= 0: truncation is floor)
                j0 = lax.rem(t, jnp.int32(nsub)) * c
                cut = pl.ds(j0, c)
                start = cs_ref[chunk] + j0
            t_tin = tok_ref[chunk, 0, cut][None, :]
            t_tout = tok_ref[chunk, 1, cut][None, :]
            t_pos = tok_ref[chunk, 2, cut][None, :]
            v_ok = (tok_ref[chunk, 0, cut] != NEVER)[:, None]  # [C, 1] tokens of this chunk
        else:  # (C-key tiles: nsub per block_kv tile, the same node offsets)
            start = jnp.minimum(kv_start + t * c, n_pool - c)
        k = k_ref[pl.ds(start, c), h, :]                       # [C, D]
        v = v_ref[pl.ds(start, c), h, :]
        s = _dot(q, k, fp32, trans_b=True) * scale              # [M, C]
        if mode == "flatten":
            vis = (t_tin <= key) & (key < t_tout) & (t_pos <= lim)
            tok_ok = v_ok
        else:
            off = start - base + cols_c                        # node offsets of the window
            lo = off0 + t * c
            hi = jnp.minimum(lo + c, length)
            ok = (off >= lo) & (off < hi)
            vis = node_vis & ok & (pos0 + off <= lim)
            off_r = start - base + rows_c
            tok_ok = (off_r >= lo) & (off_r < hi)
        # Tokens outside the item may hold anything (even NaN): never let them reach p @ v.
        v = jnp.where(tok_ok, v, jnp.zeros_like(v))
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_use)
        p = jnp.where(vis, jnp.exp(s - m_use[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, fp32)
        return acc, m_new, l

    d = q_ref.shape[-1]
    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, ntiles * nsub if nsub > 1 else ntiles, body, carry)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def tree_partials(q_hmd, k_nhd, v_nhd, items_w9, tok_c3c, chunk_start_c, row_key_m, row_limit_m, *, mode: str,
                  group: int, block_rows: int, block_kv: int, sm_scale: float, interpret: bool = False,
                  num_warps: int | None = None, num_stages: int = 2, out_dtype=jnp.float32,
                  smem_bytes: int | None = None):
    """Partial states of every (work item, kv head); see the module docstring for layouts.

    ``smem_bytes`` (the device's shared memory per CTA; None: no bound): each program holds the
    tile :func:`pallas_kernels.tree_attention_tiles.partials_tile` picks, so that its estimated
    shared memory fits: an item's rows are then split over several programs (a third grid
    axis) and its chunks walked in steps of fewer keys.  The outputs are the same either way.

    Requirements (checked): ``block_kv`` and ``block_rows * group`` powers of two >= 16;
    ``N >= block_kv``; ``q`` has at least ``max(row_start) + block_rows`` rows; every
    ``chunk_start`` is ``<= N - block_kv``.
    """
    if mode not in ("flatten", "node"):
        raise ValueError(f"mode must be 'flatten' or 'node', got {mode!r}")
    hkv, mq, d = q_hmd.shape
    n = k_nhd.shape[0]
    block_m = block_rows * group
    for name, val in (("block_kv", block_kv), ("block_rows * group", block_m)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if n < block_kv:
        raise ValueError(f"the pool must hold at least block_kv={block_kv} tokens, got {n}")
    if k_nhd.shape != (n, hkv, d) or v_nhd.shape != k_nhd.shape:
        raise ValueError(f"k/v must have shape {(n, hkv, d)}, got {k_nhd.shape} and {v_nhd.shape}")
    w = items_w9.shape[0]
    rows, cols = partials_tile(block_m, block_kv, d, q_hmd.dtype, smem_bytes)
    row_split = block_m // rows
    if num_warps is None:  # [M, C] scores and [M, D] accumulator live in registers
        num_warps = 8 if max(rows * cols, rows * d) >= 128 * 128 else 4
    fp32 = jnp.dtype(q_hmd.dtype) == jnp.float32
    kernel = functools.partial(_kernel, mode=mode, group=group, rows=rows, cols=cols, nsub=block_kv // cols,
                               row_split=row_split, scale=float(sm_scale), fp32=fp32)
    if row_split == 1:
        grid = (w, hkv)
        full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
        out_specs = [pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)),
                     pl.BlockSpec((None, None, rows), lambda i, j: (i, j, 0))]
    else:
        grid = (w, hkv, row_split)
        full = lambda shape: pl.BlockSpec(shape, lambda i, j, r: (0,) * len(shape))  # noqa: E731
        out_specs = [pl.BlockSpec((None, None, rows, d), lambda i, j, r: (i, j, r, 0)),
                     pl.BlockSpec((None, None, rows), lambda i, j, r: (i, j, r))]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[full(items_w9.shape), full(tok_c3c.shape), full(chunk_start_c.shape), full(row_key_m.shape),
                  full(row_limit_m.shape),
                  full(q_hmd.shape), full(k_nhd.shape), full(v_nhd.shape)],
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((w, hkv, block_m, d), out_dtype),
                   jax.ShapeDtypeStruct((w, hkv, block_m), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"tree_partials_{mode}",
    )(items_w9.astype(jnp.int32), tok_c3c.astype(jnp.int32), chunk_start_c.astype(jnp.int32), row_key_m.astype(jnp.int32),
      row_limit_m.astype(jnp.int32), q_hmd, k_nhd, v_nhd)
