"""Flash attention backward through Pallas Mosaic GPU (Hopper: TMA, wgmma, warp
specialisation): ``(dq, dk, dv)`` of :func:`pallas_kernels.flash_attention_mgpu.flash_attention_mgpu`
given its saved row statistics.  Public: :func:`flash_attention_mgpu_bwd` (kernels and a thin
wrapper), :func:`default_tiles`, :func:`resolve_tiles`, :func:`smem_bytes`; the differentiable
entry point is :func:`pallas_kernels.flash_attention_mgpu_vjp.flash_attention_mgpu_vjp`.

Equations (row ``i`` of query head ``h``, the keys ``j`` it sees): ``p_ij = exp(scale q_i . k_j -
lse_i)`` from the forward's natural-log ``lse`` (base 2 in the kernel: ``exp2(s * scale * log2(e)
- lse * log2(e))``), ``ds_ij = p_ij (do_i . v_j - delta_i)`` with ``delta_i = rowsum(dO_i * O_i) -
dlse_i`` (the LSE cotangent enters here), ``dq_i = scale sum_j ds_ij k_j``, ``dk_j = scale sum_i
ds_ij q_i``, ``dv_j = sum_i p_ij do_i``, the sums over ``i`` running over the ``G = Hq / Hkv`` query
heads of the kv head.  The mask is the forward's (bottom-right causal aligned to each length
``L_b``: query ``t`` sees keys ``j < L_b`` with ``j <= t + L_b - Tq``).  A row with ``lse = -inf``
contributes nothing (the wrapper makes its ``lse`` ``+inf``, so ``p = 0``, and its ``delta`` 0);
keys at or past ``L_b`` get ``dk = dv = 0`` and a NaN held there reaches no gradient (the wrapper
zeroes ``k`` and ``v`` past each length: whole tiles are read, and 0 times a NaN is NaN).

Kernels (deterministic: each gradient element is written by one CTA; no atomics), each with
``compute_wgs`` compute warpgroups (two; one at head_dim 256) and one memory warpgroup that
streams tiles through a ring of ``num_stages`` shared-memory slots
(``emit_pipeline_warp_specialized``):

* dK/dV, grid ``(Hkv, B, key blocks)``: a compute warpgroup owns ``block_kv_dkv`` keys (``K``,
  ``V`` loaded once by TMA; ``dK``, ``dV`` float32 in registers); the streamed tiles are
  ``block_q_dkv`` rows (``Q``, ``dO``, ``lse``, ``delta``) of every query head of the kv head, over
  the query blocks that some of the CTA's keys see (causal: from the diagonal on).  Per tile, keys
  as the wgmma rows: ``S^T = K Q^T``, ``P^T``, ``dV += P^T dO`` (``P^T`` from registers) issued
  with ``dP^T = V dO^T`` (one wait), ``dS^T``, ``dK += dS^T Q``.  The GQA sum is this loop.
  With ``split_dkv_columns`` (for wide heads) the two compute warpgroups own the same keys and
  each accumulates half of the columns of ``dK`` and ``dV``, both computing the full ``S^T`` and
  ``dP^T`` (:mod:`pallas_kernels.flash_attention_mgpu_dkv_split`).
* dQ, grid ``(Hq, B, row blocks)``, causal row blocks heaviest first: a compute warpgroup owns
  ``block_q_dq`` rows of one query head (``Q``, ``dO``, ``lse``, ``delta`` loaded once); the
  streamed tiles are the ``block_kv_dq``-key ``K``, ``V`` tiles its CTA's rows see.  Per tile:
  ``S = Q K^T`` issued with ``dP = dO V^T``, ``dS``, ``dQ += dS K`` (``dS`` from registers).

A warpgroup builds the mask only on tiles with a masked entry (a uniform branch) and, for a
streamed tile it does not see at all, only releases the slot.  Results leave through the
shared-memory tiles they were computed from (TMA stores).

Tunable (:func:`default_tiles`, checked by :func:`resolve_tiles`): ``block_q_dq`` and
``block_kv_dkv`` (multiples of 64), ``block_kv_dq`` and ``block_q_dkv`` (the K dimension of a
wgmma: multiples of 64 up to 256), ``num_stages``, ``compute_wgs`` (1 or 2; with
``split_dkv_columns`` it sets the dQ kernel's alone), ``split_dkv_columns`` (a bool, head_dim
above 64; on by default above 128); both kernels must fit a Hopper SM's shared memory
(:func:`smem_bytes`, ``ValueError`` otherwise).  At head_dim 256 a dK/dV warpgroup of the
default kernel holds two float32 accumulators ``[64, 256]``, 256 registers per thread alone:
that kernel spills; ``split_dkv_columns`` halves them, which is why it is the default there.

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter, whose wgmma takes both
operands from shared memory: ``dS``/``P^T`` are staged through shared memory into a fresh
accumulator, and the transposed operands are streamed as pre-transposed copies (``K^T``, ``V^T``
next to ``K``; ``Q^T``, ``dO^T`` next to ``Q``, ``dO``) or, with ``_interpret_views`` in
interpreters that have them, read through transposed shared-memory views as on the GPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, cdiv, pad_axis
from pallas_kernels.flash_attention_mgpu import SMEM_LIMIT, SUPPORTED_HEAD_DIMS, check_qkv, supported
from pallas_kernels.flash_attention_mgpu_dkv_split import (
    DkvSchedule, accumulate_and_score, arrive, bwd_pipeline, dkv_probs, dkv_slots,
    dkv_split_kernel, transposed)
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu
from pallas_kernels.prefix_attention_mgpu import wg_accumulate_pv, wgmma_iota

__all__ = ["flash_attention_mgpu_bwd", "smem_bytes", "default_tiles", "resolve_tiles"]

_SMEM_ALIGN = 1024   # shared-memory buffers start on 1 KiB boundaries (128-byte swizzle)
_SMEM_SLACK = 2304   # barriers and the nested allocation scopes


def default_tiles(head_dim: int) -> dict:
    """Tiles when the caller does not say: 64-row dQ and 64-key dK/dV warpgroups, streamed tiles
    of 128 keys (dQ) and 64 rows (dK/dV), two stages, two compute warpgroups; at head_dim 256 one
    compute warpgroup for dQ with 64-key tiles (two warpgroups' resident tiles and two stages of
    wider tiles do not fit in shared memory) and ``split_dkv_columns`` for dK/dV (whose
    accumulators spill otherwise), off at narrower heads (where both compute warpgroups
    computing the full ``S^T`` and ``dP^T`` costs more than the spills it saves).  Measured in
    ``bench/results/flash_attention_mgpu_bwd_sweep_h200.json``."""
    wide = head_dim > 128
    return {"block_q_dq": 64, "block_kv_dq": 64 if wide else 128, "block_kv_dkv": 64,
            "block_q_dkv": 64, "num_stages": 2, "compute_wgs": 1 if wide else 2,
            "split_dkv_columns": wide}


def smem_bytes(head_dim: int, dtype, *, block_q_dq: int, block_kv_dq: int, block_kv_dkv: int,
               block_q_dkv: int, num_stages: int, compute_wgs: int,
               split_dkv_columns: bool = False, interpret: bool = False) -> dict:
    """Bytes of shared memory of one CTA of each kernel (upper estimates), ``{"dq": ..., "dkv":
    ...}``: the compute warpgroups' resident tiles (with ``split_dkv_columns`` one ``K``/``V``
    pair for the dK/dV kernel's two), ``num_stages`` streamed tiles per operand (and in
    interpret mode the pre-transposed copies and staged products), each 1 KiB aligned, and the
    barriers."""
    item = jnp.dtype(dtype).itemsize
    d = head_dim

    def total(buffers):
        return sum(cdiv(x, _SMEM_ALIGN) * _SMEM_ALIGN for x in buffers) + _SMEM_SLACK
    w = compute_wgs
    dq = [w * block_q_dq * d * item] * 2 + [w * block_q_dq * 4] * 2
    dq += [num_stages * block_kv_dq * d * item] * (3 if interpret else 2)
    w_kv = 1 if split_dkv_columns else w
    dkv = [w_kv * block_kv_dkv * d * item] * 2 + [num_stages * block_q_dkv * 4] * 2
    dkv += [num_stages * block_q_dkv * d * item] * (4 if interpret else 2)
    if interpret:
        dq.append(w * block_q_dq * block_kv_dq * item)
        dkv.append((2 if split_dkv_columns else w) * block_kv_dkv * block_q_dkv * item)
    return {"dq": total(dq), "dkv": total(dkv)}


def resolve_tiles(head_dim: int, dtype, *, interpret: bool = False, **given) -> dict:
    """The tiles :func:`flash_attention_mgpu_bwd` runs for a ``head_dim``-wide head of ``dtype``:
    ``given`` (keys of :func:`default_tiles`; a ``None`` value takes the default) over the
    defaults.  Raises ``ValueError`` for an unknown key, a value out of range,
    ``split_dkv_columns`` not a bool or set at a head_dim of 64 or less, or tiles whose shared
    memory exceeds a Hopper SM's."""
    d_pad = next((s for s in SUPPORTED_HEAD_DIMS if head_dim <= s), SUPPORTED_HEAD_DIMS[-1])
    tiles = default_tiles(d_pad)
    unknown = sorted(set(given) - set(tiles))
    if unknown:
        raise ValueError(f"unknown tile arguments {unknown}; expected some of {sorted(tiles)}")
    tiles.update({name: val for name, val in given.items() if val is not None})
    for name in ("block_q_dq", "block_kv_dq", "block_kv_dkv", "block_q_dkv"):
        val, hi = tiles[name], 256 if name in ("block_kv_dq", "block_q_dkv") else None
        if (isinstance(val, bool) or not isinstance(val, int) or val < 64 or val % 64
                or (hi is not None and val > hi)):   # (a wgmma K dimension: 64-element groups)
            want = "a multiple of 64" + (f" in [64, {hi}]" if hi else "")
            raise ValueError(f"{name} must be {want}, got {val!r}")
    for name, lo, hi in (("num_stages", 2, 8), ("compute_wgs", 1, 2)):
        val = tiles[name]
        if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {val!r}")
    split = tiles["split_dkv_columns"]
    if not isinstance(split, bool):
        raise ValueError(f"split_dkv_columns must be a bool, got {split!r}")
    if split and d_pad < 128:   # (column halves of at least one 128-byte swizzle span)
        raise ValueError(f"split_dkv_columns needs head_dim above 64 (halves of at least 64 "
                         f"columns), got head_dim {head_dim}")
    for part, nbytes in smem_bytes(d_pad, dtype, **tiles, interpret=interpret).items():
        if nbytes > SMEM_LIMIT:
            raise ValueError(f"tiles {tiles} at head_dim {d_pad} need {nbytes} bytes of shared "
                             f"memory in the {part} kernel, more than the {SMEM_LIMIT} of a "
                             f"Hopper SM")
    return tiles


