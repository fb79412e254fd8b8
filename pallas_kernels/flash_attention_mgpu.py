"""Flash attention forward through Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation),
FlashAttention-3 style, returning ``(out, lse)``.

Public entry: :func:`flash_attention_mgpu` (kernel and a thin wrapper: no dispatch policy);
:func:`supported` says whether it runs given shapes (``None``) or why not.

Contract (that of :func:`pallas_kernels.flash_attention.flash_attention`'s forward):
``q [B, Tq, Hq, D]``, ``k/v [B, Tk, Hkv, D]`` (``Hq % Hkv == 0``, cast to ``q``'s dtype);
returns ``out [B, Tq, Hq, D]`` in ``q``'s dtype and ``lse [B, Tq, Hq]`` float32, natural log.
The causal mask is bottom-right aligned to each sequence's valid length ``L_b``
(``kv_lengths``, default ``Tk``): query ``i`` sees keys ``j < L_b`` with ``j <= i + L_b - Tq``.
Keys at or past ``L_b`` never reach the result (they may hold NaN).  A row that sees no key gets
``lse = -inf`` and ``out = 0``.  Inputs are bfloat16 or float16; head_dim 64, 128 or 256 (other
widths up to 256 are zero-padded to the next one, which leaves every score unchanged).

Rows: the ``G = Hq / Hkv`` query heads of one kv head share a CTA, so its K/V tiles are loaded
once per group.  A compute warpgroup's ``block_q`` rows are, when ``per = block_q / G`` is a
multiple of 8 (``G`` = 1, 2, 4, 8 at ``block_q = 64``), ``per`` query positions of each of the
``G`` heads (head-major), copied by ``G`` TMA loads straight from ``q [B, Tq, Hq, D]`` and
stored back to ``out`` of the same layout (``Tq`` padded to ``2 * per`` only when it is not a
multiple); otherwise the wrapper folds the heads into rows, ``q_rows [B, Hkv, Tq * G, D]`` with
row ``t * G + j`` = position ``t``, head ``h * G + j`` (one transpose of ``q`` and one of
``out``).  The LSE leaves the kernel in the rows' order and is put in ``[B, Tq, Hq]`` by XLA.
The wrapper pads ``Tk`` to a multiple of ``block_kv`` and, when ``kv_lengths`` is given, zeroes
the values past each length (the last key tile of a sequence is read whole; its masked scores
get weight 0, and 0 times a NaN would still be NaN).

Schedule: grid ``(Hkv, B, row blocks of 2 * block_q rows)``, the row blocks of a causal call in decreasing
order (the CTAs with the most key tiles start first).  Each CTA has three warpgroups: one memory
warpgroup streams the key tiles ``[0, n)`` of its (batch, kv head) through a ring of
``num_stages`` shared-memory K/V buffers by TMA, with one "loaded" barrier per slot and one
"consumed" barrier per slot and operand (``emit_pipeline_warp_specialized``); ``n`` is dynamic:
the tiles that some row of the CTA sees (causal blocks past the diagonal and tiles past the
length are never loaded).  Two compute warpgroups each own ``block_q`` rows (their ``Q`` loaded
once by TMA) and, per key tile, run ``S = Q K^T`` (wgmma, float32 accumulator in registers),
the online softmax in base 2 with the scale folded in (``p = exp2(s * scale * log2(e) - m)``,
one fused multiply-add per score; the mask is built only on tiles where some entry is masked),
and ``O += P V`` (wgmma with ``P`` from registers).  A two-arrival barrier makes the compute
warpgroups take turns on the tensor cores, warpgroup 1 one phase behind: one issues its matrix
products while the other runs its softmax (FlashAttention-3's ping-pong).  In a causal CTA a
warpgroup whose rows see none of a tile's keys skips its matrix products and softmax for that
tile (it only releases the buffers and keeps its turns).  The output is normalised in registers,
written through the queries' shared-memory buffer and stored by TMA, the LSE likewise.

Tunable: ``block_q`` (rows per compute warpgroup, a multiple of 64), ``block_kv`` (keys per
tile, a multiple of 64 up to 256; default 128, 64 at head_dim 256), ``num_stages`` (K/V ring
depth, default 2), ``schedule_barrier`` (the ping-pong).  Their product must fit the 227 KiB
of shared memory of a Hopper SM (:func:`smem_bytes`).

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter with the operand forms it
has: ``K`` pre-transposed in memory for ``Q K^T`` instead of a transposed shared-memory view, and
``P`` staged through shared memory with ``P V`` into a fresh accumulator instead of in place.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, cdiv, pad_axis
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu
from pallas_kernels.prefix_attention_mgpu import (masked_softmax_step, take_turn,
                                                  wg_accumulate_pv, wg_pipeline, wg_scores,
                                                  wgmma_iota)

__all__ = ["flash_attention_mgpu", "check_qkv", "supported", "smem_bytes", "default_block_kv",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "SMEM_LIMIT"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory one CTA may use on a Hopper SM (sm_90: 227 KiB of the 228).
SMEM_LIMIT = 227 * 1024
# Shared-memory buffers start on 1 KiB boundaries (128-byte swizzle); barriers and the nested
# allocation scopes take about 2 KiB more.
_SMEM_ALIGN = 1024
_SMEM_SLACK = 2304


def default_block_kv(head_dim: int) -> int:
    """Keys per tile when the caller does not say: 128, or 64 at head_dim 256 (two stages of
    128-key tiles of that width do not fit next to the queries)."""
    return 64 if head_dim > 128 else 128


def smem_bytes(head_dim: int, dtype, *, block_q: int, block_kv: int, num_stages: int,
               interpret: bool = False) -> int:
    """Bytes of shared memory of one CTA (an upper estimate): two warpgroups' query/output
    tiles ``[block_q, D]`` and LSE rows, ``num_stages`` K and V tiles ``[block_kv, D]`` (and in
    interpret mode the staged ``P`` tiles), each aligned, and the barriers."""
    item = jnp.dtype(dtype).itemsize
    buffers = [2 * block_q * head_dim * item, 2 * block_q * 4]
    buffers += [num_stages * block_kv * head_dim * item] * 2
    if interpret:
        buffers.append(2 * block_q * block_kv * item)
    return sum(cdiv(x, _SMEM_ALIGN) * _SMEM_ALIGN for x in buffers) + _SMEM_SLACK


def supported(q_shape, k_shape, dtype) -> str | None:
    """``None`` when :func:`flash_attention_mgpu` runs ``q [B, Tq, Hq, D]`` against
    ``k/v [B, Tk, Hkv, D]`` of ``dtype`` with its default tiles, else the reason it cannot."""
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not available"
    if len(q_shape) != 4 or len(k_shape) != 4:
        return f"q and k must have rank 4, got shapes {q_shape} and {k_shape}"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if not 1 <= q_shape[3] <= SUPPORTED_HEAD_DIMS[-1]:
        return f"head_dim must be in [1, {SUPPORTED_HEAD_DIMS[-1]}], got {q_shape[3]}"
    if 0 in (q_shape[0], q_shape[1], k_shape[1]):
        return f"needs a batch, a query and a key, got q {q_shape} and k {k_shape}"
    if k_shape[2] < 1 or q_shape[2] % k_shape[2]:
        return f"heads_q must be a multiple of heads_kv, got {q_shape[2]} and {k_shape[2]}"
    return None


def check_qkv(q, k, v) -> None:
    """``q [B, Tq, Hq, D]``, ``k``/``v [B, Tk, Hkv, D]``: arrays of rank 4, ``k`` and ``v`` of one
    shape, ``q`` and ``k`` of one batch and head_dim (``TypeError``/``ValueError`` naming them)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and "
                         f"head_dim")


