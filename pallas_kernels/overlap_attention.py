"""Shared-prefix attention in one launch of interleaved prefix and suffix programs (Pallas,
Triton lowering).

The prefix part (batched rows against the shared prefix: tensor-core bound) and the suffix part
(each sequence against its own keys: HBM bound) are independent until the merge.  This kernel
puts both kinds of programs in one grid, a prefix program every ``stride`` programs, so the GPU
schedules them side by side and the compute-bound and bandwidth-bound work overlap; the caller
merges the partial states in one XLA fusion.  It pays where the suffix programs alone cannot
fill the GPU (few ``(sequence, kv head)`` pairs), against the prefix kernel followed by the
suffix kernel (measurements: ``docs/performance.md``, "Planner regions and tilings",
``overlap_below_programs``).

``interpret=True`` runs the kernel in Pallas interpret mode (CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2E, attend_pool, finish_state, split_chunk
from pallas_kernels.decode_attention import supported as _triton_supported

__all__ = ["overlap_partials", "supported"]


def supported(*, head_dim: int, dtype) -> str | None:
    """``None`` when :func:`overlap_partials` takes ``head_dim`` and ``dtype``, else the reason."""
    return _triton_supported(head_dim=head_dim, dtype=dtype)


def _overlap_kernel(*refs, n_pre, stride, n_rb, p_splits, batch, s_splits, chunk_p, chunk_s,
                    block_m, r16, block_k_p, block_k_s, seq_p, seq_s, scale_log2, precision,
                    one_entry, one_limit, seq_limits):
    it = iter(refs)
    q_pre_ref = next(it)
    grp_ref = None if one_entry else next(it)
    limp_ref, pk_ref, pv_ref, q_suf_ref, sidx_ref, lims_ref, sk_ref, sv_ref = (
        next(it) for _ in range(8))
    o_pre_ref, lse_pre_ref, o_suf_ref, lse_suf_ref = (next(it) for _ in range(4))
    pid = pl.program_id(0)
    is_pre = jnp.logical_and(pid % stride == 0, pid // stride < n_pre)
    d = q_pre_ref.shape[-1]

    def init(bm):
        return (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), -jnp.inf, jnp.float32),
                jnp.zeros((bm,), jnp.float32))

    @pl.when(is_pre)
    def _prefix():
        i = pid // stride
        h = i // (n_rb * p_splits)
        rem = i % (n_rb * p_splits)
        rb, sp = rem // p_splits, rem % p_splits
        rows = pl.ds(pl.multiple_of(rb * block_m, block_m), block_m)
        idx = (jnp.zeros((block_m,), jnp.int32) if one_entry else grp_ref[rows])
        lim = (jnp.broadcast_to(jnp.max(limp_ref[...]), (block_m,)) if one_limit
               else limp_ref[rows])
        carry = attend_pool(q_pre_ref[h, rows, :], idx, lim, pk_ref, pv_ref,
                            h, sp * chunk_p, init(block_m), chunk=chunk_p, block_k=block_k_p,
                            seq_len=seq_p, scale_log2=scale_log2, precision=precision)
        o, lse = finish_state(*carry)
        o_pre_ref[sp, h, rows, :] = o
        lse_pre_ref[sp, h, rows] = lse

    @pl.when(jnp.logical_not(is_pre))
    def _suffix():
        j = pid - jnp.minimum(pid // stride + 1, n_pre)
        h = j // (batch * s_splits)
        rem = j % (batch * s_splits)
        b, ss = rem // s_splits, rem % s_splits
        rows = pl.ds(pl.multiple_of(b * r16, r16), r16)
        lim = (jnp.broadcast_to(jnp.max(lims_ref[pl.ds(b, 1)]), (r16,)) if seq_limits
               else lims_ref[rows])
        carry = attend_pool(q_suf_ref[h, rows, :], sidx_ref[rows], lim, sk_ref, sv_ref,
                            h, ss * chunk_s, init(r16), chunk=chunk_s, block_k=block_k_s,
                            seq_len=seq_s, scale_log2=scale_log2, precision=precision)
        o, lse = finish_state(*carry)
        o_suf_ref[ss, h, rows, :] = o
        lse_suf_ref[ss, h, rows] = lse


def overlap_partials(q_pre, grp_rows, limp_rows, prefix_k, prefix_v, q_suf, sidx_rows, lims_rows,
                     suffix_k, suffix_v, *, scale, block_m, block_k, num_splits, r16,
                     suffix_block_k=64, suffix_splits=1, num_warps=4, num_stages=2,
                     interpret=False):
    """One launch computing prefix partials (batched rows, ``block_m`` per program) and suffix
    partials (one sequence's ``r16`` rows per program) with the two kinds of programs
    interleaved over the grid so tensor-core-bound and bandwidth-bound work run together.

    Row metadata: ``grp_rows [M]`` pool entry and ``limp_rows [M]`` key limit of each prefix
    row, ``sidx_rows [B * r16]`` / ``lims_rows [B * r16]`` the same for the suffix rows.
    Without per-row arrays (each one more XLA launch on the GPU when it must be built):
    ``grp_rows=None`` (every row reads entry 0), ``limp_rows [1]`` (one limit for every prefix
    row) and ``lims_rows [B]`` (one limit per sequence, e.g. decoding).

    Returns ``(o_pre [splits, Hkv, M, D], lse_pre, o_suf [suffix_splits, Hkv, B*r16, D], lse_suf)``.
    Compiled (not ``interpret``), ``block_m`` must be at least 32: with 16-row prefix blocks
    jax 0.12.0.1's Triton path returned wrong prefix partials on an H200.
    """
    if not interpret and block_m < 32:
        raise ValueError(f"block_m must be at least 32 when compiled, got {block_m}")
    hkv, m, d = q_pre.shape
    batch = q_suf.shape[1] // r16
    n_rb = m // block_m
    p_len, s_len = prefix_k.shape[1], suffix_k.shape[1]
    n_pre = hkv * n_rb * num_splits
    n_suf = hkv * batch * suffix_splits
    total = n_pre + n_suf
    stride = max(1, total // n_pre)
    chunk_p = split_chunk(p_len, num_splits, block_k)
    chunk_s = split_chunk(s_len, suffix_splits, suffix_block_k)
    precision = lax.Precision.HIGHEST if q_pre.dtype == jnp.float32 else lax.Precision.DEFAULT
    one_limit = limp_rows.shape == (1,)  # (m and r16 are >= 16: the forms cannot be confused)
    seq_limits = lims_rows.shape == (batch,)
    assert one_limit or limp_rows.shape == (m,), (limp_rows.shape, m)
    assert seq_limits or lims_rows.shape == (batch * r16,), (lims_rows.shape, batch, r16)
    kernel = functools.partial(
        _overlap_kernel, n_pre=n_pre, stride=stride, n_rb=n_rb, p_splits=num_splits,
        batch=batch, s_splits=suffix_splits, chunk_p=chunk_p, chunk_s=chunk_s, block_m=block_m,
        r16=r16, block_k_p=block_k, block_k_s=suffix_block_k, seq_p=p_len, seq_s=s_len,
        scale_log2=float(scale) * LOG2E, precision=precision,
        one_entry=grp_rows is None, one_limit=one_limit, seq_limits=seq_limits)
    meta = lambda x: x if isinstance(x, np.ndarray) else x.astype(jnp.int32)  # noqa: E731
    args = ([q_pre] + ([] if grp_rows is None else [meta(grp_rows)])
            + [meta(limp_rows), prefix_k, prefix_v, q_suf, meta(sidx_rows), meta(lims_rows),
               suffix_k, suffix_v])
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, n=x.ndim: (0,) * n)  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((num_splits, hkv, m, d), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, hkv, m), jnp.float32),
                 jax.ShapeDtypeStruct((suffix_splits, hkv, batch * r16, d), jnp.float32),
                 jax.ShapeDtypeStruct((suffix_splits, hkv, batch * r16), jnp.float32)]
    return pl.pallas_call(
        kernel, grid=(total,), in_specs=[whole(x) for x in args],
        out_specs=[whole(x) for x in out_shape], out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="shared_prefix_overlap",
    )(*args)
