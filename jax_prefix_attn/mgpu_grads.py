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
``pl + sl_b - Tq + i + 1`` keys; in the folded call such a row's ``lse`` is ``+inf``
(probabilities 0: it contributes nothing).  Those rows take one more call, only when one of them
has a non-zero cotangent (a branch on the device: batches whose padding rows carry no loss never
take it): per sequence, over a copy of its prefix (zero past the prefix length) followed by
``Tq`` zero keys, causal with length ``pl + min(sl, Tq)``, every other row's ``lse`` at ``+inf``;
its per-sequence ``dK``/``dV`` are summed into the groups in float32.  Prefix groups in another
layout (or ``B`` not a multiple of ``G``) take the per-sequence form for the whole rows too
(non-causal, length ``pl``): the same flops, with per-sequence copies of the prefix.

:func:`mgpu_backward_why_not` says when the kernels cannot take the shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_prefix_attn.reference import row_limits
from pallas_kernels import flash_attention_mgpu as mgpu_flash
from pallas_kernels.flash_attention_mgpu_bwd import flash_attention_mgpu_bwd

__all__ = ["mgpu_backward_why_not", "mgpu_grads"]


def mgpu_backward_why_not(batch: int, tq: int, heads_q: int, heads_kv: int, head_dim: int,
                          groups: int, prefix_len: int, suffix_len: int, dtype) -> str | None:
    """``None`` when :func:`mgpu_grads` runs these shapes (``q [batch, tq, heads_q, head_dim]``,
    ``groups`` prefixes of ``prefix_len`` keys, suffix capacity ``suffix_len``), else why not."""
    why = mgpu_flash.supported((batch, tq, heads_q, head_dim),
                               (batch, max(suffix_len, 1), heads_kv, head_dim), dtype)
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


def _flash_bwd(q, k, v, d_out, lse, delta, rows, *, causal, lengths, scale, interpret):
    """The Mosaic GPU flash backward of the rows of the mask ``rows [B, Tq]`` (the others get
    ``lse = +inf`` and zero cotangents: probabilities 0, no contribution, and no NaN of theirs
    crosses into another row's gradients), float32 gradients."""
    lse_r = jnp.where(rows[..., None], lse, jnp.inf)
    d_out_r = jnp.where(rows[..., None, None], d_out, 0)
    delta_r = jnp.where(rows[..., None], delta, 0)
    out = flash_attention_mgpu_bwd(q, k, v, d_out_r, lse_r, delta_r, causal=causal,
                                   kv_lengths=lengths, sm_scale=scale, interpret=interpret)
    return tuple(x.astype(jnp.float32) for x in out)


def mgpu_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
               suffix_lengths, lse, delta, d_out, d_lse, *, scale: float, interpret: bool = False):
    """``(dq, dprefix_k, dprefix_v, dsuffix_k, dsuffix_v)`` (float32) of shared-prefix attention
    (module docstring), from the merged ``lse [B, Tq, Hq]`` and ``delta [B, Tq, Hq]`` (float32)
    and the cotangents ``d_out [B, Tq, Hq, D]``, ``d_lse [B, Tq, Hq]``.  ``seq_to_prefix``,
    ``prefix_lengths`` and ``suffix_lengths`` are clamped (the caller's clamp rule)."""
    b, tq, hq, d = q.shape
    g, p = prefix_k.shape[:2]
    f32 = jnp.float32
    kw = dict(scale=scale, interpret=interpret)
    everyone = jnp.ones((b, tq), bool)

    # suffix part
    if suffix_k.shape[1]:
        dq_s, dsk, dsv = _flash_bwd(q, suffix_k, suffix_v, d_out, lse, delta, everyone, causal=True,
                                    lengths=suffix_lengths, **kw)
    else:
        dq_s, dsk, dsv = (jnp.zeros(x.shape, f32) for x in (q, suffix_k, suffix_v))

    # prefix part
    plen_b = prefix_lengths[seq_to_prefix]
    lim, _ = row_limits(tq, plen_b, suffix_lengths)                        # [B, Tq]
    whole = lim == plen_b[:, None]                                          # sees every prefix key

    def to_groups(dq, dk_b, dv_b):
        return (dq, jax.ops.segment_sum(dk_b, seq_to_prefix, num_segments=g),
                jax.ops.segment_sum(dv_b, seq_to_prefix, num_segments=g))

    def per_sequence(rows, causal):
        keep = (jnp.arange(p, dtype=jnp.int32)[None, :] < plen_b[:, None])[..., None, None]
        extra = tq if causal else 0                       # zero keys after the prefix (causal form)
        k_b, v_b = (jnp.pad(jnp.where(keep, x[seq_to_prefix], 0), ((0, 0), (0, extra), (0, 0), (0, 0)))
                    for x in (prefix_k, prefix_v))
        lengths = plen_b + jnp.minimum(suffix_lengths, tq) if causal else plen_b
        dq, dk_b, dv_b = _flash_bwd(q, k_b, v_b, d_out, lse, delta, rows, causal=causal,
                                    lengths=lengths, **kw)
        return to_groups(dq, dk_b[:, :p], dv_b[:, :p])

    def folded():
        m = b // g
        fold = lambda x: x.reshape((g, m * tq) + x.shape[2:])  # noqa: E731
        dq_f, dpk, dpv = _flash_bwd(fold(q), prefix_k, prefix_v, fold(d_out), fold(lse),
                                    fold(delta), fold(whole), causal=False, lengths=prefix_lengths,
                                    **kw)
        return dq_f.reshape(q.shape), dpk, dpv

    if b % g:
        main = per_sequence(whole, causal=False)
    elif g == 1:
        main = folded()
    else:
        main = jax.lax.cond(_contiguous_groups(seq_to_prefix, g), folded,
                            lambda: per_sequence(whole, causal=False))
    inside = ~whole
    need = jnp.any(inside & _row_has_cotangent(d_out, d_lse))
    extra = jax.lax.cond(need, lambda: per_sequence(inside, causal=True),
                         lambda: tuple(jnp.zeros_like(x) for x in main))
    dq_p, dpk, dpv = (x + y for x, y in zip(main, extra))
    return dq_p + dq_s, dpk, dpv, dsk, dsv
