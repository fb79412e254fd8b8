"""The Mosaic GPU prefix kernel shared by the ``mgpu_*`` leaves: where it runs and pays (the
Mosaic GPU region), its prefix splits, and its call on the decode rows.

The Mosaic GPU leaves decode (``Tq == 1``) with one prefix on a GPU of compute capability >= 9.0.
The region: the kernel runs, at least ``MGPU_MIN_CTAS`` CTAs after splitting the prefix and at
least ``MGPU_MIN_REAL_ROWS`` of real (not padding) rows in its 128-row blocks.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_prefix_attn.leaves.base import Shapes, suffix_splits
from pallas_kernels._common import cdiv, next_pow2, q_rows_layout, rows_from_q
from pallas_kernels.prefix_attention_mgpu import mgpu_supported, prefix_partials_mgpu

__all__ = ["MGPU_MIN_CTAS", "MGPU_MIN_REAL_ROWS", "FEW_CTAS", "LONG_TILES", "SPLIT_WASTE",
           "MGPU_SUFFIX_SPLIT_BELOW", "even_enough", "choose_splits", "mgpu_ctas", "mgpu_splits",
           "mosaic_unsupported", "mosaic_region", "region_why_not", "mgpu_suffix_splits",
           "decode_operands", "mgpu_prefix_partials"]

# At least this many CTAs after splitting the prefix and this share of real (not padding) rows
# in its 128-row blocks.
MGPU_MIN_CTAS = 64
MGPU_MIN_REAL_ROWS = 0.75
# choose_splits: below FEW_CTAS (kv head, 128-row block) CTAs split to about one wave; from
# LONG_TILES key tiles (a 14K prefix) at most 2 splits with >= FEW_CTAS CTAs.
FEW_CTAS = 48
LONG_TILES = 112
# Prefix splits need not divide the key tiles: the last split may run up to 1 / SPLIT_WASTE of
# the tiles past the end (fully masked re-reads of the last tile).  A 16256-key prefix (127
# tiles, a prime) then gets 2 splits rather than 1 (64 CTAs on 132 SMs at Hq=32/Hkv=8, B=256).
SPLIT_WASTE = 16
# Beside the Mosaic GPU prefix kernel the suffix is split only below this many (sequence, kv
# head) programs.
MGPU_SUFFIX_SPLIT_BELOW = 256


def even_enough(n_tiles: int, splits: int) -> bool:
    """Whether ``splits`` prefix splits of ``ceil(n_tiles / splits)`` tiles each cover
    ``n_tiles`` tiles with every split holding one and at most ``n_tiles / SPLIT_WASTE`` tile
    steps past the last (the kernel re-reads the last tile there, all keys masked)."""
    per = cdiv(n_tiles, splits)
    return (splits - 1) * per < n_tiles and SPLIT_WASTE * (per * splits - n_tiles) <= n_tiles


def choose_splits(n_tiles: int, ctas: int, sms: int, *, uneven: bool = True) -> int:
    """Prefix splits for ``ctas`` (kv head, 128-row block) CTAs over ``n_tiles`` key tiles: 1
    when the CTAs fill most of a wave; with at least FEW_CTAS, the largest count up to 4 (2 from
    LONG_TILES tiles) within two waves; with fewer, the largest up to 16 within one wave and at
    least 2 tiles per split.  Divisors of ``n_tiles`` first; where none above 1 qualifies and
    ``uneven``, the largest :func:`even_enough` count (e.g. 127 tiles: 2)."""
    if 4 * ctas >= 3 * sms:
        return 1
    few = ctas < FEW_CTAS
    max_splits, limit = (16, sms) if few else (2 if n_tiles >= LONG_TILES else 4, 2 * sms)
    fits = [c for c in range(2, min(n_tiles, max_splits) + 1)
            if ctas * c <= limit and (not few or n_tiles // c >= 2)]
    return max([c for c in fits if n_tiles % c == 0]
               or [c for c in fits if uneven and even_enough(n_tiles, c)] or [1])


def mgpu_ctas(s: Shapes) -> tuple[int, int]:
    """``(M128, (kv head, 128-row block) CTAs)`` of the Mosaic GPU kernels' decode rows."""
    m128 = cdiv(s.batch * next_pow2(s.group), 128) * 128
    return m128, s.heads_kv * (m128 // 128)


def mgpu_splits(s: Shapes, dev, *, uneven: bool = True) -> int:
    """Prefix splits of the Mosaic GPU prefix kernel (:func:`choose_splits`)."""
    _, ctas = mgpu_ctas(s)
    return choose_splits(max(1, s.prefix_len // 128), ctas, dev.sm_count, uneven=uneven)


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
    >= MGPU_MIN_CTAS CTAs after splitting, >= MGPU_MIN_REAL_ROWS real rows."""
    if interpret or mosaic_unsupported(s, dev, interpret) is not None:
        return False
    m128, ctas = mgpu_ctas(s)
    # (the region counts divisor splits only: where the CTAs reach MGPU_MIN_CTAS only through
    # uneven splits, the Mosaic GPU leaves' choice against the Triton ones was never timed)
    return (ctas * mgpu_splits(s, dev, uneven=False) >= MGPU_MIN_CTAS
            and s.batch * next_pow2(s.group) / m128 >= MGPU_MIN_REAL_ROWS)


def region_why_not(s: Shapes, dev, interpret: bool) -> str | None:
    """``None`` inside the Mosaic GPU region, else the reason."""
    if mosaic_region(s, dev, interpret):
        return None
    why = mosaic_unsupported(s, dev, interpret)
    if why is None and interpret:
        return "interpret mode runs a Mosaic GPU leaf only when the plan forces it"
    return why or (f"the Mosaic GPU prefix kernel needs >= {MGPU_MIN_CTAS} CTAs after splitting "
                   f"and >= {MGPU_MIN_REAL_ROWS:.0%} real rows in its 128-row blocks")


def mgpu_suffix_splits(s: Shapes, dev) -> int:
    """Suffix splits beside the Mosaic GPU prefix kernel."""
    if s.batch * s.heads_kv >= MGPU_SUFFIX_SPLIT_BELOW:
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