def _check_args(q, k, v, kv_lengths, block_q, block_kv, num_stages):
    check_qkv(q, k, v)
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"flash_attention_mgpu supports q dtypes bfloat16 and float16 (Hopper "
                        f"wgmma on 16-bit operands), got {q.dtype}")
    why = supported(q.shape, k.shape, q.dtype)
    if why is not None:
        raise ValueError(f"flash_attention_mgpu cannot run these shapes: {why}")
    if kv_lengths is not None and (not hasattr(kv_lengths, "shape")
                                   or tuple(kv_lengths.shape) != (q.shape[0],)
                                   or not jnp.issubdtype(kv_lengths.dtype, jnp.integer)):
        raise ValueError(f"kv_lengths must be an integer array of shape [{q.shape[0]}], got "
                         f"{getattr(kv_lengths, 'shape', type(kv_lengths).__name__)}")
    for name, val, ok, want in (
            ("block_q", block_q, lambda x: x >= 64 and x % 64 == 0, "a positive multiple of 64"),
            ("block_kv", block_kv, lambda x: 64 <= x <= 256 and x % 64 == 0,
             "a multiple of 64 in [64, 256]"),
            ("num_stages", num_stages, lambda x: 2 <= x <= 8, "in [2, 8]")):
        if isinstance(val, bool) or not isinstance(val, int) or not ok(val):
            raise ValueError(f"{name} must be {want}, got {val!r}")


