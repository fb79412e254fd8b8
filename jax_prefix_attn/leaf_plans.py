"""Regions and tilings of the planner's leaves (see :mod:`jax_prefix_attn.planner` for the tree).

Each leaf's region predicate (where it was measured to pay) and builder (its tiling and splits
for one query chunk).  The device facts come from a :class:`DeviceInfo`: ``sm_count`` sizes the
grids (two programs per SM fill the GPU: ``2 * sm_count``, 264 on an H100 SXM / H200),
``smem_per_block`` bounds the Mosaic GPU kernels' pipelines.  The measurements behind each
region and tiling are in ``docs/performance.md`` ("Planner regions and tilings").
"""
from __future__ import annotations

import types

import jax.numpy as jnp

from jax_prefix_attn.device import DeviceInfo
from jax_prefix_attn.plans import (FlatOwn, FlatRows, MgpuJoint, MgpuOneLaunch, MgpuSplit,
                                   MgpuTwoLaunch, PrefixTiling, Shapes, SuffixTiling,
                                   TritonOverlap, TritonTwoLaunch)
from pallas_kernels import joint_decode_mgpu, shared_decode_mgpu, split_decode_mgpu
from pallas_kernels import suffix_stream_mgpu
from pallas_kernels._common import MAX_ROWS_PER_TILE, cdiv, next_pow2, split_chunk
from pallas_kernels.prefix_attention_mgpu import mgpu_supported

__all__ = ["query_chunks", "flat_layout", "flat_own_leaf", "flat_own_tiling", "busy_splits", "mosaic_region",
           "split_region", "joint_region", "one_launch_region", "mosaic_why_not", "build_leaf",
           "prefix_tiling", "mgpu_splits", "choose_splits", "even_enough", "plan_roles", "DECODE_SUFFIX"]

DECODE_SUFFIX = SuffixTiling(block_k=32, num_warps=2, num_stages=3)   # planner.DECODE_SUFFIX_TILING
ROW_SUFFIX = SuffixTiling(block_k=64, num_warps=4, num_stages=3)      # row-layout suffix pass
# Triton prefix kernel with enough rows to run unsplit: 64-key tiles, 8 warps, 3 stages and the
# two-phase key loop (otherwise 128 x 64 tiles, 4 warps, 2 stages).
LARGE_M_TILING = types.MappingProxyType(dict(block_k=64, num_warps=8, num_stages=3))
# Flat own-layout tiling by program count (kv heads x sequences x key splits): up to the bound,
# that tiling (None: any count).
FLAT_TILES = ((400, SuffixTiling(128, 4, 2)), (1024, SuffixTiling(64, 4, 2)),
              (None, SuffixTiling(32, 2, 3)))
