"""Differentiable Mosaic GPU flash attention: :func:`flash_attention_mgpu_vjp` returns ``(out,
lse)`` from :func:`pallas_kernels.flash_attention_mgpu.flash_attention_mgpu` and differentiates
through both with :func:`pallas_kernels.flash_attention_mgpu_bwd.flash_attention_mgpu_bwd`.

The LSE cotangent enters through ``delta_i = rowsum(dO_i * O_i) - dlse_i`` (``d lse_i / d s_ij =
p_ij``), one XLA reduction over ``D`` in the backward rule, so gradients through an exact merge of
several attention parts stay exact.  Contract (shapes, mask, ``kv_lengths``, empty rows, dtypes)
as the forward's; ``kv_lengths`` gets no cotangent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention_mgpu import default_block_kv, flash_attention_mgpu, supported
from pallas_kernels.flash_attention_mgpu_bwd import flash_attention_mgpu_bwd, resolve_tiles

__all__ = ["flash_attention_mgpu_vjp"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _core(q, k, v, lengths, causal, fwd_opts, bwd_opts):
    return flash_attention_mgpu(q, k, v, causal=causal, kv_lengths=lengths, **dict(fwd_opts))


def _core_fwd(q, k, v, lengths, causal, fwd_opts, bwd_opts):
    out, lse = flash_attention_mgpu(q, k, v, causal=causal, kv_lengths=lengths, **dict(fwd_opts))
    return (out, lse), (q, k, v, lengths, out, lse)


def _core_bwd(causal, fwd_opts, bwd_opts, res, cts):
    q, k, v, lengths, out, lse = res
    d_out, d_lse = cts
    delta = (jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
             - d_lse.astype(jnp.float32))                                   # [B, Tq, Hq]
    dq, dk, dv = flash_attention_mgpu_bwd(q, k, v, d_out.astype(q.dtype), lse, delta,
                                          causal=causal, kv_lengths=lengths, **dict(bwd_opts))
    return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)


def flash_attention_mgpu_vjp(q, k, v, *, causal: bool = False, kv_lengths=None, sm_scale=None,
                             block_q: int = 64, block_kv: int | None = None, num_stages: int = 2,
                             schedule_barrier: bool = True, bwd_tiles: dict | None = None,
                             interpret: bool = False):
    """``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)`` of Mosaic GPU flash attention,
    differentiable with respect to ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]`` through both
    outputs.

    ``causal``, ``kv_lengths`` (int ``[B]``), ``sm_scale``, ``block_q``, ``block_kv``,
    ``num_stages``, ``schedule_barrier``: the forward's (see :func:`flash_attention_mgpu`).
    ``bwd_tiles``: keyword arguments of :func:`flash_attention_mgpu_bwd`'s tiles
    (``block_q_dq``, ``block_kv_dq``, ``block_kv_dkv``, ``block_q_dkv``, ``num_stages``,
    ``compute_wgs``, ``split_dkv_columns``; default its own).  ``interpret`` runs both in Mosaic GPU's CPU interpreter.
    Raises what the forward raises, and ``ValueError``/``TypeError`` for bad ``bwd_tiles``
    (unknown keys, values, or tiles over a Hopper SM's shared memory).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not isinstance(bwd_tiles, (dict, type(None))):
        raise TypeError(f"bwd_tiles must be a dict or None, got {type(bwd_tiles).__name__}")
    if supported(q.shape, k.shape, q.dtype) is None:   # (otherwise the forward says why)
        resolve_tiles(q.shape[3], q.dtype, **(bwd_tiles or {}), interpret=interpret)
    if block_kv is None and q.ndim == 4:
        block_kv = default_block_kv(q.shape[3])
    fwd_opts = (("sm_scale", sm_scale), ("block_q", block_q), ("block_kv", block_kv),
                ("num_stages", num_stages), ("schedule_barrier", bool(schedule_barrier)),
                ("interpret", bool(interpret)))
    bwd_opts = tuple(sorted((bwd_tiles or {}).items())) + (("sm_scale", sm_scale),
                                                           ("interpret", bool(interpret)))
    return _core(q, k, v, kv_lengths, bool(causal), fwd_opts, bwd_opts)
