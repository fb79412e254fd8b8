"""The decode suffix merge of tree attention's decoding paths, with its own gradient.

When decoding (``Tq == 1``) the paths end in one launch of the decode suffix kernel
(:func:`pallas_kernels.suffix_attention.suffix_decode_merge`): it attends each sequence's
suffix and merges the partial state of everything before it (tree partials, the roots' prefix
partials) in its epilogue, writing the output in q's layout, so the merge costs no extra pass
over the partial states.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn.planner import suffix_grad_key_splits
from jax_prefix_attn.tree_layout import part_cotangents
from pallas_kernels.suffix_attention import suffix_decode_merge, suffix_rows
from pallas_kernels.suffix_attention_bwd import suffix_part_grads

__all__ = ["as_incoming", "decode_suffix_merging"]


def as_incoming(o, lse, hq: int, hkv: int):
    """A normalised state ``o [B, ..., Hq, D]`` / ``lse [B, ..., Hq]`` (one query per sequence, any
    head grouping) in the layout the decode suffix kernel merges: ``([1, Hkv, B * G + pad, D],
    [1, Hkv, B * G + pad], stride G)``, padded because the kernel reads whole row tiles past the
    last sequence."""
    b, d = o.shape[0], o.shape[-1]
    g = hq // hkv
    pad = suffix_rows(hq, hkv) - g
    o_in = jnp.transpose(o.reshape(b, hkv, g, d), (1, 0, 2, 3)).reshape(1, hkv, b * g, d)
    l_in = jnp.transpose(lse.reshape(b, hkv, g), (1, 0, 2)).reshape(1, hkv, b * g)
    return (jnp.pad(o_in, ((0, 0), (0, 0), (0, pad), (0, 0))),
            jnp.pad(l_in, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf), g)



def decode_suffix_merging(q, o, lse, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                          interpret: bool):
    """``Tq == 1``: attend each sequence's suffix and merge the state ``(o, lse)`` (normalised,
    ``[B, 1, Hq(, D)]`` in any head grouping ``Hkv x G``) in the decode suffix kernel's epilogue
    (``pallas_kernels.suffix_attention``).  Returns ``(out [B, 1, Hq, D] in q's dtype,
    lse [B, 1, Hq])``.  Differentiable (:func:`_suffix_merge_bwd`: the suffix part through the
    backward kernels with the merged statistics, the incoming state through the merge's
    weights), so the paths that end in it (shallow trees) have gradients with kernels too."""
    return _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, float(scale),
                         bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret):
    return _suffix_merge_kernel(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale=scale,
                                interpret=interpret)


def _suffix_merge_fwd(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret):
    out, lse_out = _suffix_merge(q, o, lse, suffix_k, suffix_v, suffix_lengths, scale, interpret)
    return (out, lse_out), (q, o, lse, suffix_k, suffix_v, suffix_lengths, out, lse_out)


def _suffix_merge_bwd(scale, interpret, res, cts):
    """With ``lse_out = log(e^lse + e^l_s)`` and ``out = w o + (1 - w) o_s``, ``w = e^(lse -
    lse_out)``: ``d o = w dout``, ``d lse = w (<dout, o - out> + dlse_out)``; the suffix part is
    a flash backward with the merged statistics (``delta = <dout, out> - dlse_out``)."""
    q, o, lse, suffix_k, suffix_v, suffix_lengths, out, lse_out = res
    d_out, d_lse_out = cts
    b, _, hq, d = q.shape
    f32 = jnp.float32
    o_b = o.reshape(b, 1, hq, d).astype(f32)
    l_b = lse.reshape(b, 1, hq).astype(f32)
    dout, dlo = d_out.astype(f32), d_lse_out.astype(f32)
    d_o, d_l = part_cotangents(o_b, l_b, out, lse_out, dout, dlo)         # [B, 1, Hq(, D)]
    d_o = d_o.reshape(o.shape).astype(o.dtype)
    d_l = d_l.reshape(lse.shape)
    delta = jnp.sum(dout * out.astype(f32), axis=-1) - dlo
    dq, dk, dv = suffix_part_grads(
        q, dout.astype(q.dtype), lse_out, delta, suffix_k, suffix_v, suffix_lengths, scale=scale,
        interpret=interpret,
        key_splits=suffix_grad_key_splits(b, suffix_k.shape[2], suffix_k.shape[1]))
    f0 = np.zeros(np.shape(suffix_lengths), jax.dtypes.float0)
    return dq, d_o, d_l.astype(lse.dtype), dk, dv, f0


_suffix_merge.defvjp(_suffix_merge_fwd, _suffix_merge_bwd)


def _suffix_merge_kernel(q, o, lse, suffix_k, suffix_v, suffix_lengths, *, scale: float,
                         interpret: bool):
    o_in, l_in, g = as_incoming(o, lse, q.shape[2], suffix_k.shape[2])
    out, lse = suffix_decode_merge(q[:, 0].astype(suffix_k.dtype), suffix_k, suffix_v, suffix_lengths,
                                   (o_in, l_in), in_stride=g, scale=scale, interpret=interpret)
    return out[:, None].astype(q.dtype), lse[:, None]

