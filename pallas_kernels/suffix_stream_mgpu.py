"""Per-step pieces of a decode suffix pass streamed by self-scheduled Mosaic GPU warpgroups
(the stream role of :mod:`pallas_kernels.split_decode_mgpu`).

For decoding (one query per sequence) with GQA group ``G = Hq / Hkv``, every (sequence, kv
head) attends over its own suffix keys ``[0, s_len[b])``: bound by HBM bandwidth, each suffix
K/V byte read once.  A *worker* (one compute warpgroup) walks tasks; a task is ``COLS / G``
consecutive sequences of one kv head (rows ``blk * COLS ..`` of ``q_hmd[h]``), walked one
after another into one state whose columns belong to them in turn (a column only sees keys
while its own sequence is walked).

Products ("swap AB"): ``S^T = K Q^T`` is ``[block_s keys, COLS]`` (wgmma M = the keys, N =
COLS query rows), the online softmax runs down the columns, and ``O^T += V^T P^T`` is
``[D, COLS]``; ``COLS = max(16, G)``.  The running max is reduced across the key rows every
step; the softmax sums are kept per (key row, column) and reduced once per task.  Steps form
a static ``rounds x (COLS/G) x S/block_s`` grid per worker, so barrier phases never depend on
the lengths; a tile wholly past its sequence's length loads the last valid tile again (an L2
hit) and skips the math; ``V`` rows past a length are zeroed in shared memory before ``P V``
(NaN in the cache there never reaches the output).

A cross-warp reduction (the max runs down the key rows, which span the warpgroup's 4 warps)
uses a shared-memory scratch that Mosaic GPU places at the allocation top where it is lowered,
the same for every warpgroup: reductions running at once in two warpgroups race on it.  The
caller traces worker ``w``'s code inside ``w`` nested collective padding allocations of
:func:`red_bytes` each, so each worker's scratch lies elsewhere.

Layouts: ``q_hmd [Hkv, M, D]`` row ``b * G + j`` is query head ``h * G + j`` of sequence ``b``
(``M >= ceil(B G / COLS) COLS``), suffix ``k/v [B, S, Hkv, D]`` (``S % block_s == 0``),
``s_len [B]`` int32 (dynamic, in ``[0, S]``).  With ``cpu`` (Mosaic GPU's CPU interpreter,
whose wgmma reads no transposed ref) ``Q^T [Hkv, D, M]`` and ``V^T [B, Hkv, D, S]`` in memory.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2
from pallas_kernels.mgpu_compat import plgpu, store_gmem
from pallas_kernels.prefix_attention_mgpu import wg_accumulate, wgmma_iota

__all__ = ["stream_supported", "BLOCK_S", "cols_for", "StreamGeometry", "stream_step_geometry",
           "stream_fresh", "stream_attend", "stream_finish", "stream_issue_loads", "last_tile",
           "n_q_buffers", "stream_smem_bytes", "red_bytes", "RED_SCRATCH"]

BLOCK_S = 64   # suffix keys per tile (the swapped product's M)


def cols_for(group: int) -> int:
    """Query rows per task (the swapped products' N): ``max(16, G)`` (a ``P^T`` tile of fewer
    than 16 columns has 16-byte rows, which no wgmma shared-memory swizzle takes)."""
    return max(16, int(group))


def stream_supported(*, heads_q: int, heads_kv: int, suffix_cap: int, head_dim: int,
                     dtype) -> str | None:
    """``None`` when a streamed suffix pass handles these static shapes, else the reason."""
    if heads_kv < 1 or heads_q % heads_kv:
        return f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}"
    g = heads_q // heads_kv
    if g & (g - 1) or g > 16:
        return f"query heads per kv head must be a power of two up to 16, got {g}"
    if head_dim not in (64, 128):
        return f"head_dim must be 64 or 128, got {head_dim}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if suffix_cap % BLOCK_S or suffix_cap == 0:
        return f"suffix capacity {suffix_cap} must be a positive multiple of {BLOCK_S}"
    return None


RED_SCRATCH = 128 * 4 * 4    # Mosaic GPU's default cross-warp reduction scratch (bytes)


def n_q_buffers(stages: int, per_task: int) -> int:
    """Query buffers per worker: task ``r``'s queries are loaded at its first step ``u0``,
    which waits for step ``u0 - stages`` to be consumed; the buffer's previous task
    (``r - n_q``) ended at step ``u0 - (n_q - 1) * per_task - 1``, so
    ``n_q - 1 >= (stages - 1) / per_task``."""
    return min(stages, 1 + -(-(stages - 1) // per_task))


def stream_smem_bytes(stages: int, n_q: int, cols: int, d: int, itemsize: int, wgs: int = 2,
                      bs: int = BLOCK_S) -> int:
    """Shared memory of the buffers (with three workers ``O^T`` is stored from registers)."""
    o_stage = 0 if wgs == 3 else d * cols
    return itemsize * wgs * (stages * 2 * bs * d + n_q * cols * d + bs * cols + o_stage)


def red_bytes(wgs: int) -> int:
    """Cross-warp reduction scratch per compute warpgroup (smaller with three, to fit)."""
    return RED_SCRATCH if wgs < 3 else 1024


class StreamGeometry(NamedTuple):
    """Static geometry of a streamed suffix pass (see the module docstring): ``b`` sequences of
    capacity ``s_cap``, ``hkv`` kv heads of size ``d``; ``cols`` query rows per task, ``spt``
    sequences per task, ``s_tiles`` tiles of ``bs`` keys per sequence, ``per_task`` steps per
    task; ``workers`` workers in all; ``n_blk`` row blocks; ``log2_g`` = log2(G);
    ``scale_log2`` the softmax scale times log2(e); ``cpu``: the interpreter's operand forms."""
    b: int
    s_cap: int
    hkv: int
    d: int
    cols: int
    spt: int
    s_tiles: int
    per_task: int
    workers: int
    n_blk: int
    bs: int
    log2_g: int
    scale_log2: float
    dtype: object
    cpu: bool


