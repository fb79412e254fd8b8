"""Decode suffix attention streamed by a few persistent CTAs (Pallas Mosaic GPU; EXPERIMENTAL,
not dispatched: see "Status").

For decoding (one query per sequence) with GQA group ``G = Hq / Hkv``, every (sequence, kv
head) attends over its own suffix keys ``[0, s_len[b])``.  That part of the shared-prefix path
is bound by HBM bandwidth (each suffix K/V byte is read once), while the prefix part is bound
by the tensor cores.  This kernel computes the suffix part on only ``ctas`` SMs, so that the
persistent prefix kernel (``prefix_attention_mgpu.prefix_partials_mgpu(persistent_ctas=n)``)
can hold the others at the same time: a split of the SMs by role.

Why a kernel of its own: session 20 ran the Triton-lowered suffix kernel beside a persistent
prefix kernel and it hid at most 35 of its 100 us.  A load-only probe (session 21,
``bench/results/logs/session21_probe_stream_h100.jsonl``, H100) found that persistent CTAs with
a deep TMA pipeline read the suffix at 2.35 TB/s on 20 SMs and 2.56 TB/s on 24 (2.67 TB/s on
all 132), and that such a load-only stream on 16-24 SMs beside the prefix on 108-116 took
0.181-0.188 ms at Hq=32 B=512 P=8K S=128 where the default path takes 0.223 ms: a few SMs can stream nearly
all of HBM's bandwidth if they keep enough bytes in flight.

Products ("swap AB", as ``decoupled_decode_mgpu``'s suffix warpgroup): for a task's sequence
``b`` and kv head ``h``, ``S^T = K Q^T`` is ``[block_s keys, COLS]`` (wgmma M = the keys, N =
COLS query rows), the online softmax runs down the columns, and ``O^T += V^T P^T`` is
``[D, COLS]``.  ``COLS = max(16, G)``: a task is ``COLS / G`` consecutive sequences of one kv
head (rows ``blk * COLS ..`` of ``q_hmd[h]``), walked one after another into one state whose
columns belong to them in turn (a column only sees keys while its own sequence is walked).  The
running max is reduced across the key rows every step; the softmax sums are kept per (key row,
column) and reduced once per task.

Kernel: ``ctas`` CTAs of ``wgs + 1`` warpgroups: ``wgs`` (1, 2 or 3) compute warpgroups, each a
*worker* with its own tasks (worker ``wgs c + w`` takes tasks ``worker, worker + wgs ctas,
...``: task ``i`` is block ``i // Hkv`` of kv head ``i % Hkv``, so concurrent workers read
neighbouring rows of the cache), and one memory warpgroup that keeps ``stages`` steps of each
worker in flight (per step and worker: a ``[block_s, D]`` K tile and V tile, each with its own
barrier, and at a task's first step its ``[COLS, D]`` queries into one of ``n_q`` buffers; a
"free" barrier per slot, arrived on by the worker after its ``P V``).  Steps form a static
``rounds x (COLS/G) x S/block_s`` grid per worker, so barrier phases never depend on the
lengths; each sequence's length is read once, at its first step; a tile wholly past its
sequence's length loads the last valid tile again (an L2 hit) and skips the math; ``V`` rows
past a length are zeroed in shared memory before ``P V`` (NaN in the cache there never reaches
the output).

Two compute warpgroups and Mosaic GPU's reduction scratch: a cross-warp reduction (the max runs
down the key rows, which span the warpgroup's 4 warps) uses a shared-memory scratch placed at
the allocation top where it is lowered, the same for both warpgroups, so reductions running at
once in both race on it (measured on the GPU: wrong outputs at random, 3-143 of 560 (sequence,
kv head) pairs, ``session21_stream_diag*_h100.jsonl``).  Two remedies, both exact: a token
passed through two barriers makes two warpgroups' reductions take turns (the default with two),
or ``separate_scratch=True`` traces warpgroup ``w``'s code inside ``w`` nested collective padding
allocations, so each one's scratch lies elsewhere (1-3% faster with two; what three use).

Layouts: ``q_hmd [Hkv, M, D]`` row ``b * G + j`` is query head ``h * G + j`` of sequence ``b``
(``M >= ceil(B G / COLS) COLS``, rows past ``B G`` zero or anything finite), suffix
``k/v [B, S, Hkv, D]`` (``S % block_s == 0``), ``s_len [B]`` int32 (dynamic, in ``[0, S]``).
Returns ``o [1, Hkv, B * G, D]`` (q's dtype, normalised) and ``lse [1, Hkv, B * G]`` float32
natural log, the row layout of :func:`pallas_kernels.prefix_attention._merge_row_parts`;
``lse = -inf`` and ``o = 0`` for a sequence with no suffix key.  ``interpret=True`` runs Mosaic
GPU's CPU interpreter (``Q^T`` and ``V^T`` then transposed in memory: its wgmma reads no
transposed ref).  The pure-JAX reference is :func:`jax_prefix_attn.reference.attention` over each
sequence's suffix (the tests use a float64 NumPy one).

Static arguments: every shape, ``group``, ``ctas``, ``stages``, ``wgs``, ``block_s``,
``separate_scratch``, ``scale``; one compile per combination.

Status (session 21, H100, ``bench/results/logs/session21_*``): exact (GPU and interpreter tests
against float64) but, on few SMs, bound by the latency of each step's compute, not by memory.
Hq=32/Hkv=8 B=512 S=128 (268 MB of suffix K/V) on 24 CTAs: two workers 0.20-0.23 ms = 1.19-1.32
TB/s, three workers 0.179 ms = 1.50 TB/s (one worker with 128-key steps 0.23-0.25 ms, with
64-key steps 0.31 ms), while the same kernel without its math streams 2.12-2.35 TB/s there; on
all 132 SMs 0.117-0.123 ms, 0.88-0.91x the speed of the Triton-lowered suffix kernel
(0.106-0.108 ms).  Each worker's step is a dependent chain (wait, ``S^T`` wgmma, cross-warp max,
``exp2``, ``P^T`` to shared memory, ``P V`` wgmma) of about 0.6 us per 32 KB, so more workers
per SM stream faster; three is what shared memory holds at D = 128 with two stages.  The space
split built on it (persistent prefix on n CTAs beside this kernel on m, XLA's concurrent
scheduling, one merge; ``session21_probe_split.py``): with three workers, 0.196 ms against the
default's 0.223 at Hq=32 B=512 P=8K S=128 (0.88x; n=108, m=24; 0.85x with n=104, m=28 in
``..._split_d_...``), but 1.24x at B=256 P=4K S=128, 1.74x at B=1024 P=4K S=128
(``..._split_c_h100.jsonl``) and 1.04x at B=256 P=16K S=256 (``_d_``); with two workers
1.01-1.40x (``..._split_b_...``).  It needs the two launches to run concurrently (``CONCURRENT_COMPILER_OPTIONS``;
in sequence it takes 1.5x the default), so nothing dispatches it; a one-launch form (prefix and
stream roles as CTAs of one kernel) would not depend on XLA's scheduling.  Session 22 built it:
``split_decode_mgpu`` runs this module's per-step math (:func:`stream_step_geometry`,
:func:`stream_attend`, :func:`stream_finish`) in its stream role, with self-issuing workers.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.prefix_attention_mgpu import (_gpu_interpret_params, plgpu, wg_accumulate,
                                                   wgmma_iota)

__all__ = ["stream_supported", "suffix_stream_mgpu", "BLOCK_S", "cols_for", "StreamGeometry",
           "stream_step_geometry", "stream_step_of", "stream_fresh", "stream_attend",
           "stream_finish", "stream_issue_loads", "last_tile"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
BLOCK_S = 64   # suffix keys per tile (the swapped product's M)


def cols_for(group: int) -> int:
    """Query rows per task (the swapped products' N): ``max(16, G)`` (a ``P^T`` tile of fewer
    than 16 columns has 16-byte rows, which no wgmma shared-memory swizzle takes)."""
    return max(16, int(group))


def stream_supported(*, heads_q: int, heads_kv: int, suffix_cap: int, head_dim: int,
                     dtype) -> str | None:
    """``None`` when :func:`suffix_stream_mgpu` handles these static shapes, else the reason."""
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


def _n_q(stages: int, per_task: int) -> int:
    """Query buffers per worker: task ``r``'s queries are loaded at its first step ``u0``,
    which waits for step ``u0 - stages`` to be consumed; the buffer's previous task
    (``r - n_q``) ended at step ``u0 - (n_q - 1) * per_task - 1``, so
    ``n_q - 1 >= (stages - 1) / per_task``."""
    return min(stages, 1 + -(-(stages - 1) // per_task))


def _smem_bytes(stages: int, n_q: int, cols: int, d: int, itemsize: int, wgs: int = 2,
                bs: int = BLOCK_S) -> int:
    """Shared memory of the buffers (with three workers ``O^T`` is stored from registers)."""
    o_stage = 0 if wgs == 3 else d * cols
    return itemsize * wgs * (stages * 2 * bs * d + n_q * cols * d + bs * cols + o_stage)


def _red_bytes(wgs: int) -> int:
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


def stream_step_of(worker, u, n_prev, *, read_len, geo: StreamGeometry):
    """(task, h, block, local sequence j, clamped sequence, its keys, tile to load, key0) of
    step ``u`` of ``worker``.  ``read_len(seq)`` reads a sequence's length; it is called only at
    a sequence's first step (``n_prev``, the value carried from the previous step, otherwise),
    off the per-step path.  A tile wholly past the length loads the last valid tile again (an
    L2 hit; its math is skipped)."""
    task, h, blk, j, seq, bc, t = stream_step_geometry(worker, u, geo)
    n = (lax.cond(t == 0, lambda: read_len(seq), lambda: n_prev) if geo.s_tiles > 1
         else read_len(seq))
    last = last_tile(n, geo)
    return task, h, blk, j, bc, n, jnp.minimum(t, last), t * geo.bs


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
    cross-warp max (the two-worker token).  Returns the new state."""
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
    has = l_i > 0.0
    l_safe = jnp.where(has, l_i, 1.0)
    o_val = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(geo.dtype)
    if o_stage is None:   # no staging buffer: from registers
        o_dst[...] = o_val
    else:
        plgpu.wait_smem_to_gmem(0)     # the staging buffer's previous store
        o_stage[...] = o_val
    lse_dst[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
    if o_stage is not None:
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_stage, o_dst)