def _key_tiles(pos_first, pos_last, length, *, tq: int, block_kv: int, causal: bool):
    """Key tiles of the queries at positions ``[pos_first, pos_last]`` (traced scalars):
    ``(n_full, n_end)``, tiles ``[0, n_full)`` seen whole by each of them, ``[n_full, n_end)``
    by some, none past ``n_end``."""
    if causal:
        diag = length - tq                      # query t sees keys j <= t + diag
        end_all = jnp.clip(jnp.minimum(pos_first, tq - 1) + diag + 1, 0, length)
        end_any = jnp.clip(jnp.minimum(pos_last, tq - 1) + diag + 1, 0, length)
    else:
        end_all = end_any = length
    n_end = lax.div(end_any + block_kv - 1, block_kv)
    return jnp.minimum(end_all // block_kv, n_end), n_end


class _Rows:
    """Which query rows a compute warpgroup owns (``block`` = its index along the rows of its
    (batch, kv head), ``block_q`` rows each; ``group`` query heads per kv head).

    * sliced (``per = block_q / group`` a multiple of 8): positions ``block * per + [0, per)``
      of the ``group`` heads, head-major (row ``j * per + i``: head ``h * group + j``, position
      ``block * per + i``), each head's ``per`` rows copied by TMA straight from ``q [B, Tq,
      Hq, D]`` and back to ``out`` of that layout;
    * folded (other groups): rows ``block * block_q + [0, block_q)`` of the wrapper's
      ``q_rows [B, Hkv, R, D]`` (row ``t * group + j``)."""

    def __init__(self, block_q: int, group: int):
        self.block_q, self.group = block_q, group
        self.sliced = block_q % (8 * group) == 0
        self.per = block_q // group if self.sliced else None

    def positions(self, block):
        """First and last query position of the rows of ``block`` (traced)."""
        if self.sliced:
            return block * self.per, block * self.per + self.per - 1
        r0 = block * self.block_q
        return r0 // self.group, (r0 + self.block_q - 1) // self.group

    def position_of_row(self, block, row):
        """Query position of the local rows ``row`` (an int32 array) of ``block``."""
        if self.sliced:
            return block * self.per + (row if self.group == 1 else lax.rem(row, self.per))
        r = block * self.block_q + row
        return r if self.group == 1 else r // self.group

    def copies(self, ref, smem, *, b, h, block):
        """``(gmem, smem)`` pairs of the rows of ``block`` of kv head ``h`` of sequence ``b`` in
        ``ref`` (``q`` or ``out``) and in the warpgroup's ``smem [block_q, D]``."""
        if not self.sliced:
            return [(ref.at[b, h, pl.ds(block * self.block_q, self.block_q)], smem)]
        return [(ref.at[b, pl.ds(block * self.per, self.per), h * self.group + j],
                 smem.at[pl.ds(j * self.per, self.per)]) for j in range(self.group)]


def _tile_step(carry, *, t, n_full, n_end, pos_of_row, length, q_smem, k_smem, v_smem, p_smem,
               k_consumed, v_consumed, turn, static, cpu_check: bool):
    """Key tile ``t`` for one compute warpgroup (query positions ``pos_of_row(rows iota)``):
    the products and the online softmax, or, for a tile none of its rows sees, only the buffer
    releases and the two ping-pong turns.  Returns the new ``(acc, m, l)``."""
    causal, tq, _, block_kv, scale_log2, sched = static
    rows = q_smem.shape[0]

    def valid():
        key = t * block_kv + wgmma_iota((rows, block_kv), 1, hint=not cpu_check)
        ok = key < length
        if causal:
            pos = pos_of_row(wgmma_iota((rows, block_kv), 0, hint=not cpu_check))
            ok = ok & (key <= pos + (length - tq))
        return ok

    def compute(carry):
        s = wg_scores(q_smem, k_smem, shape=(rows, block_kv), cpu_check=cpu_check,
                      after_issue=turn)
        plgpu.barrier_arrive(k_consumed)
        acc, m_new, l_new, p16 = masked_softmax_step(s, valid, t >= n_full, carry,
                                                     scale_log2=scale_log2, dtype=q_smem.dtype)
        if sched:  # softmax done: wait for the tensor cores' turn
            acc, m_new, l_new, p16 = lax.optimization_barrier((acc, m_new, l_new, p16))
            turn()
        acc = wg_accumulate_pv(acc, p16, v_smem, p_smem, cpu_check=cpu_check)
        plgpu.barrier_arrive(v_consumed)
        return acc, m_new, l_new

    if not causal:  # every warpgroup sees every loaded tile
        return compute(carry)

    def skip(carry):
        turn()
        plgpu.barrier_arrive(k_consumed)
        if sched:
            turn()
        plgpu.barrier_arrive(v_consumed)
        return carry
    return lax.cond(t < n_end, compute, skip, carry)


def _compute_context(*, q_copies, o_copies, q_smem, q_barrier, lse_smem, lse_dst, before, after):
    """The compute warpgroup's part around the pipeline: its queries loaded by TMA
    (``q_copies``, all arriving on ``q_barrier``), the pipeline run from the empty state, the
    output normalised and stored through ``q_smem`` (``o_copies``) and the natural-log LSE
    (``-inf`` for rows that saw no key) through ``lse_smem`` to ``lse_dst``."""
    block_q, d = q_smem.shape

    def context(run_pipeline):
        for src, dst in q_copies:
            plgpu.copy_gmem_to_smem(src, dst, q_barrier)
        plgpu.barrier_wait(q_barrier)
        carry = (jnp.zeros((block_q, d), jnp.float32),
                 jnp.full((block_q,), -jnp.inf, jnp.float32),
                 jnp.zeros((block_q,), jnp.float32))
        before()
        acc, m_i, l_i = run_pipeline(carry)
        after()
        empty = l_i == 0.0   # (a NaN score leaves l NaN: the row's lse is NaN, not -inf)
        l_safe = jnp.where(empty, 1.0, l_i)
        q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, (block_q, d), [0])).astype(q_smem.dtype)
        lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        for src, dst in o_copies:
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
        plgpu.wait_smem_to_gmem(0)
    return context


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem2, lse_smem2, q_barriers,
            sched_barrier, *maybe_p, static, n_blocks: int, block_q: int, stages: int,
            cpu_check: bool):
    causal, tq, group, block_kv, _, sched = static
    h, bb, mb = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("m")
    if causal:  # the row blocks with the most key tiles first
        mb = n_blocks - 1 - mb
    wg = lax.axis_index("wg")
    d = q_ref.shape[-1]
    length = len_ref[bb]
    rows = _Rows(block_q, group)
    tiles = functools.partial(_key_tiles, length=length, tq=tq, block_kv=block_kv, causal=causal)
    block = 2 * mb + wg
    _, n_steps = tiles(rows.positions(2 * mb)[0], rows.positions(2 * mb + 1)[1])
    n_full, n_end = tiles(*rows.positions(block))
    turn = functools.partial(take_turn, sched_barrier, sched)
    q_smem = q_smem2.at[wg]
    # Warpgroup 1 starts one phase behind (one extra turn before its first tile, warpgroup 0
    # one after its last): their tensor-core and softmax phases alternate.
    compute_context = _compute_context(
        q_copies=rows.copies(q_ref, q_smem, b=bb, h=h, block=block),
        o_copies=[(s, g) for g, s in rows.copies(o_ref, q_smem, b=bb, h=h, block=block)],
        q_smem=q_smem, q_barrier=q_barriers.at[wg], lse_smem=lse_smem2.at[wg],
        lse_dst=lse_ref.at[bb, h, pl.ds(block * block_q, block_q)],
        before=lambda: pl.when(wg == 1)(turn), after=lambda: pl.when(wg == 0)(turn))

    def tile_body(indices, k_smem, v_smem, k_consumed, v_consumed, carry):
        return _tile_step(carry, t=indices[0], n_full=n_full, n_end=n_end,
                          pos_of_row=functools.partial(rows.position_of_row, block),
                          length=length, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem,
                          p_smem=maybe_p[0].at[wg] if cpu_check else None,
                          k_consumed=k_consumed, v_consumed=v_consumed, turn=turn,
                          static=static, cpu_check=cpu_check)

    k_spec = (plgpu.BlockSpec(block_shape=(d, block_kv), index_map=lambda t: (0, t)) if cpu_check
              else plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (t, 0)))
    v_spec = plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (t, 0))
    pipeline = wg_pipeline(tile_body, n_steps=n_steps, steps=stages,
                           compute_context=compute_context, in_specs=[k_spec, v_spec])
    pipeline(k_ref.at[bb, h] if cpu_check else k_ref.at[bb, :, h, :], v_ref.at[bb, :, h, :])