def stream_step_geometry(worker, u, geo: StreamGeometry):
    """(task, h, block, local sequence j, sequence, clamped sequence, tile index t) of step
    ``u`` of ``worker``: tasks ``worker, worker + workers, ...``, each ``spt`` sequences of
    ``s_tiles`` steps."""
    r = lax.div(u, geo.per_task)
    j = lax.rem(lax.div(u, geo.s_tiles), geo.spt)
    t = lax.rem(u, geo.s_tiles)
    task = r * geo.workers + worker
    h = lax.rem(task, geo.hkv)
    blk = lax.div(task, geo.hkv)
    seq = blk * geo.spt + j
    bc = jnp.minimum(seq, geo.b - 1)
    return task, h, blk, j, seq, bc, t


def last_tile(n, geo: StreamGeometry):
    """The last tile holding a key of a sequence of ``n`` keys (0 when empty)."""
    return jnp.maximum(lax.div(n + geo.bs - 1, geo.bs) - 1, 0)


def stream_issue_loads(u, *, w, i, h, blk, bc, tile, n_q, q_ref, k_ref, v_ref, q_smem, k_smem,
                       v_smem, q_bar, k_bar, v_bar, geo: StreamGeometry):
    """Start step ``u``'s TMA loads for worker slot ``w``: the ``[block_s, D]`` K and V tiles
    ``tile`` of (clamped) sequence ``bc``, kv head ``h``, into slot ``i`` of ``k_smem``/``v_smem``
    (barriers ``k_bar``/``v_bar``), and at a task's first step its ``[cols, D]`` queries (row block
    ``blk``) into query buffer ``w * n_q + task % n_q`` (barrier ``q_bar``).  ``q_ref [Hkv, M, D]``,
    ``k_ref/v_ref [B, S, Hkv, D]`` (with ``geo.cpu``: ``Q^T [Hkv, D, M]`` and ``V^T [B, Hkv, D,
    S]``, the interpreter's operand forms)."""
    cols, bs, cpu = geo.cols, geo.bs, geo.cpu

    @pl.when(lax.rem(u, geo.per_task) == 0)   # a task's first step: its queries
    def _():
        iq = w * n_q + lax.rem(lax.div(u, geo.per_task), n_q)
        blk_c = jnp.minimum(blk, geo.n_blk - 1)
        src = (q_ref.at[h, :, pl.ds(blk_c * cols, cols)] if cpu
               else q_ref.at[h, pl.ds(blk_c * cols, cols)])
        plgpu.copy_gmem_to_smem(src, q_smem.at[iq], q_bar.at[iq])
    plgpu.copy_gmem_to_smem(k_ref.at[bc, pl.ds(tile * bs, bs), h, :], k_smem.at[i], k_bar.at[i])
    plgpu.copy_gmem_to_smem(v_ref.at[bc, h, :, pl.ds(tile * bs, bs)] if cpu
                            else v_ref.at[bc, pl.ds(tile * bs, bs), h, :],
                            v_smem.at[i], v_bar.at[i])