def suffix_stream_mgpu(q_hmd, sk_bshd, sv_bshd, s_len, *, scale: float, group: int, ctas: int,
                       stages: int | None = None, wgs: int = 2, block_s: int = BLOCK_S,
                       separate_scratch: bool = False, interpret: bool = False,
                       _debug: str = ""):
    """Suffix attention states of every row on ``ctas`` persistent CTAs; see the module
    docstring for layouts, outputs and the options.  ``stages``: steps in flight per worker
    (each step ``2 * block_s * D`` elements of K/V; None: the most, up to 4, that fit in shared
    memory).  ``wgs``: compute warpgroups (workers) per CTA, 1, 2 or 3 (3: ``separate_scratch``
    implied, 1 KB of reduction scratch each, ``O^T`` stored from registers; two stages fit at
    D = 128).  ``block_s``: keys per
    step, 64 or 128.  ``_debug`` (timing probes only, inexact): ``"nolen"`` reads no length,
    ``"nomath"`` skips the attention and writes nothing.

    Raises ``ValueError`` for shapes outside :func:`stream_supported`, ``M`` too small, or
    ``ctas``/``stages``/``wgs``/``block_s`` out of range."""
    hkv, m, d = q_hmd.shape
    b, s_cap = sk_bshd.shape[:2]
    g = int(group)
    dtype = q_hmd.dtype
    why = stream_supported(heads_q=hkv * g, heads_kv=hkv, suffix_cap=s_cap, head_dim=d, dtype=dtype)
    if why is not None:
        raise ValueError(f"suffix_stream_mgpu cannot run these shapes: {why}")
    if sk_bshd.shape != (b, s_cap, hkv, d) or sv_bshd.shape != sk_bshd.shape:
        raise ValueError(f"suffix k/v must have shape {(b, s_cap, hkv, d)}, got "
                         f"{sk_bshd.shape} and {sv_bshd.shape}")
    cols = cols_for(g)
    spt = cols // g                               # sequences per task
    n_blk = -(-b * g // cols)
    if m < n_blk * cols:
        raise ValueError(f"q_hmd has {m} rows; needs at least {n_blk * cols}")
    n_tasks = n_blk * hkv
    wgs, bs = int(wgs), int(block_s)
    if wgs not in (1, 2, 3) or bs not in (64, 128) or s_cap % bs:
        raise ValueError(f"wgs={wgs} must be 1, 2 or 3 and block_s={bs} 64 or 128 dividing the "
                         f"suffix capacity {s_cap}")
    separate_scratch = bool(separate_scratch) or wgs == 3   # (the token serves two)
    red = _red_bytes(wgs)
    # Hopper's per-CTA shared memory, less the reduction scratch areas and room for barriers
    smem_limit = 232448 - 1024 - max(2, wgs) * red
    workers = wgs * int(ctas)
    if not 1 <= int(ctas) or workers > wgs * n_tasks:
        raise ValueError(f"ctas={ctas} must be in [1, {n_tasks}]")
    rounds = -(-n_tasks // workers)
    s_tiles = s_cap // bs
    per_task = spt * s_tiles
    n_steps = rounds * per_task                   # static steps per worker
    isz = jnp.dtype(dtype).itemsize
    if stages is None:
        stages = max([st for st in (1, 2, 3, 4)
                      if _smem_bytes(st, _n_q(st, per_task), cols, d, isz, wgs, bs) <= smem_limit])
    stages = int(stages)
    n_q = _n_q(stages, per_task) if stages >= 1 else 1
    if not 1 <= stages <= 4 or _smem_bytes(stages, n_q, cols, d, isz, wgs, bs) > smem_limit:
        raise ValueError(f"stages={stages} must be in [1, 4] and fit in shared memory")
    scale_log2 = float(scale) * _LOG2E
    log2_g = g.bit_length() - 1
    sk_bshd = sk_bshd.astype(dtype)
    sv_bshd = sv_bshd.astype(dtype)
    s_len = jnp.asarray(s_len, jnp.int32).reshape(b)
    cpu = bool(interpret)   # the interpreter's wgmma reads no transposed ref: Q^T, V^T in memory
    geo = StreamGeometry(b=b, s_cap=s_cap, hkv=hkv, d=d, cols=cols, spt=spt, s_tiles=s_tiles,
                         per_task=per_task, workers=workers, n_blk=n_blk, bs=bs, log2_g=log2_g,
                         scale_log2=scale_log2, dtype=dtype, cpu=cpu)
    if cpu:
        q_hmd = jnp.transpose(q_hmd, (0, 2, 1))          # [Hkv, D, M]
        sv_bshd = jnp.transpose(sv_bshd, (0, 2, 3, 1))   # [B, Hkv, D, S]

    def kernel(slen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, k_smem, v_smem, q_smem, p_smem,
               o_smem, k_bar, v_bar, q_bar, free_bar, token):
        c = lax.axis_index("c")
        wg = lax.axis_index("wg")

        def read_len(seq):
            """Valid keys of (possibly padding) sequence ``seq``: a global-memory read."""
            if "nolen" in _debug:   # (timing probes only)
                return jnp.where(seq < b, s_cap, 0)
            return jnp.where(seq < b, slen_ref[jnp.minimum(seq, b - 1)], 0)

        def step_of(worker, u, n_prev):
            return stream_step_of(worker, u, n_prev, read_len=read_len, geo=geo)

        # ------------------------------------------------------------------ memory warpgroup
        def memory():
            def mem_step(u, lens):
                slot = lax.rem(u, stages)
                new_lens = []
                for w in range(wgs):
                    worker = wgs * c + w
                    _, h, blk, _, bc, n, tile, _ = step_of(worker, u, lens[w])
                    new_lens.append(n)
                    i = w * stages + slot

                    @pl.when(u >= stages)
                    def _():
                        plgpu.barrier_wait(free_bar.at[i])

                    stream_issue_loads(u, w=w, i=i, h=h, blk=blk, bc=bc, tile=tile, n_q=n_q,
                                       q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, q_smem=q_smem,
                                       k_smem=k_smem, v_smem=v_smem, q_bar=q_bar, k_bar=k_bar,
                                       v_bar=v_bar, geo=geo)
                return tuple(new_lens)
            lax.fori_loop(0, n_steps, mem_step, (jnp.int32(0),) * wgs)
            # the slots' last "free" phases (the workers' last steps): waited on so that every
            # phase of every barrier is observed (the CPU interpreter checks it)
            for w in range(wgs):
                for slot in range(min(stages, n_steps)):
                    plgpu.barrier_wait(free_bar.at[w * stages + slot])

        # ------------------------------------------------------------------ compute warpgroups
        def compute(wg: int):
            """Compute warpgroup ``wg`` (a Python int: each is traced on its own, see below)."""
            worker = wgs * c + wg

            # Mosaic GPU places the shared-memory scratch of a cross-warp reduction (the online
            # softmax's max runs down the key rows, which span the warpgroup's 4 warps) at the
            # allocation top where it is lowered: the same for both compute warpgroups, so
            # reductions running at once in both race on it (measured: wrong outputs at
            # random).  A token passed between the two warpgroups through two barriers makes
            # their reductions take turns: each takes it once per step and once more at a
            # task's last step (the same steps for both), warpgroup 0 first.
            def take_token(first):
                if wgs == 1 or separate_scratch:
                    return
                if wg == 0:
                    pl.when(jnp.logical_not(first))(lambda: plgpu.barrier_wait(token.at[0]))
                else:
                    plgpu.barrier_wait(token.at[1])

            def pass_token():
                if wgs == 2 and not separate_scratch:
                    plgpu.barrier_arrive(token.at[1 - wg])

            def fresh():
                return stream_fresh(geo)

            def step(u, carry):
                n_prev, state = carry
                task, _, _, j, _, n, _, key0 = step_of(worker, u, n_prev)
                i = wg * stages + lax.rem(u, stages)
                iq = wg * n_q + lax.rem(lax.div(u, per_task), n_q)

                @pl.when(lax.rem(u, per_task) == 0)
                def _():
                    plgpu.barrier_wait(q_bar.at[iq])
                plgpu.barrier_wait(k_bar.at[i])
                plgpu.barrier_wait(v_bar.at[i])
                k_tile, v_tile, q_tile = k_smem.at[i], v_smem.at[i], q_smem.at[iq]

                def attend(acc, m_i, l_part):
                    return stream_attend(
                        (acc, m_i, l_part), k_tile=k_tile, v_tile=v_tile, q_tile=q_tile,
                        p_tile=lambda: p_smem.at[wg], key0=key0, n=n, j=j, geo=geo,
                        before_max=lambda: take_token(u == 0), after_max=pass_token)

                def skip(*state):
                    take_token(u == 0)
                    pass_token()
                    return state

                if "nomath" in _debug:   # (timing probes only: the memory side alone)
                    acc, m_i, l_part = state
                else:
                    acc, m_i, l_part = lax.cond(key0 < n, attend, skip, *state)
                plgpu.barrier_arrive(free_bar.at[i])
                last_step = lax.rem(u, per_task) == per_task - 1

                def finish(acc, m_i, l_part):   # the task's state: normalise and write it
                    stream_finish((acc, m_i, l_part), o_dst=o_ref.at[task], lse_dst=lse_ref.at[task],
                                  o_stage=None if wgs == 3 else o_smem.at[wg],
                                  before_sum=lambda: take_token(jnp.bool_(False)),
                                  after_sum=pass_token, geo=geo)
                    return fresh()

                if "nomath" not in _debug:
                    acc, m_i, l_part = lax.cond(last_step, finish, lambda *a: a, acc, m_i, l_part)
                return n, (acc, m_i, l_part)

            lax.fori_loop(0, n_steps, step, (jnp.int32(0), fresh()))
            plgpu.wait_smem_to_gmem(0)
            if wgs == 2 and not separate_scratch and wg == 0 and "nomath" not in _debug:
                plgpu.barrier_wait(token.at[0])   # warpgroup 1's last pass (see take_token)

        if separate_scratch and wgs > 1:
            # Warpgroup w's code is traced inside w nested collective allocations of one
            # reduction scratch's size, so the compute warpgroups' cross-warp reduction scratch
            # lies at different offsets.  Each allocation's CTA barrier is at its entry: they
            # all come first, so every warpgroup passes them before any work.
            def place(w):
                if w < wgs - 1:
                    pl.run_scoped(lambda _pad: place(w + 1), plgpu.SMEM((red // 4,), jnp.float32),
                                  collective_axes="wg")
                pl.when(wg == w)(functools.partial(compute, w))
            place(0)
        else:
            for w in range(wgs):
                pl.when(wg == w)(functools.partial(compute, w))
        pl.when(wg == wgs)(memory)

    n_out = rounds * workers
    scratch = (plgpu.SMEM((wgs * stages, bs, d), dtype),
               plgpu.SMEM((wgs * stages,) + ((d, bs) if cpu else (bs, d)), dtype),
               plgpu.SMEM((wgs * n_q,) + ((d, cols) if cpu else (cols, d)), dtype),
               plgpu.SMEM((wgs, bs, cols), dtype),
               plgpu.SMEM((wgs, d, cols) if wgs < 3 else (1, 16, cols), dtype),   # (unused at 3)
               plgpu.Barrier(num_barriers=wgs * stages),
               plgpu.Barrier(num_barriers=wgs * stages),
               plgpu.Barrier(num_barriers=wgs * n_q),
               plgpu.Barrier(num_barriers=wgs * stages),
               plgpu.Barrier(num_barriers=2))
    o_t, lse_t = plgpu.kernel(
        kernel,
        grid=(int(ctas),),
        grid_names=("c",),
        num_threads=wgs + 1,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((n_out, d, cols), dtype),
                  jax.ShapeDtypeStruct((n_out, cols), jnp.float32)),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=red,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": _gpu_interpret_params()} if interpret else {}),
    )(s_len, q_hmd, sk_bshd, sv_bshd)
    # task i = block i // Hkv of kv head i % Hkv -> the row layout [1, Hkv, B * G(, D)]
    o = o_t[:n_tasks].reshape(n_blk, hkv, d, cols)
    o = jnp.transpose(o, (1, 0, 3, 2)).reshape(hkv, n_blk * cols, d)[None, :, :b * g]
    lse = jnp.swapaxes(lse_t[:n_tasks].reshape(n_blk, hkv, cols), 0, 1).reshape(hkv, n_blk * cols)
    return o, lse[None, :, :b * g]
