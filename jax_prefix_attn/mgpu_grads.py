"""The backward of shared-prefix attention on the Mosaic GPU flash-attention backward kernels
(the plan's ``backward="mgpu"``).

As in the Triton backward (:mod:`jax_prefix_attn.shared_prefix`), each part's gradient is a
flash-attention backward evaluated with the merged ``lse`` and ``delta = rowsum(dO * O) - dlse``
(``[B, Tq, Hq]``), and ``dq`` is the sum of the parts'.  Here both parts run
:func:`pallas_kernels.flash_attention_mgpu_bwd.flash_attention_mgpu_bwd`:

* **Suffix part**: the kernel on ``q [B, Tq, Hq, D]`` and ``suffix_k/v [B, S, Hkv, D]``, causal
  and aligned to ``suffix_lengths``: query ``i`` sees suffix keys ``j < sl - Tq + i + 1``, the
  library's convention.
* **Prefix part**, when each of the ``G`` prefix groups holds ``M = B / G`` sequences (the
  layout of GRPO-style batches; the rows are permuted so that the groups are contiguous runs):
  the rows of each group fold into one query axis, ``q [G, M * Tq, Hq, D]``, and one non-causal
  kernel call over ``prefix_k/v [G, P, Hkv, D]`` with ``kv_lengths = prefix_lengths`` gives
  ``dK``/``dV`` summed over the group's sequences inside the kernel (float32 accumulators), the
  prefix read once per group as in the forward.

That call is exact for the rows that see the whole prefix.  A row of sequence ``b`` at query
index ``i < Tq - sl_b`` sits inside the prefix (bottom-right alignment) and sees only its first
``pl + sl_b - Tq + i + 1`` keys; in the folded call such a row's ``lse`` is ``+inf``
(probabilities 0: it contributes nothing).  When one of those rows has a non-zero cotangent (a
branch on the device: batches whose padding rows carry no loss never take it), the prefix part
splits at ``start = max(pl - Tq, 0)``, a point every row of the sequence sees past:

* the **head** ``[0, start)``: the folded call above with ``kv_lengths = start`` and every row;
* the **tail** ``[start, pl)`` (at most ``Tq`` keys): per sequence, a gathered ``[B, Tq]`` copy
  followed by ``Tq`` zero keys, causal with length ``(pl - start) + min(sl, Tq)``, so each row
  sees exactly the tail keys before it (a zero key has ``V = 0`` and its ``dK``/``dV`` are
  dropped: it adds nothing); its ``dK``/``dV`` are added into the groups' rows in float32.

The extra memory is ``[B, 2 Tq]`` keys, not a per-sequence copy of the prefix.  Groups of
unequal sizes (or ``B`` not a multiple of ``G``) take the whole-prefix or head call ``C``
sequences at a time in a loop (``C`` the largest divisor of ``B`` up to ``G``), each over copies
of its own prefix: the same flops, and the memory of the folded call.

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


def _row_has_cotangent(d_out: jax.Array, d_lse: jax.Array) -> jax.Array:
    """``[B, Tq]``: rows with a non-zero (or NaN) cotangent of ``out`` or of ``lse``."""
    return (d_out != 0).any(axis=(2, 3)) | (d_lse != 0).any(axis=2)


def _flash_bwd(q, k, v, d_out, lse, delta, rows, *, causal, lengths, scale, interpret):
    """The Mosaic GPU flash backward of the rows of the mask ``rows [B, Tq]`` with a finite or
    NaN ``lse`` (the others -- rows left out, heads that see no key -- get ``lse = +inf`` and
    zero cotangents: probabilities 0, no contribution from the zero keys a call appends, and no
    NaN of theirs crosses into another row's gradients), float32 gradients."""
    keep = rows[..., None] & (lse != -jnp.inf)                              # [B, Tq, Hq]
    lse_r = jnp.where(keep, lse, jnp.inf)
    d_out_r = jnp.where(keep[..., None], d_out, 0)
    delta_r = jnp.where(keep, delta, 0)
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

    def folded(rows, lengths_g, order=None):
        """Every group's ``M = B / G`` sequences (in ``order``, a permutation making the groups
        contiguous runs) folded into one query axis, one call over the prefixes."""
        m = b // g
        take = (lambda x: x) if order is None else (lambda x: x[order])  # noqa: E731
        fold = lambda x: take(x).reshape((g, m * tq) + x.shape[2:])       # noqa: E731
        dq_f, dpk, dpv = _flash_bwd(fold(q), prefix_k, prefix_v, fold(d_out), fold(lse),
                                    fold(delta), fold(rows), causal=False, lengths=lengths_g,
                                    **kw)
        dq_f = dq_f.reshape(q.shape)
        return (dq_f if order is None else dq_f[jnp.argsort(order)]), dpk, dpv

    def chunked(rows, lengths_g):
        """``C`` sequences per call (``C`` the largest divisor of ``B`` up to ``G``: the memory
        of the folded call), each over copies of its own prefix, in a loop."""
        c = max(x for x in range(1, g + 1) if b % x == 0)
        split_ = lambda x: x.reshape((b // c, c) + x.shape[1:])  # noqa: E731

        def body(acc, xs):
            q_c, do_c, lse_c, delta_c, rows_c, s2p_c = xs
            lengths = lengths_g[s2p_c]
            keep = (jnp.arange(p, dtype=jnp.int32)[None, :] < lengths[:, None])[..., None, None]
            k_c, v_c = (jnp.where(keep, x[s2p_c], 0) for x in (prefix_k, prefix_v))
            dq_c, dk_c, dv_c = _flash_bwd(q_c, k_c, v_c, do_c, lse_c, delta_c, rows_c,
                                          causal=False, lengths=lengths, **kw)
            return (acc[0].at[s2p_c].add(dk_c), acc[1].at[s2p_c].add(dv_c)), dq_c
        zeros = jnp.zeros(prefix_k.shape, f32)
        (dpk, dpv), dq = jax.lax.scan(body, (zeros, zeros), tuple(
            split_(x) for x in (q, d_out, lse, delta, rows, seq_to_prefix)))
        return dq.reshape(q.shape), dpk, dpv

    def full_keys(rows, lengths_g):        # rows that see the first lengths_g[group] keys
        if g == 1:
            return folded(rows, lengths_g)
        if b % g:
            return chunked(rows, lengths_g)
        equal = jnp.all(jnp.bincount(seq_to_prefix, length=g) == b // g)
        return jax.lax.cond(
            equal, lambda: folded(rows, lengths_g, jnp.argsort(seq_to_prefix, stable=True)),
            lambda: chunked(rows, lengths_g))

    def tail():                            # every row over the last <= Tq keys of its prefix
        start = jnp.maximum(plen_b - tq, 0)                                 # [B]
        n_tail = plen_b - start                                             # [B], <= Tq
        pos = start[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]     # [B, Tq]
        valid = (pos < plen_b[:, None])[..., None, None]
        k_t, v_t = (jnp.pad(jnp.where(valid, x[seq_to_prefix[:, None], jnp.minimum(pos, p - 1)], 0),
                            ((0, 0), (0, tq), (0, 0), (0, 0))) for x in (prefix_k, prefix_v))
        dq, dk_t, dv_t = _flash_bwd(q, k_t, v_t, d_out, lse, delta, everyone, causal=True,
                                    lengths=n_tail + jnp.minimum(suffix_lengths, tq), **kw)
        scatter = lambda x: jnp.zeros((g, p) + x.shape[2:], f32).at[             # noqa: E731
            seq_to_prefix[:, None], pos].add(jnp.where(valid, x[:, :tq], 0), mode="drop")
        return dq, scatter(dk_t), scatter(dv_t)

    def split():
        head = full_keys(everyone, jnp.maximum(prefix_lengths - tq, 0))
        return tuple(x + y for x, y in zip(head, tail()))

    need = jnp.any(~whole & _row_has_cotangent(d_out, d_lse))
    dq_p, dpk, dpv = jax.lax.cond(need, split, lambda: full_keys(whole, prefix_lengths))
    return dq_p + dq_s, dpk, dpv, dsk, dsv