def stream_fresh(geo: StreamGeometry):
    """A task's empty state: ``O^T [D, cols]``; the running max (base 2, scaled) ``[cols]``;
    the softmax sums kept per (key row, column) ``[block_s, cols]``, reduced once per task."""
    return (jnp.zeros((geo.d, geo.cols), jnp.float32),
            jnp.full((geo.cols,), -jnp.inf, jnp.float32),
            jnp.zeros((geo.bs, geo.cols), jnp.float32))


def stream_attend(state, *, k_tile, v_tile, q_tile, p_tile, key0, n, j, geo: StreamGeometry,
                  before_max, after_max):
    """One step of one worker (a compute warpgroup): ``S^T = K Q^T`` over the ``[block_s, D]``
    tile ``k_tile`` and the task's ``[cols, D]`` queries ``q_tile``, the keys ``>= n`` and the
    columns of the task's other sequences (not ``j``) masked, the online softmax down the
    columns, ``P^T`` through ``p_tile() [block_s, cols]`` (a thunk: a ref indexed outside the
    product's scope would become one of its inputs), ``O^T += V^T P^T`` (V rows past ``n``
    zeroed in shared memory first: NaN-safe).  ``before_max`` / ``after_max`` run around the
    cross-warp max.  Returns the new state."""
    acc, m_i, l_part = state
    bs, cols, d, cpu = geo.bs, geo.cols, geo.d, geo.cpu

    def scores(s_ref):   # S^T = K Q^T: [keys, cols]
        plgpu.wgmma(s_ref, k_tile, q_tile if cpu else q_tile.transpose((1, 0)))
        return s_ref[...]
    s = pl.run_scoped(scores, plgpu.ACC((bs, cols), jnp.float32))

    @pl.when(key0 + bs > n)   # zero V rows past the length (NaN-safe)
    def _():
        keys = wgmma_iota((d, bs), 1, hint=False) if cpu else wgmma_iota((bs, d), 0)
        v_tile[...] = jnp.where(key0 + keys < n, v_tile[...], jnp.zeros_like(v_tile[...]))
        plgpu.commit_smem()
    keys = key0 + wgmma_iota((bs, cols), 0, hint=not cpu)
    valid = keys < n
    if geo.spt > 1:   # columns of the other sequences of the task see no key
        col = wgmma_iota((bs, cols), 1, hint=not cpu)
        col_seq = lax.shift_right_logical(col, geo.log2_g)
        valid = valid & (col_seq == j)
    sv = jnp.where(valid, s, -jnp.inf)
    before_max()
    m_new = jnp.maximum(m_i, sv.max(axis=0) * geo.scale_log2)
    after_max()
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    prob = jnp.exp2(sv * geo.scale_log2 - lax.broadcast_in_dim(m_use, sv.shape, [1]))
    l_part = l_part * lax.broadcast_in_dim(alpha, sv.shape, [1]) + prob
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    p_tile()[...] = prob.astype(geo.dtype)
    plgpu.commit_smem()
    acc = wg_accumulate(   # O^T += V^T P^T
        acc, lambda: (v_tile if cpu else v_tile.transpose((1, 0)), p_tile()), cpu_check=cpu)
    return acc, m_new, l_part


def stream_finish(state, *, o_dst, lse_dst, o_stage, geo: StreamGeometry, before_sum, after_sum):
    """A task's end: reduce the softmax sums, normalise, write ``O^T`` to ``o_dst [D, cols]``
    (from registers with ``o_stage=None``, else staged through ``o_stage`` and TMA) and the
    natural-log LSE to ``lse_dst [cols]`` (``-inf`` and 0 for columns that saw no key).
    ``before_sum`` / ``after_sum`` run around the cross-warp sum."""
    acc, m_i, l_part = state
    before_sum()
    l_i = l_part.sum(axis=0)
    after_sum()
    empty = l_i == 0.0   # (a NaN score leaves l NaN: the column's lse is NaN, not -inf)
    l_safe = jnp.where(empty, 1.0, l_i)
    o_val = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(geo.dtype)
    if o_stage is None:   # no staging buffer: from registers
        store_gmem(o_dst, o_val)
    else:
        plgpu.wait_smem_to_gmem(0)     # the staging buffer's previous store
        o_stage[...] = o_val
    store_gmem(lse_dst, jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2))
    if o_stage is not None:
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_stage, o_dst)