def flash_attention_mgpu(q, k, v, *, causal: bool = False, kv_lengths=None, sm_scale=None,
                         block_q: int = 64, block_kv: int | None = None, num_stages: int = 2,
                         schedule_barrier: bool = True, interpret: bool = False):
    """Flash attention forward ``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)`` on Mosaic GPU.

    Args:
      q: ``[B, Tq, Hq, D]`` bfloat16 or float16 (``TypeError`` otherwise), ``D <= 256``.
      k, v: ``[B, Tk, Hkv, D]``, cast to ``q``'s dtype; ``Hq % Hkv == 0``.
      causal: bottom-right causal mask aligned to each sequence's valid length.
      kv_lengths: optional int ``[B]`` (clamped to ``[0, Tk]``); keys ``>= kv_lengths[b]`` are
        masked and never reach the result.  Read inside the kernel: no recompilation.
      sm_scale: score scale, default ``1/sqrt(D)``.
      block_q: query rows per compute warpgroup (two per CTA), a multiple of 64.
      block_kv: keys per tile, a multiple of 64 up to 256 (default :func:`default_block_kv`).
      num_stages: K/V tiles in flight in shared memory (at least 2).
      schedule_barrier: the two compute warpgroups take turns on the tensor cores (ping-pong).
      interpret: run Mosaic GPU's CPU interpreter (see the module docstring).

    Raises ``TypeError`` for non-array inputs or an unsupported dtype and ``ValueError`` for
    shapes or tiles it cannot run (the tiles' shared memory included).  Not differentiable.
    """
    if block_kv is None and hasattr(q, "shape") and len(q.shape) == 4:
        block_kv = default_block_kv(q.shape[3])
    _check_args(q, k, v, kv_lengths, block_q, block_kv, num_stages)
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    d_pad = next(s for s in SUPPORTED_HEAD_DIMS if d <= s)
    dtype = q.dtype
    need = smem_bytes(d_pad, dtype, block_q=block_q, block_kv=block_kv, num_stages=num_stages,
                      interpret=interpret)
    if need > SMEM_LIMIT:
        raise ValueError(f"block_q={block_q}, block_kv={block_kv}, num_stages={num_stages} at "
                         f"head_dim {d_pad} need {need} bytes of shared memory, more than the "
                         f"{SMEM_LIMIT} of a Hopper SM")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if kv_lengths is None:
        lengths = jnp.full((b,), tk, jnp.int32)
    else:
        lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, tk)
    k, v = k.astype(dtype), v.astype(dtype)
    if kv_lengths is not None:   # the last tile is read whole: no NaN past the length
        keep = jnp.arange(tk, dtype=jnp.int32)[None, :] < lengths[:, None]
        v = jnp.where(keep[:, :, None, None], v, jnp.zeros((), dtype))
    tk_pad = cdiv(tk, block_kv) * block_kv
    k = pad_axis(pad_axis(k, 3, d_pad), 1, tk_pad)
    v = pad_axis(pad_axis(v, 3, d_pad), 1, tk_pad)
    rows = _Rows(block_q, group)
    if rows.sliced:   # q and out in their own layout, padded to whole row blocks
        n_blocks = cdiv(tq, 2 * rows.per)
        q_in = pad_axis(pad_axis(q, 3, d_pad), 1, n_blocks * 2 * rows.per)
        o_type = jax.ShapeDtypeStruct(q_in.shape, dtype)
    else:             # q_rows [B, Hkv, R, D], row t * G + j
        n_blocks = cdiv(tq * group, 2 * block_q)
        q_in = q.reshape(b, tq, hkv, group, d).transpose(0, 2, 1, 3, 4)
        q_in = pad_axis(pad_axis(q_in.reshape(b, hkv, tq * group, d), 3, d_pad), 2,
                        n_blocks * 2 * block_q)
        o_type = jax.ShapeDtypeStruct(q_in.shape, dtype)
    if interpret:   # the interpreter's wgmma reads K^T from memory: k [B, Hkv, D, Tk]
        k = jnp.transpose(k, (0, 2, 3, 1))
    static = (bool(causal), tq, group, block_kv, scale * LOG2E, bool(schedule_barrier))
    kernel = functools.partial(_kernel, static=static, n_blocks=n_blocks, block_q=block_q,
                               stages=num_stages, cpu_check=bool(interpret))
    o, lse = plgpu.kernel(
        kernel,
        grid=(hkv, b, n_blocks),
        grid_names=("h", "b", "m"),
        num_threads=3,
        thread_name="wg",
        out_type=(o_type, jax.ShapeDtypeStruct((b, hkv, n_blocks * 2 * block_q), jnp.float32)),
        scratch_types=(plgpu.SMEM((2, block_q, d_pad), dtype),
                       plgpu.SMEM((2, block_q), jnp.float32),
                       plgpu.Barrier(num_arrivals=group if rows.sliced else 1, num_barriers=2),
                       plgpu.Barrier(num_arrivals=2))
                      + ((plgpu.SMEM((2, block_q, block_kv), dtype),) if interpret else ()),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(lengths, q_in, k, v)
    if rows.sliced:   # lse rows: block, head j, position i -> [B, T, Hkv, G]
        lse = lse.reshape(b, hkv, 2 * n_blocks, group, rows.per).transpose(0, 2, 4, 1, 3)
        lse = lse.reshape(b, 2 * n_blocks * rows.per, hq)[:, :tq]
        return o[:, :tq, :, :d], lse
    out = o[:, :, :tq * group, :d].reshape(b, hkv, tq, group, d).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, :tq * group].reshape(b, hkv, tq, group).transpose(0, 2, 1, 3)
    return out.reshape(b, tq, hq, d), lse.reshape(b, tq, hq)