def _score_pair(a0, b0, a1, b1, *, shape, pre_t: bool):
    """``(a0 b0^T, a1 b1^T)`` float32 ``shape`` on the tensor cores, both issued before either
    is read (``b0``, ``b1`` pre-transposed in memory with ``pre_t``)."""
    t = functools.partial(transposed, pre_t=pre_t)

    def products(r0, r1):
        plgpu.wgmma(r0, a0, t(b0))
        plgpu.wgmma(r1, a1, t(b1))
        return r0[...], r1[...]
    acc = plgpu.ACC(shape, jnp.float32)
    return pl.run_scoped(products, acc, acc)


def _dq_kernel(len_ref, q_ref, do_ref, lse_ref, delta_ref, *rest, static, n_blocks, stages, wgs,
               cpu_check, pre_t):
    """One CTA of the dQ kernel: ``q/do [B, Tqp, Hq, D]``, ``lse/delta [B, Hq, Tqp]``; streamed
    ``k/v [B, Tkp, Hkv, D]`` (interpreter: ``kT, vT [B, Hkv, D, Tkp]`` and ``k``)."""
    n_in = 3 if pre_t else 2
    kv_refs, (dq_ref, q2, do2, lse2, delta2, bars, *maybe_p) = rest[:n_in], rest[n_in:]
    causal, tq, group, scale, block_q, block_kv = static
    h, bb, mb = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("m")
    if causal:
        mb = n_blocks - 1 - mb
    wg = lax.axis_index("wg")
    length = len_ref[bb]
    diag = length - tq                                  # query t sees keys j <= t + diag
    d = q_ref.shape[-1]

    def tiles(first, last):   # key tiles seen by all of rows [first, last], by any of them
        if not causal:
            return length // block_kv, lax.div(length + block_kv - 1, block_kv)
        end_all = jnp.clip(jnp.minimum(first, tq - 1) + diag + 1, 0, length)
        end_any = jnp.clip(jnp.minimum(last, tq - 1) + diag + 1, 0, length)
        n_end = lax.div(end_any + block_kv - 1, block_kv)
        return jnp.minimum(end_all // block_kv, n_end), n_end

    r0 = (wgs * mb + wg) * block_q
    _, n_steps = tiles(wgs * mb * block_q, (wgs * mb + wgs) * block_q - 1)
    n_full, n_end = tiles(r0, r0 + block_q - 1)
    q_smem, do_smem, lse_smem, delta_smem = q2.at[wg], do2.at[wg], lse2.at[wg], delta2.at[wg]
    rows = pl.ds(r0, block_q)

    def context(run_pipeline):
        for src, dst in ((q_ref.at[bb, rows, h], q_smem), (do_ref.at[bb, rows, h], do_smem),
                         (lse_ref.at[bb, h, rows], lse_smem),
                         (delta_ref.at[bb, h, rows], delta_smem)):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[wg])
        plgpu.barrier_wait(bars.at[wg])
        dq = run_pipeline(jnp.zeros((block_q, d), jnp.float32))
        q_smem[...] = (dq * scale).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[bb, rows, h])
        plgpu.wait_smem_to_gmem(0)

    def body(indices, *args):
        smem, consumed, dq = args[:n_in], args[n_in:2 * n_in], args[-1]
        t = indices[0]
        k_t, v_t, k_mm = (smem[0], smem[1], smem[2]) if pre_t else (smem[0], smem[1], smem[0])

        def compute(dq):
            shape = (block_q, block_kv)
            s, dp = _score_pair(q_smem, k_t, do_smem, v_t, shape=shape, pre_t=pre_t)
            arrive(consumed[1:2])
            p = jnp.exp2(s * (scale * LOG2E)
                         - lax.broadcast_in_dim(lse_smem[...] * LOG2E, shape, [0]))

            def masked(p):
                key = t * block_kv + wgmma_iota(shape, 1, hint=not cpu_check)
                ok = key < length
                if causal:
                    ok = ok & (key <= r0 + wgmma_iota(shape, 0, hint=not cpu_check) + diag)
                return jnp.where(ok, p, 0.0)
            p = lax.cond(t >= n_full, masked, lambda p: p, p)
            ds = p * (dp - lax.broadcast_in_dim(delta_smem[...], shape, [0]))
            dq = wg_accumulate_pv(dq, ds.astype(q_smem.dtype), k_mm,
                                  maybe_p[0].at[wg] if cpu_check else None, cpu_check=cpu_check)
            arrive(consumed[:1] + consumed[2:])
            return dq

        if not causal:
            return compute(dq)

        def skip(dq):
            arrive(consumed)
            return dq
        return lax.cond(t < n_end, compute, skip, dq)

    if pre_t:
        specs = [plgpu.BlockSpec(block_shape=(d, block_kv), index_map=lambda t: (0, t))] * 2
        srcs = [kv_refs[0].at[bb, h // group], kv_refs[1].at[bb, h // group]]
        specs.append(plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (t, 0)))
        srcs.append(kv_refs[2].at[bb, :, h // group, :])
    else:
        specs = [plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (t, 0))] * 2
        srcs = [r.at[bb, :, h // group, :] for r in kv_refs]
    bwd_pipeline(body, n_steps=n_steps, stages=stages, wgs=wgs, context=context, specs=specs)(*srcs)


def _dkv_kernel(len_ref, k_ref, v_ref, *rest, static, stages, wgs, cpu_check, pre_t):
    """One CTA of the dK/dV kernel: ``k/v [B, Tkp, Hkv, D]`` (resident); streamed ``q/do [B, Tqp,
    Hq, D]`` (interpreter: and ``qT/doT [B, Hq, D, Tqp]``), ``lse/delta [B, Hq, Tqp]``."""
    n_in = 6 if pre_t else 4
    streams, (dk_ref, dv_ref, k2, v2, bars, *maybe_p) = rest[:n_in], rest[n_in:]
    scale, block_kv = static[3], static[5]
    h, bb, nb = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("n")
    wg = lax.axis_index("wg")
    length = len_ref[bb]
    d = k_ref.shape[-1]
    k0 = wgs * nb * block_kv
    kw = k0 + wg * block_kv
    sched = DkvSchedule(k0, length, h, static)
    lo_w = sched.first_block(kw)
    k_smem, v_smem = k2.at[wg], v2.at[wg]
    keys = pl.ds(kw, block_kv)

    def context(run_pipeline):
        plgpu.copy_gmem_to_smem(k_ref.at[bb, keys, h], k_smem, bars.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[bb, keys, h], v_smem, bars.at[wg])
        plgpu.barrier_wait(bars.at[wg])
        zeros = jnp.zeros((block_kv, d), jnp.float32)
        dk, dv = run_pipeline((zeros, zeros))
        k_smem[...] = (dk * scale).astype(k_smem.dtype)
        v_smem[...] = dv.astype(v_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[bb, keys, h])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[bb, keys, h])
        plgpu.wait_smem_to_gmem(0)

    def body(indices, *args):
        (q_t, do_t, qT_t, doT_t, lse_t, delta_t), (first, last) = dkv_slots(
            args[:n_in], args[n_in:2 * n_in], pre_t)
        carry = args[-1]
        qb = sched.qblock(indices[0])
        p_smem = maybe_p[0].at[wg] if cpu_check else None
        shape = (block_kv, static[4])

        def compute(carry):
            dk, dv = carry
            p = dkv_probs(k_smem, qT_t, lse_t, key0=kw, qb=qb, length=length, static=static,
                          cpu_check=cpu_check, pre_t=pre_t)
            dv, dpt = accumulate_and_score(dv, p.astype(k_smem.dtype), p_smem,
                                           lambda: (do_t, v2.at[wg], doT_t), shape=shape,
                                           cpu_check=cpu_check, pre_t=pre_t)
            ds = p * (dpt - lax.broadcast_in_dim(delta_t[...], shape, [1]))
            arrive(first)
            dk = wg_accumulate_pv(dk, ds.astype(k_smem.dtype), q_t, p_smem, cpu_check=cpu_check)
            arrive(last)
            return dk, dv

        def skip(carry):
            arrive(args[n_in:2 * n_in])
            return carry
        return lax.cond((kw < length) & (qb >= lo_w), compute, skip, carry)

    bwd_pipeline(body, n_steps=sched.n_steps, stages=stages, wgs=wgs, context=context,
                 specs=sched.specs(d, pre_t))(*(r.at[bb] for r in streams))


def _check_args(q, k, v, d_out, lse, delta, kv_lengths):
    check_qkv(q, k, v)
    for name, x in (("d_out", d_out), ("lse", lse), ("delta", delta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    why = supported(q.shape, k.shape, q.dtype)
    if why is not None:
        raise (TypeError if "dtype" in why else ValueError)(
            f"flash_attention_mgpu_bwd cannot run these shapes: {why}")
    for name, x, want in (("d_out", d_out, q.shape), ("lse", lse, q.shape[:3]),
                          ("delta", delta, q.shape[:3])):
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(x.shape)}")
    if kv_lengths is not None and (not hasattr(kv_lengths, "shape")
                                   or tuple(kv_lengths.shape) != (q.shape[0],)
                                   or not jnp.issubdtype(kv_lengths.dtype, jnp.integer)):
        raise ValueError(f"kv_lengths must be an integer array of shape [{q.shape[0]}], got "
                         f"{getattr(kv_lengths, 'shape', type(kv_lengths).__name__)}")


def flash_attention_mgpu_bwd(q, k, v, d_out, lse, delta, *, causal: bool = False,
                             kv_lengths=None, sm_scale=None, block_q_dq: int | None = None,
                             block_kv_dq: int | None = None, block_kv_dkv: int | None = None,
                             block_q_dkv: int | None = None, num_stages: int | None = None,
                             compute_wgs: int | None = None,
                             split_dkv_columns: bool | None = None, interpret: bool = False,
                             _interpret_views: bool = False):
    """``(dq [B, Tq, Hq, D], dk [B, Tk, Hkv, D], dv)`` of flash attention with the given row
    statistics ``lse`` (the forward's, natural log; ``-inf``: the row gets no gradient) and
    ``delta = rowsum(d_out * out) - d_lse``, both ``[B, Tq, Hq]``.

    ``q, d_out [B, Tq, Hq, D]`` bfloat16 or float16; ``k, v [B, Tk, Hkv, D]`` (cast to ``q``'s
    dtype); ``causal``, ``kv_lengths`` (int ``[B]``), ``sm_scale`` (default ``1/sqrt(D)``) as
    in the forward.  Tiles (default :func:`default_tiles`) as in the module docstring;
    ``split_dkv_columns`` splits the dK/dV accumulators' columns between two compute warpgroups
    that own the same keys; ``interpret`` runs Mosaic GPU's CPU interpreter; ``_interpret_views``
    (tests) makes it read the transposed operands through transposed shared-memory views, as the
    GPU does (interpreters that have them).  Gradients come back in the inputs' dtypes; ``dk =
    dv = 0`` at keys at or past each length.

    Raises ``TypeError`` for non-array inputs or an unsupported dtype and ``ValueError`` for
    shapes or tiles it cannot run, the tiles' shared memory included.
    """
    _check_args(q, k, v, d_out, lse, delta, kv_lengths)
    tiles = resolve_tiles(q.shape[3], q.dtype, block_q_dq=block_q_dq, block_kv_dq=block_kv_dq,
                          block_kv_dkv=block_kv_dkv, block_q_dkv=block_q_dkv,
                          num_stages=num_stages, compute_wgs=compute_wgs,
                          split_dkv_columns=split_dkv_columns, interpret=interpret)
    d_pad = next(s for s in SUPPORTED_HEAD_DIMS if q.shape[3] <= s)
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    dtype = q.dtype
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    lengths = (jnp.full((b,), tk, jnp.int32) if kv_lengths is None
               else jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, tk))
    k_dtype, v_dtype = k.dtype, v.dtype
    k, v = k.astype(dtype), v.astype(dtype)
    if kv_lengths is not None:   # whole tiles are read: no NaN past the lengths
        keep = jnp.arange(tk, dtype=jnp.int32)[None, :] < lengths[:, None]
        k, v = (jnp.where(keep[:, :, None, None], x, jnp.zeros((), dtype)) for x in (k, v))
    bq, bkq = tiles["block_q_dq"], tiles["block_kv_dq"]
    bkk, bqk = tiles["block_kv_dkv"], tiles["block_q_dkv"]
    wgs, split = tiles["compute_wgs"], tiles["split_dkv_columns"]
    kv_block = bkk if split else wgs * bkk                               # keys per dK/dV CTA
    tq_pad = cdiv(tq, math.lcm(wgs * bq, bqk)) * math.lcm(wgs * bq, bqk)
    tk_pad = cdiv(tk, math.lcm(bkq, kv_block)) * math.lcm(bkq, kv_block)
    qp, dop = (pad_axis(pad_axis(x.astype(dtype), 3, d_pad), 1, tq_pad) for x in (q, d_out))
    kp, vp = (pad_axis(pad_axis(x, 3, d_pad), 1, tk_pad) for x in (k, v))
    lse32 = jnp.transpose(lse.astype(jnp.float32), (0, 2, 1))            # [B, Hq, Tq]
    empty = jnp.isneginf(lse32)
    lse_in = jnp.pad(jnp.where(empty, jnp.inf, lse32), ((0, 0), (0, 0), (0, tq_pad - tq)),
                     constant_values=jnp.inf)                            # no key: p = 0
    delta_in = pad_axis(jnp.where(empty, 0.0, jnp.transpose(delta.astype(jnp.float32),
                                                              (0, 2, 1))), 2, tq_pad)
    params = dict(compiler_params=plgpu.CompilerParams(
        approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup), thread_name="wg",
        **({"interpret": gpu_interpret_params()} if interpret else {}))
    to_t = functools.partial(jnp.transpose, axes=(0, 2, 3, 1))           # [B, H, D, T]
    stages = tiles["num_stages"]
    forms = {"cpu_check": bool(interpret), "pre_t": bool(interpret) and not _interpret_views}
    n_blocks = tq_pad // (wgs * bq)
    kv_streams = (to_t(kp), to_t(vp), kp) if forms["pre_t"] else (kp, vp)
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, static=(bool(causal), tq, group, scale, bq, bkq),
                          n_blocks=n_blocks, stages=stages, wgs=wgs, **forms),
        grid=(hq, b, n_blocks), grid_names=("h", "b", "m"), num_threads=wgs + 1,
        out_type=jax.ShapeDtypeStruct(qp.shape, dtype),
        scratch_types=(plgpu.SMEM((wgs, bq, d_pad), dtype), plgpu.SMEM((wgs, bq, d_pad), dtype),
                       plgpu.SMEM((wgs, bq), jnp.float32), plgpu.SMEM((wgs, bq), jnp.float32),
                       plgpu.Barrier(num_arrivals=4, num_barriers=wgs))
                      + ((plgpu.SMEM((wgs, bq, bkq), dtype),) if interpret else ()),
        **params,
    )(lengths, qp, dop, lse_in, delta_in, *kv_streams)

    rows = (qp, dop, to_t(qp), to_t(dop)) if forms["pre_t"] else (qp, dop)
    static = (bool(causal), tq, group, scale, bqk, bkk)
    p_scratch = lambda n: (plgpu.SMEM((n, bkk, bqk), dtype),) if interpret else ()  # noqa: E731
    if split:
        kernel = functools.partial(dkv_split_kernel, static=static, stages=stages, **forms)
        scratch = (plgpu.SMEM((bkk, d_pad), dtype), plgpu.SMEM((bkk, d_pad), dtype),
                   plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2)) + p_scratch(2)
    else:
        kernel = functools.partial(_dkv_kernel, static=static, stages=stages, wgs=wgs, **forms)
        scratch = (plgpu.SMEM((wgs, bkk, d_pad), dtype), plgpu.SMEM((wgs, bkk, d_pad), dtype),
                   plgpu.Barrier(num_arrivals=2, num_barriers=wgs)) + p_scratch(wgs)
    dk, dv = plgpu.kernel(
        kernel, grid=(hkv, b, tk_pad // kv_block), grid_names=("h", "b", "n"),
        num_threads=(2 if split else wgs) + 1,
        out_type=(jax.ShapeDtypeStruct(kp.shape, dtype),) * 2, scratch_types=scratch, **params,
    )(lengths, kp, vp, *rows, lse_in, delta_in)
    return (dq[:, :tq, :, :d], dk[:, :tk, :, :d].astype(k_dtype),
            dv[:, :tk, :, :d].astype(v_dtype))
