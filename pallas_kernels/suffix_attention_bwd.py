"""Backward pass of the per-sequence suffix part of shared-prefix attention at short query
counts (decoding, draft verification, short suffix prefills): one pass over each sequence's
suffix keys writes their ``dK``/``dV`` tiles and accumulates ``dQ`` (Pallas, Triton lowering).

Why not the flash backward (:func:`pallas_kernels.flash_attention.flash_attention_bwd`): it
gives every query head its own row tile (at least 16 rows) and loops over the group's heads
for ``dK``/``dV``, so with one query per sequence 15 of every 16 rows are padding, and ``K``/``V``
are read by two kernels.  Here the ``Tq * G`` query rows of one (sequence, kv head) (``G = Hq /
Hkv``; row ``r = i * G + j`` is position ``i``, head ``h * G + j``) are the M dimension of every
product, as in the forward decode kernel, and each (sequence, kv head) owns its keys: no
accumulation across programs is needed for ``dK``/``dV``.

Per key tile (transposed products, keys as rows): ``S^T = K Q^T``, ``P^T = exp(S^T - lse)``
(merged statistics, see :mod:`pallas_kernels.prefix_attention_bwd`), ``dV = P^T dO``,
``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``, ``dK = dS^T Q * scale``, ``dQ += dS K``.

Layouts: ``q, d_out [B, Tq, Hq, D]``, ``lse, delta [B, Tq, Hq]`` float32, ``suffix_k/v
[B, S, Hkv, D]``, ``lim [B, Tq]`` int32 (query ``i`` of sequence ``b`` sees keys ``j <
lim[b, i]``; dynamic).  Returns ``dq`` (q's dtype) and ``dk, dv [B, S, Hkv, D]`` (the keys'
dtype; zero past every row's limit).  Keys and values past the limits may hold anything (NaN
included): they never reach the gradients.  Grid ``(B, Hkv, key_splits)``: when ``B * Hkv`` is
small the key tiles are split across programs (``dQ`` then as float32 partials summed by one
XLA reduction).  Static: shapes, ``scale``, tiles, ``key_splits``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2E as _LOG2E
from pallas_kernels.flash_attention import flash_attention_bwd
from pallas_kernels.prefix_attention_bwd import prefix_grads_reference

__all__ = ["suffix_grads", "suffix_part_grads", "suffix_grads_reference", "suffix_grads_supported",
           "suffix_grad_tiles", "MAX_ROWS"]

MAX_ROWS = 128  # Tq * G rows per (sequence, kv head) in one tile; more: the flash backward


def suffix_grads_supported(tq: int, heads_q: int, heads_kv: int, head_dim: int) -> bool:
    """Whether :func:`suffix_grads` takes these static shapes (``Tq * Hq / Hkv <= MAX_ROWS``,
    ``head_dim`` a power of two >= 16)."""
    return (tq * (heads_q // heads_kv) <= MAX_ROWS and head_dim >= 16
            and not head_dim & (head_dim - 1))


def suffix_grad_tiles(suffix_len: int, block_k: int = 64) -> int:
    """Key tiles of :func:`suffix_grads` per (sequence, kv head) program, the most key splits
    it takes."""
    bk = max(16, min(int(block_k), 1 << max(0, suffix_len - 1).bit_length()))
    return -(-suffix_len // bk)


def _dot(a, b, fp32: bool, dims):
    prec = lax.Precision.HIGHEST if fp32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _kernel(lim_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *,
            scale: float, bk: int, n_tiles: int, key_splits: int, fp32: bool):
    """One (sequence, kv head, key split): ``q/do [R, D]``, ``lse/delta/lim [R]``,
    ``k/v/dk/dv [Sp, D]``, ``dq [R, D]``."""
    part = pl.program_id(2)
    scale2 = scale * _LOG2E
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...] * _LOG2E               # +inf on rows without keys (and padding): p = 0
    delta = delta_ref[...]
    lim = lim_ref[...]
    max_lim = jnp.max(lim)
    n_end = lax.div(max_lim + bk - 1, bk)
    chunk = -(-n_tiles // key_splits)
    lo = part * chunk
    hi = jnp.minimum(lo + chunk, n_tiles)
    mid = jnp.clip(n_end, lo, hi)
    nn, nt, tn = ((1,), (0,)), ((1,), (1,)), ((0,), (0,))   # a @ b, a @ b.T, a.T @ b

    def body(t, dq):
        start = pl.multiple_of(t * bk, bk)
        keys = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        vis = keys < lim[None, :]                                    # [bk, R]
        s_t = _dot(k, q, fp32, nt)
        p_t = jnp.where(vis, jnp.exp2(s_t * scale2 - lse2[None, :]), 0.0)
        dv_ref[pl.ds(start, bk), :] = _dot(p_t.astype(do.dtype), do, fp32, nn
                                           ).astype(dv_ref.dtype)
        dp_t = _dot(v, do, fp32, nt)
        ds_t = jnp.where(vis, p_t * (dp_t - delta[None, :]), 0.0)
        ds16 = ds_t.astype(q.dtype)
        dk_ref[pl.ds(start, bk), :] = (_dot(ds16, q, fp32, nn) * scale).astype(dk_ref.dtype)
        k = jnp.where(keys < max_lim, k, jnp.zeros_like(k))         # (NaN past every limit)
        return dq + _dot(ds16, k, fp32, tn)

    def zero(t, c):                                                 # tiles no row sees
        start = pl.multiple_of(t * bk, bk)
        dk_ref[pl.ds(start, bk), :] = jnp.zeros((bk, dk_ref.shape[-1]), dk_ref.dtype)
        dv_ref[pl.ds(start, bk), :] = jnp.zeros((bk, dv_ref.shape[-1]), dv_ref.dtype)
        return c

    dq = lax.fori_loop(lo, mid, body, jnp.zeros(q.shape, jnp.float32))
    lax.fori_loop(mid, hi, zero, 0)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def suffix_grads(q, d_out, lse, delta, suffix_k, suffix_v, lim, *, scale: float,
                 interpret: bool = False, block_k: int = 64, key_splits: int = 1,
                 num_warps: int = 4, num_stages: int = 2):
    """``(dq, dk, dv)`` of the suffix part (see the module docstring)."""
    b, tq, hq, d = q.shape
    _, s, hkv, _ = suffix_k.shape
    if not suffix_grads_supported(tq, hq, hkv, d):
        raise ValueError(f"suffix_grads takes Tq * Hq / Hkv <= {MAX_ROWS} rows and a power-of-two "
                         f"head_dim >= 16, got Tq={tq}, Hq={hq}, Hkv={hkv}, head_dim={d}")
    g = hq // hkv
    fp32 = q.dtype == jnp.float32
    dtype = suffix_k.dtype
    r = tq * g
    rp = max(16, 1 << (r - 1).bit_length())
    bk = max(16, min(int(block_k), 1 << max(0, s - 1).bit_length()))
    sp = -(-s // bk) * bk
    n_tiles = sp // bk
    ks = min(int(key_splits), n_tiles)
    if ks < 1:
        raise ValueError(f"key_splits must be >= 1, got {ks}")

    def rows(x, fill):  # [B, Tq, Hq, ...] -> [B, Hkv, Rp, ...], row i * G + j
        x = x.reshape((b, tq, hkv, g) + x.shape[3:])
        x = jnp.moveaxis(x, 2, 1).reshape((b, hkv, r) + x.shape[4:])
        pad = [(0, 0), (0, 0), (0, rp - r)] + [(0, 0)] * (x.ndim - 3)
        return jnp.pad(x, pad, constant_values=fill)
    q_r = rows(q.astype(dtype), 0)
    do_r = rows(d_out.astype(dtype), 0)
    lse_r = rows(jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(jnp.float32)), jnp.inf)
    delta_r = rows(delta.astype(jnp.float32), 0)
    lim_r = jnp.pad(jnp.repeat(jnp.asarray(lim, jnp.int32), g, axis=1), ((0, 0), (0, rp - r)))
    pad_s = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    sk = jnp.pad(suffix_k, pad_s)
    sv = jnp.pad(suffix_v, pad_s)

    kvspec = pl.BlockSpec((None, sp, None, d), lambda bb, h, c: (bb, 0, h, 0))
    rspec = pl.BlockSpec((None, None, rp, d), lambda bb, h, c: (bb, h, 0, 0))
    sspec = pl.BlockSpec((None, None, rp), lambda bb, h, c: (bb, h, 0))
    if ks == 1:
        dq_spec, dq_shape = rspec, jax.ShapeDtypeStruct(q_r.shape, q.dtype)
    else:
        dq_spec = pl.BlockSpec((None, None, None, rp, d), lambda bb, h, c: (c, bb, h, 0, 0))
        dq_shape = jax.ShapeDtypeStruct((ks,) + q_r.shape, jnp.float32)
    dq, dk, dv = pl.pallas_call(
        functools.partial(_kernel, scale=scale, bk=bk, n_tiles=n_tiles, key_splits=ks,
                          fp32=fp32),
        grid=(b, hkv, ks),
        in_specs=[pl.BlockSpec((None, rp), lambda bb, h, c: (bb, 0)), rspec, kvspec, kvspec,
                  rspec, sspec, sspec],
        out_specs=[dq_spec, kvspec, kvspec],
        out_shape=[dq_shape, jax.ShapeDtypeStruct(sk.shape, dtype),
                   jax.ShapeDtypeStruct(sv.shape, dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="suffix_bwd",
    )(lim_r, q_r, sk, sv, do_r, lse_r, delta_r)
    if ks > 1:
        dq = dq.sum(axis=0)
    dq = jnp.moveaxis(dq[:, :, :r].reshape(b, hkv, tq, g, d), 1, 2).reshape(b, tq, hq, d)
    return dq.astype(q.dtype), dk[:, :s], dv[:, :s]


def suffix_part_grads(q, d_out, lse, delta, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                      interpret: bool = False, key_splits: int = 1):
    """Gradients of the suffix part of a merged attention whose queries are the last ``Tq``
    positions of each suffix (bottom-right causal: query ``i`` sees keys ``j < clip(sl - Tq + i
    + 1, 0, sl)``): :func:`suffix_grads` when its rows fit one tile, else the flash backward
    (:func:`pallas_kernels.flash_attention.flash_attention_bwd`, causal, aligned to ``sl``).
    ``key_splits``: splits of :func:`suffix_grads`' key tiles across programs (at most
    :func:`suffix_grad_tiles`)."""
    _, tq, hq, d = q.shape
    sl = jnp.asarray(suffix_lengths, jnp.int32)
    if suffix_grads_supported(tq, hq, suffix_k.shape[2], d):
        i = jnp.arange(tq, dtype=jnp.int32)[None, :]
        lim = jnp.clip(sl[:, None] - tq + i + 1, 0, sl[:, None])
        return suffix_grads(q, d_out, lse, delta, suffix_k, suffix_v, lim, scale=scale,
                            interpret=interpret, key_splits=key_splits)
    return flash_attention_bwd(q, suffix_k, suffix_v, d_out, lse, delta, causal=True,
                               kv_lengths=sl, sm_scale=scale, interpret=interpret)


def suffix_grads_reference(q, d_out, lse, delta, suffix_k, suffix_v, lim, *, scale: float):
    """Dense pure-JAX :func:`suffix_grads` (float32, ``precision=HIGHEST``)."""
    b = q.shape[0]
    # each sequence its own "prefix group": the same gradients
    return prefix_grads_reference(q, d_out, lse, delta, suffix_k, suffix_v,
                                  jnp.arange(b, dtype=jnp.int32), lim, scale=scale)