# Key splits of the flat own-layout decode when its (sequence, kv head) programs cannot fill the
# GPU: as many as make two programs per SM, each at least FLAT_OWN_MIN_SPLIT_KEYS keys (prefix
# and suffix together), at most FLAT_OWN_MAX_SPLITS (None: no cap); no key tile longer than a
# split (see flat_own_tiling); splits the kernel would leave without keys are dropped
# (busy_splits).  ``bench/flat_decode_sweep.py`` fits the two constants ("rule_fit").
FLAT_OWN_MIN_SPLIT_KEYS = 64
FLAT_OWN_MAX_SPLITS = 64
# At most FLAT_TILES[0]'s bound of programs, each streaming a prefix chunk longer than this:
# the flat row layout instead of the own layout.
FLAT_OWN_MAX_CHUNK = 1024
# Mosaic GPU prefix kernel: at least this many CTAs after splitting the prefix and this share
# of real (not padding) rows in its 128-row blocks.
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
# mgpu_one_launch: (prefix keys, suffix capacity, minimum G) regions, at least
# ONE_LAUNCH_MIN_CTAS prefix CTAs and G >= ONE_LAUNCH_MIN_GROUP (the suffix tasks spend 64 / G
# times the useful tensor-core work).
ONE_LAUNCH_REGIONS = (((4096, 4096), (128, 256), 4), ((16384, 16384), (1024, 1024), 8))
ONE_LAUNCH_MIN_CTAS = 64
ONE_LAUNCH_MIN_GROUP = 4
# mgpu_joint: (prefix keys, suffix capacity, minimum G, minimum CTAs before splitting) regions.
JOINT_REGIONS = (((1024, 4096), (64, 64), 4, 16), ((1024, 4096), (64, 256), 8, 64))
JOINT_STAGES = 2
# Without ping-pong turns a warpgroup's suffix tile does not hold the other at its next turn.
JOINT_SCHEDULE_BARRIER = False
# mgpu_split: G = SPLIT_GROUP, B * G >= SPLIT_MIN_ROWS, D = 128, (prefix, suffix) in a region.
SPLIT_REGIONS = (((4096, 8192), (64, 256)), ((16384, 16384), (128, 256)))
SPLIT_GROUP = 4
SPLIT_MIN_ROWS = 2048
# plan_roles's time model of the role-split launch: the prefix role's FLOP/s per CTA (the whole
# kernel's rate over 132 SMs), a fixed cost per prefix task (pipeline fill, q load, output),
# the suffix K/V bytes/s per stream CTA (latency bound).
ROLE_PREFIX_FLOPS = 5.5e14 / 132
ROLE_TASK_S = 2.5e-6
ROLE_STREAM_BPS = 5.5e10


