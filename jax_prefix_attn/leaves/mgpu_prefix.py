"""The Mosaic GPU prefix kernel shared by the ``mgpu_*`` leaves: where it runs and pays (the
Mosaic GPU region), its prefix splits, and its call on the decode rows.

The Mosaic GPU leaves decode (``Tq == 1``) with one prefix on a GPU of compute capability >= 9.0.
The region: the kernel runs, at least the device's ``mgpu_min_ctas`` CTAs after splitting the
prefix and ``mgpu_min_real_rows`` of real (not padding) rows in its 128-row blocks
(:class:`jax_prefix_attn.device_profile.Tuning`).
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_prefix_attn.device_profile import Tuning, default_profile
from jax_prefix_attn.leaves.base import Shapes, suffix_splits, tuning
from pallas_kernels._common import cdiv, next_pow2, q_rows_layout, rows_from_q
from pallas_kernels.prefix_attention_mgpu import mgpu_supported, prefix_partials_mgpu

__all__ = ["even_enough", "choose_splits", "mgpu_ctas", "mgpu_splits", "mosaic_unsupported",
           "mosaic_region", "region_why_not", "mgpu_suffix_splits", "decode_operands",
           "mgpu_prefix_partials", "grouped_rows", "mgpu_grouped_prefix_partials"]


def even_enough(n_tiles: int, splits: int, split_waste: int | None = None) -> bool:
    """Whether ``splits`` prefix splits of ``ceil(n_tiles / splits)`` tiles each cover
    ``n_tiles`` tiles with every split holding one and at most ``n_tiles / split_waste`` tile
    steps past the last (the kernel re-reads the last tile there, all keys masked; default the
    planning device's ``split_waste``)."""
    waste = default_profile().tuning.split_waste if split_waste is None else split_waste
    per = cdiv(n_tiles, splits)
    return (splits - 1) * per < n_tiles and waste * (per * splits - n_tiles) <= n_tiles


def choose_splits(n_tiles: int, ctas: int, sms: int, *, uneven: bool = True,
                  tuned: Tuning | None = None) -> int:
    """Prefix splits for ``ctas`` (kv head, 128-row block) CTAs over ``n_tiles`` key tiles: 1
    when the CTAs fill most of a wave; with at least ``few_ctas``, the largest count up to 4 (2
    from ``long_tiles`` tiles) within two waves; with fewer, the largest up to 16 within one
    wave and at least 2 tiles per split.  Divisors of ``n_tiles`` first; where none above 1
    qualifies and ``uneven``, the largest :func:`even_enough` count (e.g. 127 tiles: 2): prefix
    splits need not divide the key tiles, the last may run past the end (masked re-reads of the
    last tile).  ``tuned``: the device's tuning (default the planning device's)."""
    t = default_profile().tuning if tuned is None else tuned
    if 4 * ctas >= 3 * sms:
        return 1
    few = ctas < t.few_ctas
    max_splits, limit = (16, sms) if few else (2 if n_tiles >= t.long_tiles else 4, 2 * sms)
    fits = [c for c in range(2, min(n_tiles, max_splits) + 1)
            if ctas * c <= limit and (not few or n_tiles // c >= 2)]
    return max([c for c in fits if n_tiles % c == 0]
               or [c for c in fits if uneven and even_enough(n_tiles, c, t.split_waste)] or [1])


def mgpu_ctas(s: Shapes) -> tuple[int, int]:
    """``(M128, (kv head, 128-row block) CTAs)`` of the Mosaic GPU kernels' decode rows."""
    m128 = cdiv(s.batch * next_pow2(s.group), 128) * 128
    return m128, s.heads_kv * (m128 // 128)


def mgpu_splits(s: Shapes, dev, *, uneven: bool = True) -> int:
    """Prefix splits of the Mosaic GPU prefix kernel (:func:`choose_splits`)."""
    _, ctas = mgpu_ctas(s)
    return choose_splits(max(1, s.prefix_len // 128), ctas, dev.sm_count, uneven=uneven,
                         tuned=tuning(dev))


def mosaic_unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    """``None`` when the Mosaic GPU prefix kernel runs these shapes (in interpret mode: on any
    device), else the reason."""
    if s.groups != 1 or s.tq != 1:
        return f"the Mosaic GPU leaves decode (Tq=1) with one prefix, got Tq={s.tq} G={s.groups}"
    if not interpret and not dev.mosaic_gpu_ok:
        return f"Mosaic GPU kernels need a GPU of compute capability >= 9.0, got {dev.name}"
    return mgpu_supported(rows=mgpu_ctas(s)[0], prefix_len=s.prefix_len, head_dim=s.head_dim,
                          dtype=s.dtype)


def mosaic_region(s: Shapes, dev, interpret: bool) -> bool:
    """The Mosaic GPU prefix kernel runs and has enough work: not interpret mode, a Hopper GPU,
    at least the device's ``mgpu_min_ctas`` CTAs after splitting and ``mgpu_min_real_rows`` real
    (not padding) rows in its 128-row blocks."""
    if interpret or mosaic_unsupported(s, dev, interpret) is not None:
        return False
    t = tuning(dev)
    m128, ctas = mgpu_ctas(s)
    # (the region counts divisor splits only: where the CTAs reach mgpu_min_ctas only through
    # uneven splits, the Mosaic GPU leaves' choice against the Triton ones was never timed)
    return (ctas * mgpu_splits(s, dev, uneven=False) >= t.mgpu_min_ctas
            and s.batch * next_pow2(s.group) / m128 >= t.mgpu_min_real_rows)


def region_why_not(s: Shapes, dev, interpret: bool) -> str | None:
    """``None`` inside the Mosaic GPU region, else the reason."""
    if mosaic_region(s, dev, interpret):
        return None
    why = mosaic_unsupported(s, dev, interpret)
    if why is None and interpret:
        return "interpret mode runs a Mosaic GPU leaf only when the plan forces it"
    t = tuning(dev)
    return why or (f"the Mosaic GPU prefix kernel needs >= {t.mgpu_min_ctas} CTAs after "
                   f"splitting and >= {t.mgpu_min_real_rows:.0%} real rows in its 128-row blocks")


def mgpu_suffix_splits(s: Shapes, dev) -> int:
    """Suffix splits beside the Mosaic GPU prefix kernel: split only below the device's
    ``mgpu_suffix_split_below`` (sequence, kv head) programs."""
    if s.batch * s.heads_kv >= tuning(dev).mgpu_suffix_split_below:
        return 1
    return suffix_splits(s, dev)


def decode_operands(q, prefix_k, prefix_v, lim_p, prefix_len_g):
    """``(q in the keys' dtype, pk [P, Hkv, D], pv, p_len)`` of a decode step with one prefix:
    ``p_len`` the prefix length as an int32 scalar (``prefix_len_g [1]`` as it is where given,
    else the largest row limit)."""
    p_len = jnp.max(lim_p) if prefix_len_g is None else prefix_len_g.reshape(())
    return q.astype(prefix_k.dtype), prefix_k[0], prefix_v[0], p_len


def mgpu_prefix_partials(q_bhd, k_phd, v_phd, length, *, scale, num_splits, interpret):
    """The Mosaic GPU prefix kernel on ``q_bhd [B, Hq, D]``: rows ``R2 = next_pow2(G)`` per
    sequence, 128-row blocks over the real rows only.  A suffix pass reading whole
    ``R16``-row tiles of the partials reads up to row ``M - R2 + R16``: those rows are allocated
    but left unwritten (they only feed discarded padding rows).  Returns ``(o [n, Hkv, M', D],
    lse [n, Hkv, M'])`` with query head ``h * G + j`` of sequence ``b`` at row ``b * R2 + j``."""
    b, hq, d = q_bhd.shape
    hkv = k_phd.shape[1]
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    m = b * r2
    m128 = cdiv(m, 128) * 128
    qm = rows_from_q(q_bhd[:, None], hkv, r2)  # [Hkv, m, D]
    qm = jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm
    # (interpret: Mosaic GPU's CPU interpreter, with its operand-form substitutions)
    return prefix_partials_mgpu(qm, k_phd, v_phd, length, scale=scale, interpret=interpret,
                                num_splits=num_splits, out_rows=max(m128, m - r2 + r16),
                                schedule_barrier=True, _cpu_check=interpret)


def grouped_rows(seq_to_prefix, groups: int, rows_per_seq: int, block_rows: int = 128):
    """A row layout with each prefix group in row blocks of its own, for the Mosaic GPU prefix
    kernel's ``block_group``: ``B`` sequences (``seq_to_prefix [B]`` int32, in ``[0, G)``) of
    ``rows_per_seq`` rows each (a power of two up to ``block_rows``).  Group ``g`` takes
    ``ceil(n_g * rows_per_seq / block_rows)`` consecutive blocks (its sequences in batch order),
    so ``ceil(B * rows_per_seq / block_rows) + G - 1`` blocks hold any assignment; blocks past
    the groups' belong to the last group and hold zero rows.  Returns ``(first_row [B] int32,
    block_group [n_blocks] int32)``."""
    b = seq_to_prefix.shape[0]
    r = int(rows_per_seq)
    n_blocks = cdiv(b * r, block_rows) + groups - 1
    counts = jnp.bincount(seq_to_prefix, length=groups)                       # [G]
    blocks = cdiv(counts * r, block_rows)                                      # [G]
    first_block = jnp.cumsum(blocks) - blocks
    first_seq = jnp.cumsum(counts) - counts                   # group g's first sorted position
    order = jnp.argsort(seq_to_prefix, stable=True)
    sorted_pos = jnp.zeros((b,), jnp.int32).at[order].set(jnp.arange(b, dtype=jnp.int32))
    rank = sorted_pos - first_seq[seq_to_prefix]
    first_row = (first_block[seq_to_prefix] * block_rows + rank * r).astype(jnp.int32)
    block_group = jnp.searchsorted(jnp.cumsum(blocks), jnp.arange(n_blocks), side="right")
    return first_row, jnp.minimum(block_group, groups - 1).astype(jnp.int32)


def mgpu_grouped_prefix_partials(q_bhd, k_gphd, v_gphd, lengths_g, seq_to_prefix, *, scale,
                                 num_splits, interpret):
    """The Mosaic GPU prefix kernel on ``q_bhd [B, Hq, D]`` over ``G`` prefixes ``k/v [G, P,
    Hkv, D]`` (keys ``[0, lengths_g[g])``; sequence ``b`` reads group ``seq_to_prefix[b]``):
    each group's rows in row blocks of their own (:func:`grouped_rows`).  Returns ``(o [n, Hkv,
    B * R2, D], lse [n, Hkv, B * R2])`` with query head ``h * G + j`` of sequence ``b`` at row
    ``b * R2 + j`` (``R2 = next_pow2(Hq / Hkv)``), as :func:`mgpu_prefix_partials`."""
    b, hq, d = q_bhd.shape
    groups, _, hkv, _ = k_gphd.shape
    r2 = next_pow2(hq // hkv)
    first_row, block_group = grouped_rows(seq_to_prefix, groups, r2)
    rows = (first_row[:, None] + jnp.arange(r2, dtype=jnp.int32)[None, :]).reshape(-1)  # [B R2]
    m = block_group.shape[0] * 128
    qm = jnp.zeros((hkv, m, d), q_bhd.dtype).at[:, rows].set(rows_from_q(q_bhd[:, None], hkv, r2))
    o, lse = prefix_partials_mgpu(qm, k_gphd, v_gphd, lengths_g, scale=scale, interpret=interpret,
                                  num_splits=num_splits, schedule_barrier=True,
                                  block_group=block_group, _cpu_check=interpret)
    return o[:, :, rows], lse[:, :, rows]
