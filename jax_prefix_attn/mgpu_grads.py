"""The backward of shared-prefix attention on the Mosaic GPU flash-attention backward kernels
(the plan's ``backward="mgpu"``).

As in the Triton backward (:mod:`jax_prefix_attn.shared_prefix`), each part's gradient is a
flash-attention backward evaluated with the merged ``lse`` and ``delta = rowsum(dO * O) - dlse``
(``[B, Tq, Hq]``), and ``dq`` is the sum of the parts'.  Here both parts run
:func:`pallas_kernels.flash_attention_mgpu_bwd.flash_attention_mgpu_bwd`:

* **Suffix part**: the kernel on ``q [B, Tq, Hq, D]`` and ``suffix_k/v [B, S, Hkv, D]``, causal
  and aligned to ``suffix_lengths``: query ``i`` sees suffix keys ``j < sl - Tq + i + 1``, the
  library's convention.
* **Prefix part**, when the ``G`` prefix groups are contiguous runs of ``M = B / G`` sequences
  (``seq_to_prefix = [0]*M + [1]*M + ...``, the layout of GRPO-style batches): the rows of each
  group fold into one query axis, ``q [G, M * Tq, Hq, D]``, and one non-causal kernel call over
  ``prefix_k/v [G, P, Hkv, D]`` with ``kv_lengths = prefix_lengths`` gives ``dK``/``dV`` summed
  over the group's sequences inside the kernel (float32 accumulators), the prefix read once per
  group as in the forward.

That call is exact for the rows that see the whole prefix.  A row of sequence ``b`` at query
index ``i < Tq - sl_b`` sits inside the prefix (bottom-right alignment) and sees only its first
``pl + sl_b - Tq + i + 1`` keys; in the folded call such a row's ``lse`` is set to ``+inf``
(probabilities 0: it contributes nothing).  Its own contribution goes through the Triton prefix
backward (per-row limits), with every other row's cotangent zeroed, and only when one of those
rows has a non-zero cotangent (a branch on the device): batches whose padding rows carry no loss
never take it.  Prefix groups in another layout take the Triton prefix backward for the whole
part (also a branch on the device).

:func:`mgpu_backward_why_not` says when the kernels cannot take the shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_prefix_attn.reference import row_limits
from pallas_kernels import flash_attention_mgpu as mgpu_flash
from pallas_kernels.flash_attention_mgpu_bwd import flash_attention_mgpu_bwd
from pallas_kernels.prefix_attention_bwd import prefix_grads

__all__ = ["mgpu_backward_why_not", "mgpu_grads"]


def mgpu_backward_why_not(batch: int, tq: int, heads_q: int, heads_kv: int, head_dim: int,
                          groups: int, prefix_len: int, suffix_len: int, dtype) -> str | None:
    """``None`` when :func:`mgpu_grads` runs these shapes (``q [batch, tq, heads_q, head_dim]``,
    ``groups`` prefixes of ``prefix_len`` keys, suffix capacity ``suffix_len``), else why not."""
    why = mgpu_flash.supported((batch, tq, heads_q, head_dim), (batch, max(suffix_len, 1), heads_kv, head_dim),
                               dtype)
    if why is not None:
        return f"the Mosaic GPU flash backward: {why}"
    if prefix_len < 1:
        return "needs a prefix of at least one key"
    return None


def _contiguous_groups(seq_to_prefix: jax.Array, groups: int) -> jax.Array:
    """Whether ``seq_to_prefix [B]`` (clamped) is ``M`` sequences of group 0, then ``M`` of
    group 1, ... (``M = B / groups``; the caller checks that ``groups`` divides ``B``)."""
    b = seq_to_prefix.shape[0]
    return jnp.all(seq_to_prefix == jnp.arange(b, dtype=jnp.int32) // (b // groups))


def _row_has_cotangent(d_out: jax.Array, d_lse: jax.Array) -> jax.Array:
    """``[B, Tq]``: rows with a non-zero (or NaN) cotangent of ``out`` or of ``lse``."""
    return (d_out != 0).any(axis=(2, 3)) | (d_lse != 0).any(axis=2)


def mgpu_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
               suffix_lengths, lse, delta, d_out, d_lse, *, scale: float, interpret: bool = False,
               prefix_key_splits: int = 1, prefix_row_splits: int = 1):
    """``(dq, dprefix_k, dprefix_v, dsuffix_k, dsuffix_v)`` (float32) of shared-prefix attention
    (module docstring), from the merged ``lse [B, Tq, Hq]`` and ``delta [B, Tq, Hq]`` (float32)
    and the cotangents ``d_out [B, Tq, Hq, D]``, ``d_lse [B, Tq, Hq]``.  ``seq_to_prefix``,
    ``prefix_lengths`` and ``suffix_lengths`` are clamped (the caller's clamp rule).  The splits
    are the Triton prefix backward's, for the rows it takes."""
    b, tq, hq, d = q.shape
    g = prefix_k.shape[0]
    f32 = jnp.float32
    kw = dict(sm_scale=scale, interpret=interpret)
    triton_kw = dict(scale=scale, interpret=interpret, row_splits=prefix_row_splits,
                     key_splits=prefix_key_splits)

    # suffix part
    if suffix_k.shape[1]:
        dq_s, dsk, dsv = flash_attention_mgpu_bwd(q, suffix_k, suffix_v, d_out, lse, delta,
                                                  causal=True, kv_lengths=suffix_lengths, **kw)
    else:
        dq_s, dsk, dsv = jnp.zeros(q.shape, f32), jnp.zeros(suffix_k.shape, f32), jnp.zeros(suffix_v.shape, f32)

    # prefix part
    plen_b = prefix_lengths[seq_to_prefix]
    lim, _ = row_limits(tq, plen_b, suffix_lengths)                        # [B, Tq]
    whole = lim == plen_b[:, None]                                          # sees every prefix key

    def triton_part(rows):   # the Triton prefix backward on the rows of the mask [B, Tq]
        m4 = rows[:, :, None, None]
        out = prefix_grads(q, jnp.where(m4, d_out, 0), lse, jnp.where(rows[..., None], delta, 0),
                           prefix_k, prefix_v, seq_to_prefix, jnp.where(rows, lim, 0),
                           prefix_lengths, **triton_kw)
        return tuple(x.astype(f32) for x in out)

    def folded_part():
        m = b // g
        fold = lambda x: x.reshape((g, m * tq) + x.shape[2:])  # noqa: E731
        lse_w = jnp.where(whole[..., None], lse, jnp.inf)                   # partial rows: p = 0
        dq_f, dpk, dpv = flash_attention_mgpu_bwd(
            fold(q), prefix_k, prefix_v, fold(d_out), fold(lse_w), fold(delta), causal=False,
            kv_lengths=prefix_lengths, **kw)
        main = (dq_f.reshape(q.shape).astype(f32), dpk.astype(f32), dpv.astype(f32))
        partial = ~whole
        need = jnp.any(partial & _row_has_cotangent(d_out, d_lse))
        extra = jax.lax.cond(need, lambda: triton_part(partial),
                             lambda: tuple(jnp.zeros_like(x) for x in main))
        return tuple(x + y for x, y in zip(main, extra))

    everyone = jnp.ones((b, tq), bool)
    if b % g:
        dq_p, dpk, dpv = triton_part(everyone)
    elif g == 1:
        dq_p, dpk, dpv = folded_part()
    else:
        dq_p, dpk, dpv = jax.lax.cond(_contiguous_groups(seq_to_prefix, g), folded_part,
                                      lambda: triton_part(everyone))
    return dq_p + dq_s.astype(f32), dpk, dpv, dsk.astype(f32), dsv.astype(f32)