def query_chunks(tq: int, group: int, max_rows: int = MAX_ROWS_PER_TILE) -> list:
    """``[(start, stop), ...]`` over ``Tq`` so that each chunk has at most ``max_rows`` rows
    (``chunk * group`` rows, at least one position per chunk)."""
    step = max(1, max_rows // group)
    return [(c, min(c + step, tq)) for c in range(0, tq, step)]


def _two_per_sm(dev: DeviceInfo) -> int:
    return 2 * dev.sm_count


def _splits_to_fill(programs: int, keys: int, block_k: int, target: int) -> int:
    """Key splits so that ``programs * splits`` reaches ``target``, at least two tiles each."""
    if programs >= target:
        return 1
    return max(1, min(cdiv(target, programs), cdiv(keys, 2 * block_k)))


def flat_splits(s: Shapes, dev: DeviceInfo) -> int:
    return _splits_to_fill(s.batch * s.heads_kv, s.prefix_len + s.suffix_len, 128,
                           _two_per_sm(dev))


def flat_own_leaf(s: Shapes, dev: DeviceInfo, *, min_split_keys: int = FLAT_OWN_MIN_SPLIT_KEYS,
                  max_splits: int | None = FLAT_OWN_MAX_SPLITS) -> FlatOwn:
    """The flat own-layout decode's leaf: key splits enough for ``2 * SMs`` (sequence, kv head,
    split) programs, at least ``min_split_keys`` keys per split, at most ``max_splits``; the
    :func:`flat_own_tiling` of its programs and keys per split.  (The keyword arguments let a tuning
    sweep evaluate other values of the module constants.)"""
    programs = s.batch * s.heads_kv
    n = 1
    if programs < _two_per_sm(dev):
        n = min(cdiv(_two_per_sm(dev), programs), cdiv(s.prefix_len + s.suffix_len, min_split_keys))
        n = max(1, n if max_splits is None else min(n, max_splits))
    tiling = flat_own_tiling(s, n)
    while n > 1 and (used := busy_splits(s.prefix_len, s.suffix_len, n, tiling.block_k)) < n:
        n = used                       # (splits past the last key would run idle programs)
        tiling = flat_own_tiling(s, n)
    return FlatOwn(num_splits=n, tiling=tiling)


def busy_splits(prefix_len: int, suffix_len: int, num_splits: int, block_k: int) -> int:
    """How many of ``num_splits`` key splits hold keys: the decode kernel cuts the prefix and the
    suffix separately into chunks of whole ``block_k`` tiles (``_common.split_chunk``), so the
    last splits can be empty when a split's share is not a whole number of tiles."""
    def used(n: int) -> int:
        return cdiv(n, split_chunk(n, num_splits, block_k)) if n else 0
    return max(1, used(prefix_len), used(suffix_len))


def flat_own_tiling(s: Shapes, num_splits: int) -> SuffixTiling:
    """The :data:`FLAT_TILES` tiling of the flat own-layout decode with ``num_splits`` key splits:
    the one for its ``B * Hkv * num_splits`` programs, or, where that tiling's key tile is longer
    than a split's keys (prefix and suffix), the tiling with the longest tile that fits one (a
    split shorter than one tile would leave the last splits without keys)."""
    programs = s.batch * s.heads_kv * num_splits
    tiling = next(t for bound, t in FLAT_TILES if bound is None or programs <= bound)
    split_keys = cdiv(s.prefix_len + s.suffix_len, num_splits)
    if num_splits == 1 or tiling.block_k <= split_keys:
        return tiling
    tiles = sorted((t for _, t in FLAT_TILES), key=lambda t: t.block_k)
    shorter = [t for t in tiles if t.block_k <= split_keys]
    return shorter[-1] if shorter else tiles[0]


def flat_layout(s: Shapes, dev: DeviceInfo) -> str:
    """``"own"`` or ``"rows"`` for the flat decode (``Tq == 1``): the row layout where the own
    layout's programs (:func:`flat_own_leaf`) are few and each streams a long prefix chunk."""
    n = flat_own_leaf(s, dev).num_splits
    programs = s.batch * s.heads_kv * n
    return "rows" if programs <= FLAT_TILES[0][0] and cdiv(s.prefix_len, n) > FLAT_OWN_MAX_CHUNK \
        else "own"


def large_m_layout(batch: int, rows_per_seq: int, heads_kv: int, target: int) -> bool:
    """Enough rows that the Triton prefix kernel runs unsplit 128-row blocks (the configuration
    of the two-phase key loop)."""
    m = batch * next_pow2(rows_per_seq)
    return m >= 1024 and heads_kv * cdiv(m + 16, 128) >= target


def prefix_tiling(batch: int, rows_per_seq: int, heads_kv: int, prefix_len: int,
                  target: int) -> PrefixTiling:
    """Tiling of the Triton prefix kernel: ``target`` programs (two per SM) by splitting the
    prefix when the (kv head, row block) programs are fewer."""
    r2 = next_pow2(rows_per_seq)
    m = batch * r2
    block_m = 128 if m >= 1024 else 64 if m >= 64 else max(16, next_pow2(m))
    block_m = max(block_m, r2)
    programs = heads_kv * cdiv(m + 16, block_m)  # +16: the suffix pass reads past the last row
    splits = 1
    if programs < target:
        splits = max(1, min(cdiv(target, programs), cdiv(prefix_len, 4 * 64)))
    if splits == 1 and block_m == 128 and large_m_layout(batch, rows_per_seq, heads_kv, target):
        return PrefixTiling(block_m, two_phase=True, num_splits=1, **LARGE_M_TILING)
    return PrefixTiling(block_m, 64, splits, 4, 2)


def suffix_splits(s: Shapes, dev: DeviceInfo) -> int:
    """Splits of the suffix keys when ``B * Hkv`` programs cannot fill the GPU."""
    return _splits_to_fill(s.batch * s.heads_kv, s.suffix_len, 64, _two_per_sm(dev))


def even_enough(n_tiles: int, splits: int) -> bool:
    """Whether ``splits`` prefix splits of ``ceil(n_tiles / splits)`` tiles each cover
    ``n_tiles`` tiles with every split holding one and at most ``n_tiles / SPLIT_WASTE`` tile
    steps past the last (the kernel re-reads the last tile there, all keys masked)."""
    per = cdiv(n_tiles, splits)
    return (splits - 1) * per < n_tiles and SPLIT_WASTE * (per * splits - n_tiles) <= n_tiles


def choose_splits(n_tiles: int, ctas: int, sms: int, *, uneven: bool = True) -> int:
    """Prefix splits of the Mosaic GPU prefix kernel for ``ctas`` (kv head, 128-row block) CTAs
    over ``n_tiles`` key tiles: 1 when the CTAs fill most of a wave; with at least FEW_CTAS, the
    largest count up to 4 (2 from LONG_TILES tiles) within two waves; with fewer, the largest up
    to 16 within one wave and at least 2 tiles per split.  Divisors of ``n_tiles`` first; where
    none above 1 qualifies and ``uneven``, the largest :func:`even_enough` count (e.g. 127
    tiles: 2)."""
    if 4 * ctas >= 3 * sms:
        return 1
    few = ctas < FEW_CTAS
    max_splits, limit = (16, sms) if few else (2 if n_tiles >= LONG_TILES else 4, 2 * sms)
    fits = [c for c in range(2, min(n_tiles, max_splits) + 1)
            if ctas * c <= limit and (not few or n_tiles // c >= 2)]
    return max([c for c in fits if n_tiles % c == 0]
               or [c for c in fits if uneven and even_enough(n_tiles, c)] or [1])


def _mgpu_ctas(s: Shapes) -> tuple[int, int]:
    """``(M128, (kv head, 128-row block) CTAs)`` of the Mosaic GPU kernels' decode rows."""
    m128 = cdiv(s.batch * next_pow2(s.group), 128) * 128
    return m128, s.heads_kv * (m128 // 128)


def mgpu_splits(s: Shapes, dev: DeviceInfo, *, uneven: bool = True) -> int:
    m128, ctas = _mgpu_ctas(s)
    return choose_splits(max(1, s.prefix_len // 128), ctas, dev.sm_count, uneven=uneven)


def _mosaic_base(s: Shapes, dev: DeviceInfo, interpret: bool) -> str | None:
    if s.groups != 1 or s.tq != 1:
        return f"the Mosaic GPU leaves decode (Tq=1) with one prefix, got Tq={s.tq} G={s.groups}"
    if not interpret and not dev.mosaic_gpu_ok:
        return f"Mosaic GPU kernels need a GPU of compute capability >= 9.0, got {dev.name}"
    return mgpu_supported(rows=_mgpu_ctas(s)[0], prefix_len=s.prefix_len, head_dim=s.head_dim,
                          dtype=s.dtype)


def mosaic_region(s: Shapes, dev: DeviceInfo, interpret: bool) -> bool:
    """The Mosaic GPU prefix kernel runs and has enough work: not interpret mode, a Hopper GPU,
    >= MGPU_MIN_CTAS CTAs after splitting, >= MGPU_MIN_REAL_ROWS real rows."""
    if interpret or _mosaic_base(s, dev, interpret) is not None:
        return False
    m128, ctas = _mgpu_ctas(s)
    # (the region counts divisor splits only: where the CTAs reach MGPU_MIN_CTAS only through
    # uneven splits, the Mosaic GPU leaves' choice against the Triton ones was never timed)
    return (ctas * mgpu_splits(s, dev, uneven=False) >= MGPU_MIN_CTAS
            and s.batch * next_pow2(s.group) / m128 >= MGPU_MIN_REAL_ROWS)


def split_region(s: Shapes, dev: DeviceInfo) -> bool:
    return (_split_why_not(s, dev) is None and s.group == SPLIT_GROUP
            and s.batch * s.group >= SPLIT_MIN_ROWS and s.head_dim == 128
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1
                    for (p0, p1), (s0, s1) in SPLIT_REGIONS))


def joint_region(s: Shapes, dev: DeviceInfo) -> bool:
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    return (_joint_why_not(s, dev) is None
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1 and s.group >= g_min
                    and ctas >= c_min for (p0, p1), (s0, s1), g_min, c_min in JOINT_REGIONS))


def one_launch_region(s: Shapes, dev: DeviceInfo) -> bool:
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    return (_mgpu_suffix_splits(s, dev) == 1 and s.group >= ONE_LAUNCH_MIN_GROUP
            and _one_launch_why_not(s) is None and ctas >= ONE_LAUNCH_MIN_CTAS
            and any(p0 <= s.prefix_len <= p1 and s0 <= s.suffix_len <= s1 and s.group >= g_min
                    for (p0, p1), (s0, s1), g_min in ONE_LAUNCH_REGIONS))


def _split_why_not(s: Shapes, dev: DeviceInfo) -> str | None:
    return split_decode_mgpu.split_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype,
        smem_bytes=dev.smem_per_block)


def _joint_why_not(s: Shapes, dev: DeviceInfo) -> str | None:
    block_s = joint_decode_mgpu.joint_tiles(s.head_dim, dev.smem_per_block,
                                            jnp.dtype(s.dtype).itemsize, JOINT_STAGES)[1]
    return joint_decode_mgpu.joint_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype, block_s=block_s)


def _one_launch_why_not(s: Shapes) -> str | None:
    return shared_decode_mgpu.fused_supported(
        batch=s.batch, heads_q=s.heads_q, heads_kv=s.heads_kv, prefix_len=s.prefix_len,
        suffix_cap=s.suffix_len, head_dim=s.head_dim, dtype=s.dtype, block_s=64)


def mosaic_why_not(path: str, s: Shapes, dev: DeviceInfo, interpret: bool) -> str | None:
    """``None`` when Mosaic GPU leaf ``path`` can run these shapes, else the reason."""
    why = _mosaic_base(s, dev, interpret)
    if why is None and path == "mgpu_split":
        why = _split_why_not(s, dev)
    elif why is None and path == "mgpu_joint":
        why = _joint_why_not(s, dev)
    elif why is None and path == "mgpu_one_launch":
        why = _one_launch_why_not(s)
    return why


def _mgpu_suffix_splits(s: Shapes, dev: DeviceInfo) -> int:
    if s.batch * s.heads_kv >= MGPU_SUFFIX_SPLIT_BELOW:
        return 1
    return suffix_splits(s, dev)


def _one_launch(s: Shapes, dev: DeviceInfo) -> MgpuOneLaunch:
    """64-key suffix tiles, as many stages (up to 5) as fit; suffix splits so that the suffix
    tasks number at most about one wave, or more where needed to keep each task to at most 8
    tiles per sequence; the prefix unsplit."""
    block_s = 64
    stage = 4 * block_s * s.head_dim * jnp.dtype(s.dtype).itemsize   # k, v of each warpgroup
    steps = max(1, min(5, (dev.smem_per_block - 2 * 64 * s.head_dim * 2 - 8192) // stage))
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    n_tiles = s.suffix_len // block_s
    ss = 1
    for c in range(1, n_tiles + 1):
        if n_tiles % c == 0 and ctas * c <= dev.sm_count:
            ss = c
        if n_tiles % c == 0 and n_tiles // c <= 8 and ctas * c > dev.sm_count:
            ss = c
            break
    return MgpuOneLaunch(num_splits=1, suffix_splits=ss, block_s=block_s, suffix_steps=steps)


def _joint(s: Shapes, dev: DeviceInfo) -> MgpuJoint:
    """Prefix splits: the largest power of two up to 16 dividing the tiles with the CTAs
    within one wave."""
    block_kv, block_s = joint_decode_mgpu.joint_tiles(
        s.head_dim, dev.smem_per_block, jnp.dtype(s.dtype).itemsize, JOINT_STAGES)
    ctas = s.heads_kv * cdiv(s.batch * s.group, 128)
    n_tiles = s.prefix_len // block_kv
    splits = 1
    for c in (2, 4, 8, 16):
        if n_tiles % c == 0 and ctas * c <= dev.sm_count:
            splits = c
    return MgpuJoint(num_splits=splits, block_kv=block_kv, block_s=block_s, steps=JOINT_STAGES,
                     schedule_barrier=JOINT_SCHEDULE_BARRIER)


def plan_roles(s: Shapes, sms: int) -> tuple[int, int, int]:
    """``(prefix_ctas, num_splits, stream_ctas)`` of the role-split launch: the split of the
    ``sms`` SMs that a two-term time model finds fastest.  For prefix splits ``c`` in (1, 2, 4,
    8) dividing the 128-key tiles and each number of rounds ``r`` of its ``T`` tasks (on
    ``n = ceil(T / r)`` CTAs): ``max(r * (task flops / ROLE_PREFIX_FLOPS + ROLE_TASK_S),
    suffix bytes / (m * ROLE_STREAM_BPS))`` with ``m = sms - n`` stream CTAs (at most the
    suffix tasks)."""
    g = s.group
    m_blocks = cdiv(s.batch * g, 128)
    n_tiles = s.prefix_len // 128
    s_tasks = cdiv(s.batch * g, suffix_stream_mgpu.cols_for(g)) * s.heads_kv
    s_bytes = 2 * s.batch * s.suffix_len * s.heads_kv * s.head_dim * jnp.dtype(s.dtype).itemsize
    best = None
    for splits in (1, 2, 4, 8):
        if n_tiles % splits:
            continue
        tasks = s.heads_kv * m_blocks * splits
        t_task = 4.0 * 128 * (s.prefix_len // splits) * s.head_dim / ROLE_PREFIX_FLOPS + ROLE_TASK_S
        for rounds in range(1, tasks + 1):
            n = cdiv(tasks, rounds)
            if n > sms - 1:
                continue
            m = min(sms - n, s_tasks)
            t = max(rounds * t_task, s_bytes / (m * ROLE_STREAM_BPS))
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, n, splits, m)
            if n == 1:
                break
    return best[1], best[2], best[3]


def build_leaf(path: str, s: Shapes, dev: DeviceInfo, interpret: bool):
    """The leaf plan of ``path`` for shapes ``s`` (one chunk of query positions)."""
    target = _two_per_sm(dev)
    tq = s.tq
    r = tq * s.group
    if path == "flat_own":
        return flat_own_leaf(s, dev)
    if path == "flat_rows":
        return FlatRows(num_splits=flat_splits(s, dev), block_k=128, num_warps=4, num_stages=2,
                        two_phase=large_m_layout(s.batch, r, s.heads_kv, target))
    if path == "triton_two_launch":
        ss = suffix_splits(s, dev)
        return TritonTwoLaunch(prefix=prefix_tiling(s.batch, r, s.heads_kv, s.prefix_len, target),
                               suffix_splits=ss,
                               suffix=DECODE_SUFFIX if tq == 1 and ss == 1 else ROW_SUFFIX)
    if path == "triton_overlap":
        return TritonOverlap(prefix=prefix_tiling(s.batch, r, s.heads_kv, s.prefix_len, target),
                             suffix_splits=suffix_splits(s, dev), suffix_block_k=64)
    if path == "mgpu_two_launch":
        return MgpuTwoLaunch(num_splits=mgpu_splits(s, dev),
                             suffix_splits=_mgpu_suffix_splits(s, dev), suffix=DECODE_SUFFIX)
    if path == "mgpu_one_launch":
        return _one_launch(s, dev)
    if path == "mgpu_joint":
        return _joint(s, dev)
    if path == "mgpu_split":
        # (Mosaic GPU's CPU interpreter simulates every CTA: there, a 4-SM split of the work)
        n, splits, m = plan_roles(s, 4 if interpret else dev.sm_count)
        return MgpuSplit(prefix_ctas=n, stream_ctas=m, num_splits=splits,
                         smem_bytes=dev.smem_per_block)
    raise ValueError(f"unknown path {path!r}")
