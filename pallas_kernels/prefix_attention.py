"""Inter-sequence batched prefix attention and the two-launch shared-prefix forward.

Hydragen section 3.2: the queries of *all* sequences that share a prefix attend to the same
keys, so for each kv head their rows ``(sequence, query position, query head of the GQA
group)`` are stacked into the M dimension of one matrix-matrix product against the prefix.
Each prefix tile is then loaded once per ``block_m`` rows instead of once per sequence, and the
work runs on tensor cores.

Layout: rows are ``q_hmd [Hkv, B_sorted * R2, D]`` with ``R2 = next_pow2(Tq * Hq / Hkv)`` rows
per sequence (compact, so no 16-row padding per sequence is computed), sequences sorted by
prefix group.  Row blocks of ``block_m`` rows are multiples of ``R2``; a block that straddles a
group boundary loops over both groups' prefixes (the kernel of :mod:`decode_attention` loops
over the pool entries present in a block), every other block reads one prefix.  When
``Hkv * (rows / block_m)`` programs are too few to fill the GPU, the prefix is split across
programs (split-KV) and the splits are merged by the suffix pass.

:func:`shared_prefix_forward` is the shared path: launch 1 computes the prefix partials;
launch 2 is the per-sequence suffix decode whose epilogue merges those partials (fused merge),
writing the final output and LSE.  When decoding (``Tq == 1``, suffix not split) launch 2 is
:func:`pallas_kernels.suffix_attention.suffix_decode_merge`, which reads ``q`` and writes the
output in their own layout; with ``Tq > 1`` it is the row-layout kernel of
:mod:`decode_attention`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import functools
import math
import os

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.suffix_attention import suffix_decode_merge
from pallas_kernels.decode_attention import (Source, attend_pool, cdiv, check_rows_per_tile,
                                             finish_state, large_m_layout, merge_partial_list,
                                             merge_partials, next_pow2, pad_rows, q_rows_layout,
                                             ragged_attention, row_meta, rows_from_q, rows_to_out,
                                             seq_rows, split_chunk)

# Shared-path variant used by ``shared_prefix_forward`` when none is given:
# "fused": prefix kernel, then suffix kernel merging the prefix partials in its epilogue;
# "overlap": one launch whose programs are interleaved prefix tiles and suffix decodes (the
# compute-bound and memory-bound work overlap on the GPU), then one small XLA merge;
# "auto": "overlap" when both parts are large enough to matter, else "fused".
VARIANT = "auto"

# Prefix-kernel backend of the shared path, default from the environment variable
# ``JPA_PREFIX_BACKEND``:
# "auto" (default): ``prefix_attention_mgpu.prefix_partials_mgpu`` (Pallas Mosaic GPU: TMA,
#   wgmma, warp specialisation) on a Hopper GPU wherever it applies -- one prefix, Tq == 1,
#   16-bit, head_dim 64 or 128, prefix length a multiple of 128, enough CTAs (MGPU_MIN_CTAS);
#   not in interpret mode -- then the suffix pass and the merge (``MGPU_MERGE``); everywhere
#   else the Triton kernels below.
# "mgpu": the Mosaic GPU kernel wherever it applies, also in interpret mode (Mosaic GPU's CPU
#   interpreter; tests).
# "triton": never the Mosaic GPU kernel.
PREFIX_BACKEND = os.environ.get("JPA_PREFIX_BACKEND", "auto")
PREFIX_BACKENDS = ("auto", "mgpu", "triton")


# "auto" takes the Mosaic GPU kernel only with at least this many CTAs after splitting the
# prefix (``prefix_attention_mgpu.choose_splits``) and with at least MGPU_MIN_REAL_ROWS of its
# 128-row blocks' rows real (not padding).  History: session 3 required 64 (kv head, 128-row
# block) CTAs *before* splitting, from a run with at most 4 splits
# (bench/results/shared_prefix_h200_mgpu_all.json: at <= 24 such CTAs the Triton kernels were
# as fast or up to 2.4x faster).  Session 6 measured up to 16 splits at 4 and 16 CTAs
# (bench/results/logs/session6_probe_mgpu_splits_h200.json, H200): with 8-16 splits the Mosaic
# GPU path was 1.2-2.4x faster than the Triton path at all 7 such points (Hq=8/Hkv=1 B=64 and
# B=256, Hq=32/Hkv=8 B=64; e.g. Hq=8 B=256 P=16K S=64: 0.045 ms against 0.108 ms).
MGPU_MIN_CTAS = 64
MGPU_MIN_REAL_ROWS = 0.75

# Tiling of the decode suffix kernel (``suffix_attention.suffix_decode_merge``, launch 2 when
# Tq == 1).  H200 sweep of launch 2 alone (bench/results/shared_breakdown_h200.json, 10
# settings, Hq=32/Hkv=8, S=128, B=256/512/1024): 32-key tiles, 2 warps, 3 stages were the
# fastest at B=256 and 512 and within 3% of the fastest at B=1024, and 3-16% faster than the
# 64-key / 4-warp tiles used before.
DECODE_SUFFIX_TILING = dict(block_k=32, num_warps=2, num_stages=3)

# Ping-pong scheduling of the Mosaic GPU kernel's two compute warpgroups (see
# ``prefix_attention_mgpu.prefix_partials_mgpu``).
MGPU_SCHEDULE_BARRIER = True

# How the decode path with the Mosaic GPU prefix kernel combines the two parts:
# "independent" (default): prefix partials and suffix state come from two launches that do not
#   depend on each other, then one small XLA fusion merges them (reading only the G real rows
#   of each sequence's prefix partials); taken when the suffix keys are not split
#   (``default_suffix_splits`` == 1, i.e. ``B * Hkv >= 264`` or short suffixes), else the
#   split suffix pass and its XLA merge as on the Triton path;
# "epilogue": the suffix kernel reads the prefix partials and merges them in its epilogue (each
#   program reads a 16-row tile per prefix split, 4x the real rows when G = 4).
# Measured on an H200 in one run (bench/results/logs/session6_probe_concurrent_h200.json,
# Hq=32/Hkv=8, S=128 unless noted): independent / epilogue = 0.0915 / 0.0975 ms at B=256 P=4K,
# 0.2105 / 0.2122 at B=512 P=8K, 0.2915 / 0.2893 at B=1024 P=4K, 0.1804 / 0.1855 at B=256
# P=16K, 0.1229 / 0.1316 at B=256 P=4K S=256, 0.0742 / 0.0760 at Hq=8/Hkv=1 B=1024 P=4K.
# Because the two launches are independent, XLA may run them at the same time inside a CUDA
# graph with ``CONCURRENT_COMPILER_OPTIONS`` (jax_prefix_attn) passed to ``jax.jit``: in the
# same run that gave a further 1-6% (0.0877 / 0.2075 / 0.2826 / 0.1777 / 0.1209 / 0.0698 ms).
# "one_launch": prefix and suffix in the CTAs of one Mosaic GPU kernel
#   (``shared_decode_mgpu.shared_decode_partials_mgpu``), then the same XLA merge as
#   "independent", wherever the kernel applies (``one_launch_plan(..., force=True)``);
# "joint": one Mosaic GPU pass where each CTA brings its rows' suffix tiles through the same
#   pipeline as the prefix tiles, into the same softmax state (``joint_decode_mgpu``), wherever
#   the kernel applies (``joint_plan(..., force=True)``); with 128-key prefix tiles (session 14)
#   0.74-0.97x the default's time at prefix 1K-4K with short suffixes, 1.02-1.10x at prefix 16K
#   (see ``JOINT_REGIONS``);
# "split": the SMs split by role in one Mosaic GPU launch -- persistent prefix CTAs beside
#   suffix-streaming CTAs (``split_decode_mgpu``), then the same XLA merge -- wherever the
#   kernel applies (``split_plan(..., force=True)``; see ``SPLIT_REGIONS``);
# "auto" (default): "split" where ``split_plan`` says it pays (measured), else "joint" where
#   ``joint_plan`` does, else "one_launch" where ``one_launch_plan`` does, else "independent".
# Session 13 re-measured "epilogue" against the default after the suffix kernel's move to the
# queries' own layout (session 11), and the default under ``CONCURRENT_COMPILER_OPTIONS``
# (H200, one run, 17 points of the grid with B >= 256, P >= 4K:
# ``bench/results/logs/session13_probe_merge13_h200.jsonl``): "epilogue" 0.98-1.21x the
# default's time (median 1.036x), concurrent scheduling 0.98-1.12x (median 0.997x).
MGPU_MERGE = "auto"
MGPU_MERGES = ("epilogue", "independent", "one_launch", "joint", "split", "auto")
# Knobs of the one-launch kernel (None: the plan's choice).  Session 7, H200, one run
# (bench/results/logs/session7_probe_one_launch2_h200.json): the unsplit prefix (num_splits=1)
# with interleaved tasks was the fastest setting at P=4K; splitting the prefix, or suffix tasks
# first, lost 5-20% there.
# suffix_mode "rows" (each warpgroup its own 64 rows, 2 stages at D=128) rather than
# "alternate" (both on the same 64 rows taking steps in turn, 5 stages): the suffix tasks alone
# took 52-55 us alternating against 46 us with "rows" at B=256 P=4K S=128 (H200, separate runs:
# session7_probe_alternate_h200.json, session7_probe_parts_h200.json), the whole path 0.0826
# against 0.0786 ms in one run -- the suffix steps are bound by their own latency, not by the
# stages in flight.
ONE_LAUNCH = dict(order="interleave", block_s=None, suffix_splits=None, num_splits=1,
                  suffix_steps=None, suffix_mode="rows")
SMEM_BYTES = 232448  # shared memory per CTA on Hopper
ONE_LAUNCH_MIN_GROUP = 4  # the suffix tasks spend 64 / G times the useful tensor-core work
# Where "auto" takes it (static): prefix of ONE_LAUNCH_PREFIX keys, suffix capacity in
# ONE_LAUNCH_SUFFIX, at least ONE_LAUNCH_MIN_CTAS (kv head, 128-row) prefix CTAs.
# Measured one-launch / independent time, H200 (bench/results/logs/session7_*):
# * probe (session7_probe_one_launch2_h200.json): 0.86 at Hq=32/Hkv=8 B=256 P=4K S=128, 0.93
#   at S=256, 0.97-0.99 at B=1024 P=4K S=128, 0.90 at Hq=8/Hkv=1 B=1024 P=4K S=256; but
#   0.95-1.17 at S=64 and 1.11-1.67 at P=8K-16K (the unsplit prefix tasks run long; split,
#   the suffix tasks wait behind them);
# * validation runs 1 and 2 (session7_validate_one_launch{,2}_h200.json): 0.87 / 0.83 at B=256
#   P=4K S=128, 0.90 / 0.85 at Hq=8 B=1024 P=4K S=256, 0.95-1.01 at the other P=4K S<=256
#   points; at P=2K 0.91 then 1.04 (B=256 S=128), 1.07 (B=256 S=256), 0.82 (Hq=8 B=1024
#   S=128): mixed, so excluded; 1.03-1.11 at P=1K and 1.06 at S=1024 (excluded).
# * session 8 (session8_probe_splits_h200.json): 0.90 at Hq=8/Hkv=1 B=1024 P=16K S=1024 (the
#   suffix, 537 MB, streams while the prefix tasks compute), 0.93 with the prefix split in two;
#   but 1.33 at S=256 and 1.00 at S=64 there, 0.95 at Hq=32 B=1024 P=16K S=256 (the prefix split
#   in two), 1.02-1.10 at Hq=32 B=256 P=16K S=64/256.
# Regions (prefix keys, suffix capacity, minimum G), each a measured range:
ONE_LAUNCH_REGIONS = (((4096, 4096), (128, 256), 4),
                      ((16384, 16384), (1024, 1024), 8))
ONE_LAUNCH_MIN_CTAS = 64
# Prefix splits of the Mosaic GPU kernel on the decode path (None: ``choose_splits``).
MGPU_SPLITS: int | None = None


def _use_mgpu(g: int, tq: int, interpret: bool, ctas: int | None = None,
              real_rows: float = 1.0) -> bool:
    """Whether the shared path takes the Mosaic GPU prefix kernel (static; shapes checked by the
    caller with ``mgpu_supported``).  For "auto": ``ctas`` the kernel's CTAs after splitting the
    prefix, ``real_rows`` the fraction of its rows that are not padding."""
    if PREFIX_BACKEND not in PREFIX_BACKENDS:
        raise ValueError(f"JPA_PREFIX_BACKEND / PREFIX_BACKEND must be one of {PREFIX_BACKENDS}, "
                         f"got {PREFIX_BACKEND!r}")
    if g != 1 or tq != 1 or PREFIX_BACKEND == "triton":
        return False
    if PREFIX_BACKEND == "mgpu":
        return True
    from pallas_kernels import prefix_attention_mgpu as pm  # noqa: PLC0415
    if (ctas is not None and ctas < MGPU_MIN_CTAS) or real_rows < MGPU_MIN_REAL_ROWS:
        return False
    return not interpret and pm.mgpu_device_ok()


__all__ = ["prefix_partials", "shared_prefix_forward", "prefix_config", "overlap_partials",
           "decode_prefix_partials"]


def choose_variant(batch: int, heads_kv: int, rows_per_seq_pow2: int) -> str:
    """``"overlap"`` below 2048 (sequence, kv head) suffix programs, else ``"fused"``.

    Measured on an H200 (``bench/results/shared_prefix_h200_variants.json``, both variants at
    48 grid points): with many suffix programs (Hq=32/Hkv=8, B >= 256) the fused two-launch
    path is 5-25% faster; with fewer (Hkv=1, or B <= 64) the single interleaved launch is
    5-20% faster (the prefix matmul and the suffix streaming overlap).
    """
    del rows_per_seq_pow2
    return "overlap" if batch * heads_kv < 2048 else "fused"


def prefix_config(batch: int, rows_per_seq: int, heads_kv: int, prefix_len: int,
                  target_programs: int = 264) -> dict:
    """Static tiling for the prefix kernel: ``block_m``, ``block_k``, splits, warps, stages."""
    r2 = next_pow2(rows_per_seq)
    m = batch * r2
    block_m = 128 if m >= 1024 else 64 if m >= 64 else max(16, next_pow2(m))
    block_m = max(block_m, r2)
    n_rb = cdiv(m + 16, block_m)  # +16: the suffix pass reads up to 16 rows past a sequence
    programs = heads_kv * n_rb
    block_k = 64
    splits = 1
    if programs < target_programs:
        splits = max(1, min(cdiv(target_programs, programs), cdiv(prefix_len, 4 * block_k)))
    # Tiling measured on an H200 (bench/shared_prefix.py --tune): 128 x 64 tiles, 4 warps,
    # 2 stages reach ~205 TFLOP/s at B=256, P=4K, Hq=32, Hkv=8 (prefix split 4 ways).
    cfg = dict(block_m=block_m, block_k=block_k, num_splits=splits, num_warps=4, num_stages=2)
    # (128-row tiles are also forced by 128 rows per sequence, e.g. 32 queries x G = 4; with a
    # prefix too short to split, those stay on the default tiling: session 16 found the assert
    # this condition replaces failing there, B=2 Tq=33 Hq=8/Hkv=2 P=12)
    if splits == 1 and block_m == 128 and large_m_layout(batch, rows_per_seq, heads_kv,
                                                         target_programs):
        cfg.update(LARGE_M_TILING)
        cfg["two_phase"] = True
    return cfg


# Tiling of the prefix kernel when there are enough rows that the prefix is not split
# (e.g. B=1024, Hq=32, Hkv=8): the best of the H200 sweep recorded as "large_m_tiling_sweep"
# in bench/results/shared_prefix_h200_session2_triton.json (322 TFLOP/s at B=1024, P=4K, Hq=32; 299 with
# 64/4/2).  In that configuration the kernels also use the two-phase (unmasked full tiles,
# then masked tail) key loop.
LARGE_M_TILING = dict(block_k=64, num_warps=8, num_stages=3)


def prefix_partials(q_hmd, prefix_k, prefix_v, row_group, row_limit, *, scale, block_m, block_k,
                    num_splits, num_warps, num_stages, interpret=False, two_phase=False):
    """Batched prefix attention: float32 partials ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])``.

    ``q_hmd [Hkv, M, D]`` rows sorted by ``row_group [M]`` (prefix entry of ``prefix_k/v
    [G, P, Hkv, D]``), ``row_limit [M]`` visible prefix keys per row (0 for padding rows).
    """
    return ragged_attention(q_hmd, [Source(prefix_k, prefix_v, row_group, row_limit)],
                            scale=scale, block_m=block_m, block_k=block_k, num_splits=num_splits,
                            finalize=False, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret, two_phase=two_phase)


def mgpu_decode_splits(b: int, hq: int, hkv: int, p: int, d: int, itemsize: int, *,
                       interpret: bool = False, num_splits: int | None = None) -> int | None:
    """Static plan of the decode path's prefix launch (one prefix, ``Tq == 1``): the Mosaic GPU
    kernel's prefix splits when it runs (``_use_mgpu`` and ``mgpu_supported``), else ``None``
    (the Triton kernels).  Used by the path itself and by the cost model."""
    from pallas_kernels import prefix_attention_mgpu as pm  # noqa: PLC0415
    r2 = next_pow2(q_rows_layout(1, hq, hkv)[0])
    m = b * r2
    m128 = cdiv(m, 128) * 128
    ctas = hkv * (m128 // 128)
    splits = pm.choose_splits(max(1, p // 128), ctas) if num_splits is None else int(num_splits)
    if not _use_mgpu(1, 1, interpret, ctas=ctas * splits, real_rows=m / m128):
        return None
    dtype = jnp.bfloat16 if itemsize == 2 else jnp.float32
    if pm.mgpu_supported(rows=m128, prefix_len=p, head_dim=d, dtype=dtype) is not None:
        return None
    return splits


def _mgpu_decode_partials(q_bhd, k_phd, v_phd, length, *, scale, interpret, num_splits=None):
    """Launch 1 through the Mosaic GPU kernel when it applies (see ``_use_mgpu``), else ``None``.

    Rows ``R2 = next_pow2(G)`` per sequence, 128-row blocks over the real rows only; the suffix
    pass reads whole ``R16``-row tiles of the partials (up to row ``M - R2 + R16``), so those are
    allocated but the rows past ``M`` are left unwritten (they only feed discarded padding rows).
    """
    b, hq, d = q_bhd.shape
    hkv = k_phd.shape[1]
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    m = b * r2
    m128 = cdiv(m, 128) * 128
    from pallas_kernels import prefix_attention_mgpu as pm  # noqa: PLC0415
    splits = mgpu_decode_splits(b, hq, hkv, k_phd.shape[0], d, jnp.dtype(q_bhd.dtype).itemsize,
                                interpret=interpret, num_splits=num_splits)
    if splits is None:
        return None
    qm = rows_from_q(q_bhd[:, None], hkv, r2)  # [Hkv, m, D]
    qm = jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm
    # (interpret: Mosaic GPU's CPU interpreter, with its operand-form substitutions)
    return pm.prefix_partials_mgpu(qm, k_phd, v_phd, length, scale=scale, interpret=interpret,
                                   num_splits=splits, out_rows=max(m128, m - r2 + r16),
                                   schedule_barrier=MGPU_SCHEDULE_BARRIER, _cpu_check=interpret)


def decode_prefix_partials(q_bhd, prefix_k, prefix_v, length, *, scale, interpret=False):
    """Launch 1 of the shared path alone, for one prefix and one query per sequence (e.g. the root
    of a prefix tree): every sequence's ``Hq`` query rows attend ``prefix_k/v [P, Hkv, D]`` keys
    ``[0, length)`` (``length`` an int32 scalar, dynamic) as one batched matrix product per kv
    head (the Mosaic GPU kernel where it applies, else the Triton kernel, split along the prefix
    when the rows are few).

    ``q_bhd [B, Hq, D]``.  Returns ``(o [n, Hkv, M, D], lse [n, Hkv, M] float32, stride)``:
    ``n`` prefix splits of normalised partials (``lse = -inf`` where a split saw nothing); query
    head ``h * G + j`` of sequence ``b`` is row ``b * stride + j`` of kv head ``h``, and
    ``M >= (B - 1) * stride + suffix_rows(Hq, Hkv)`` (the layout
    ``suffix_attention.suffix_decode_merge`` takes as ``incoming``).
    """
    b, hq, d = q_bhd.shape
    p, hkv, _ = prefix_k.shape
    q_bhd = q_bhd.astype(prefix_k.dtype)
    r, r16 = q_rows_layout(1, hq, hkv)
    r2 = next_pow2(r)
    mg = _mgpu_decode_partials(q_bhd, prefix_k, prefix_v, length, scale=scale, interpret=interpret)
    if mg is not None:
        return mg[0], mg[1], r2
    cfg = prefix_config(b, r, hkv, p)
    m = b * r2
    m_pad = cdiv(m + r16, cfg["block_m"]) * cfg["block_m"]
    qp = jnp.pad(rows_from_q(q_bhd[:, None], hkv, r2), ((0, 0), (0, m_pad - m), (0, 0)))
    lim_rows = jnp.full((m_pad,), length, jnp.int32)
    o, lse = prefix_partials(qp, prefix_k[None], prefix_v[None], jnp.zeros((m_pad,), jnp.int32),
                             lim_rows, scale=scale, block_m=cfg["block_m"], block_k=cfg["block_k"],
                             num_splits=cfg["num_splits"], num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"], interpret=interpret,
                             two_phase=cfg.get("two_phase", False))
    return o, lse, r2


def default_suffix_splits(b: int, hkv: int, s_len: int, block_k: int = 64) -> int:
    """Splits of the suffix keys when ``B * Hkv`` programs cannot fill the GPU (264 = two per
    SM), at least two key tiles each."""
    if b * hkv >= 264:
        return 1
    return max(1, min(cdiv(264, b * hkv), cdiv(s_len, 2 * block_k)))


# On the Mosaic GPU decode path the suffix is split only below this many (sequence, kv head)
# programs.  At 256 (Hq=8/Hkv=1 B=256) the unsplit suffix kernel + one XLA merge took 0.77-0.92x
# the time of the split suffix at S=256/1024, P=4K/16K (H200, same run:
# bench/results/logs/session8_probe_hq8_b256_h200.json, variant "ss1").
MGPU_SUFFIX_SPLIT_BELOW = 256


def mgpu_suffix_splits(b: int, hkv: int, s_len: int, block_k: int = 64) -> int:
    """Suffix splits on the Mosaic GPU decode path: ``default_suffix_splits`` below
    ``MGPU_SUFFIX_SPLIT_BELOW`` programs, else 1."""
    if b * hkv >= MGPU_SUFFIX_SPLIT_BELOW:
        return 1
    return default_suffix_splits(b, hkv, s_len, block_k)


def _suffix_with_merge(q, suffix_k, suffix_v, lim_s, o_pre, lse_pre, order, inv, *, b, tq, hq, hkv,
                       r, r2, r16, scale, interpret, two_phase, suffix_block_k, suffix_warps,
                       suffix_stages, suffix_splits):
    """Launch 2 of the fused variant: the suffix decode merging the prefix partials
    ``(o_pre [splits, Hkv, >= M + R16, D], lse_pre)`` (rows ``R2`` per sequence)."""
    grp = hq // hkv
    s_len = suffix_k.shape[1]
    if suffix_splits is None:
        suffix_splits = default_suffix_splits(b, hkv, s_len, suffix_block_k or 64)
    if tq == 1 and suffix_splits == 1:
        # Decoding: the suffix kernel reads q and writes out/lse in their own layout (no padded
        # row copies); sequence b's prefix partials are rows block inv[b] (sorted by group).
        tiling = dict(DECODE_SUFFIX_TILING)
        for key, val in (("block_k", suffix_block_k), ("num_warps", suffix_warps),
                         ("num_stages", suffix_stages)):
            if val is not None:
                tiling[key] = val
        out, lse = suffix_decode_merge(q[:, 0], suffix_k, suffix_v, lim_s[:, 0], (o_pre, lse_pre),
                                       in_stride=r2, position_b=inv, scale=scale,
                                       interpret=interpret, **tiling)
        return out[:, None], lse[:, None]
    suffix_block_k = suffix_block_k or 64
    suffix_warps = suffix_warps or 4
    suffix_stages = suffix_stages or 3
    # Launch 2: per-sequence suffix decode (R16 rows per sequence, same sorted order); its
    # epilogue merges the prefix partials of rows [rb * R2, rb * R2 + R16).
    qs = rows_from_q(q, hkv, r16, order)
    b_sorted = np.arange(b, dtype=np.int32) if order is None else order
    src_s = Source(suffix_k, suffix_v, seq_rows(b_sorted, r16), row_meta(lim_s, grp, r16, order))
    if suffix_splits > 1:
        o_s, lse_s = ragged_attention(qs, [src_s], scale=scale, block_m=r16,
                                      block_k=suffix_block_k, num_splits=suffix_splits,
                                      finalize=False, num_warps=suffix_warps,
                                      num_stages=suffix_stages, interpret=interpret)
        return _merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r16)], b=b, tq=tq, hq=hq,
                                r=r, dtype=q.dtype, inv=inv)
    o, lse = ragged_attention(qs, [src_s], scale=scale, block_m=r16, block_k=suffix_block_k,
                              num_splits=1, incoming=(o_pre, lse_pre), in_stride=r2,
                              finalize=True, out_dtype=q.dtype, num_warps=suffix_warps,
                              num_stages=suffix_stages, interpret=interpret,
                              two_phase=two_phase)
    return rows_to_out(o, b, tq, hq, r16, inv), rows_to_out(lse, b, tq, hq, r16, inv)


def _merge_row_parts(parts, *, b, tq, hq, r, dtype, inv):
    """One XLA merge of several sets of partial states in the row layout: each part is
    ``(o [n, Hkv, >= B * rows, D], lse [n, Hkv, >= B * rows], rows)`` with sequence ``b``'s
    ``r`` real rows at ``b * rows``.  Returns ``(out [B, Tq, Hq, D] in dtype, lse [B, Tq, Hq])``
    (``inv``: the inverse of a sort of the sequences, or None)."""
    o_all, l_all = [], []
    for o, lse, rows in parts:
        n, hkv, _, d = o.shape
        o_all += list(o[:, :, :b * rows].reshape(n, hkv, b, rows, d)[:, :, :, :r])
        l_all += list(lse[:, :, :b * rows].reshape(n, hkv, b, rows)[:, :, :, :r])
    o, lse = merge_partial_list(o_all, l_all)
    hkv, d = o.shape[0], o.shape[-1]
    o = o.astype(dtype).reshape(hkv, b * r, d)
    lse = lse.reshape(hkv, b * r)
    return rows_to_out(o, b, tq, hq, r, inv), rows_to_out(lse, b, tq, hq, r, inv)


# Split suffix on the Mosaic GPU decode path (Tq == 1, more than one suffix split): "own" runs
# the suffix kernel in the queries' own layout with key splits and merges its partials with the
# prefix's in the one XLA merge (:func:`_independent_merge`); "rows" pads q to 16 rows per
# sequence and kv head for the row-layout kernel (:func:`_suffix_with_merge`).
SPLIT_SUFFIX_LAYOUT = "own"


def _independent_merge(q, suffix_k, suffix_v, lim_s, o_pre, lse_pre, *, b, hq, hkv, d, r, r2, scale,
                       interpret, suffix_splits=1):
    """Decode with one prefix: the suffix kernel without incoming states (it does not wait for
    the prefix partials; its keys cut into ``suffix_splits`` chunks), then one XLA merge of
    ``o_pre [n, Hkv, >= B * R2, D]`` (row ``b * R2 + j`` is query head ``h * G + j`` of
    sequence ``b``) with the suffix state(s)."""
    o_s, lse_s = suffix_decode_merge(q[:, 0], suffix_k, suffix_v, lim_s[:, 0], None, scale=scale,
                                     num_splits=suffix_splits, interpret=interpret,
                                     **DECODE_SUFFIX_TILING)
    n = suffix_splits
    # the suffix states [n, B, Hq(, D)] in the partials' row layout [n, Hkv, B * G(, D)]
    o_s = jnp.swapaxes(o_s.reshape(n, b, hkv, r, d), 1, 2).reshape(n, hkv, b * r, d)
    lse_s = jnp.swapaxes(lse_s.reshape(n, b, hkv, r), 1, 2).reshape(n, hkv, b * r)
    return _merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r)], b=b, tq=1, hq=hq, r=r,
                            dtype=q.dtype, inv=None)


def one_launch_plan(b: int, hq: int, hkv: int, p: int, s: int, d: int, dtype, *,
                    interpret: bool = False, force: bool = False) -> dict | None:
    """Static plan of the one-launch decode kernel: its keyword arguments, or ``None`` where
    it does not apply (the Mosaic GPU prefix kernel not taken, ``G < ONE_LAUNCH_MIN_GROUP``, or
    shapes outside ``fused_supported``) or, unless ``force``, where it was not measured to pay
    (``ONE_LAUNCH_REGIONS``, ``ONE_LAUNCH_MIN_CTAS``).

    Suffix tiles of 64 keys, as many pipeline stages (up to 5) as fit in shared memory; suffix
    splits so that the suffix tasks number at most about one wave, or more where needed to keep
    each task to at most 8 tiles per sequence; the prefix unsplit (``ONE_LAUNCH["num_splits"]``;
    None: ``choose_splits`` over the prefix CTAs alone)."""
    from pallas_kernels import shared_decode_mgpu as sd  # noqa: PLC0415
    g = hq // hkv
    if g < ONE_LAUNCH_MIN_GROUP:
        return None
    if mgpu_decode_splits(b, hq, hkv, p, d, jnp.dtype(dtype).itemsize, interpret=interpret) is None:
        return None
    cfg = dict(ONE_LAUNCH)
    block_s = cfg["block_s"] or 64
    alternate = cfg["suffix_mode"] == "alternate"
    if cfg["suffix_steps"] is None:  # k, v tiles (of each warpgroup for "rows") + the queries
        stage = (2 if alternate else 4) * block_s * d * jnp.dtype(dtype).itemsize
        cfg["suffix_steps"] = max(1, min(5, (SMEM_BYTES - 2 * 64 * d * 2 - 8192) // stage))
    if sd.fused_supported(batch=b, heads_q=hq, heads_kv=hkv, prefix_len=p, suffix_cap=s,
                          head_dim=d, dtype=dtype, block_s=block_s) is not None:
        return None
    ctas = hkv * cdiv(b * g, 128)
    in_region = any(pr[0] <= p <= pr[1] and sr[0] <= s <= sr[1] and g >= g_min
                    for pr, sr, g_min in ONE_LAUNCH_REGIONS)
    if not force and not (in_region and ctas >= ONE_LAUNCH_MIN_CTAS):
        return None
    n_tiles = s // block_s
    suf_ctas = ctas * 2 if alternate else ctas  # 64-row suffix tasks when alternating
    ss = cfg["suffix_splits"]
    if ss is None:
        ss = 1
        for c in range(1, n_tiles + 1):
            if n_tiles % c == 0 and suf_ctas * c <= sd.pm.SMS:
                ss = c
            if n_tiles % c == 0 and n_tiles // c <= 8 and suf_ctas * c > sd.pm.SMS:
                ss = c
                break
    cfg.update(block_s=block_s, suffix_splits=ss)
    return cfg


# The role-split launch under ``MGPU_MERGE = "auto"`` (session 22): G = SPLIT_GROUP query heads
# per kv head, at least SPLIT_MIN_ROWS rows per kv head (B * G), head_dim 128, and (prefix keys,
# suffix capacity) in one of SPLIT_REGIONS.  Measured on an H200 against the default path in the
# same process (``bench/results/logs/session22_probe_split{4a,4c,5}_h200.jsonl``), Hq=32/Hkv=8,
# with ``split_decode_mgpu.plan_roles``'s choice of CTAs: B=512 P=8K S=128 0.91x (0.1765 ms,
# 1.60x the floor); B=1024 P=4K S=64 / 128 / 256 0.967x / 0.951x / 0.974x; B=1024 P=16K S=256
# 0.879x (0.610 ms).  Not taken, measured slower: B=1024 P=16K S=64 (1.07x), B=256 (0.99-1.22x
# at P=4K S=64/128, P=16K S=256), Hq=8/Hkv=1 (G=8: 1.06-1.39x at B=1024).
SPLIT_REGIONS = (((4096, 8192), (64, 256)),
                 ((16384, 16384), (128, 256)))
SPLIT_GROUP = 4
SPLIT_MIN_ROWS = 2048


def split_plan(b: int, hq: int, hkv: int, p: int, s: int, d: int, dtype, *,
               interpret: bool = False, force: bool = False) -> dict | None:
    """Static plan of the role-split decode launch (``split_decode_mgpu``): its keyword
    arguments (``plan_roles``'s CTAs and prefix splits), or ``None`` where it does not apply
    (the Mosaic GPU prefix kernel not taken, or shapes outside ``split_supported``) or, unless
    ``force``, where it was not measured to pay (``SPLIT_REGIONS``, ``SPLIT_GROUP``,
    ``SPLIT_MIN_ROWS``, head_dim 128)."""
    from pallas_kernels import split_decode_mgpu as sd  # noqa: PLC0415
    if mgpu_decode_splits(b, hq, hkv, p, d, jnp.dtype(dtype).itemsize, interpret=interpret) is None:
        return None
    if sd.split_supported(batch=b, heads_q=hq, heads_kv=hkv, prefix_len=p, suffix_cap=s,
                          head_dim=d, dtype=dtype) is not None:
        return None
    g = hq // hkv
    in_region = (g == SPLIT_GROUP and b * g >= SPLIT_MIN_ROWS and d == 128
                 and any(pr[0] <= p <= pr[1] and sr[0] <= s <= sr[1] for pr, sr in SPLIT_REGIONS))
    if not force and not in_region:
        return None
    # (Mosaic GPU's CPU interpreter simulates every CTA: there, a 4-SM split of the same work)
    n, splits, m = sd.plan_roles(b, hq, hkv, p, s, d, jnp.dtype(dtype).itemsize,
                                 sms=4 if interpret else sd.pm.SMS)
    return dict(prefix_ctas=n, stream_ctas=m, num_splits=splits)


def _split_decode(q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale, interpret, prefix_ctas,
                  stream_ctas, num_splits):
    """Decode with one prefix through the role-split launch and its XLA merge
    (``split_decode_mgpu.split_decode_mgpu``); ``q [B, 1, Hq, D]`` -> ``(out, lse)`` with the
    query axis kept."""
    from pallas_kernels import split_decode_mgpu as sd  # noqa: PLC0415
    out, lse = sd.split_decode_mgpu(
        q[:, 0], pk, pv, p_len, suffix_k, suffix_v, s_len, scale=scale, return_lse=True,
        prefix_ctas=prefix_ctas, stream_ctas=stream_ctas, num_splits=num_splits,
        schedule_barrier=MGPU_SCHEDULE_BARRIER, interpret=interpret)
    return out[:, None], lse[:, None]


def _rows_128(q, hkv: int, g: int):
    """``(q_hmd [Hkv, M128, D], M)``: the decode queries as ``G`` rows per sequence and kv head
    (row ``b * G + j``), ``M = B * G`` padded with zero rows to a multiple of 128 (the Mosaic GPU
    kernels' 128-row blocks)."""
    m = q.shape[0] * g
    m128 = cdiv(m, 128) * 128
    qm = rows_from_q(q, hkv, g)  # [Hkv, B * G, D]
    return (jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm), m


def _one_launch_decode(q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale, interpret, order,
                       block_s, suffix_splits, num_splits, suffix_steps, suffix_mode):
    """Decode with one prefix through the one-launch kernel, then one XLA merge."""
    from pallas_kernels import shared_decode_mgpu as sd  # noqa: PLC0415
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = _rows_128(q, hkv, g)
    o_pre, lse_pre, o_suf, lse_suf = sd.shared_decode_partials_mgpu(
        qm, pk, pv, p_len, suffix_k, suffix_v, s_len, scale=scale, group=g, num_splits=num_splits,
        suffix_splits=suffix_splits, block_s=block_s, order=order, suffix_steps=suffix_steps,
        suffix_mode=suffix_mode, schedule_barrier=MGPU_SCHEDULE_BARRIER, interpret=interpret,
        _cpu_check=interpret)
    return _merge_row_parts([(o_pre, lse_pre, g), (o_suf, lse_suf, g)], b=b, tq=1, hq=hq, r=g,
                            dtype=q.dtype, inv=None)


def joint_splits(n_tiles: int, ctas: int, sms: int | None = None) -> int:
    """Prefix splits of the one-pass kernel: the largest power of two up to 16 that divides the
    ``n_tiles`` prefix tiles and keeps ``ctas * splits`` within one wave (``sms`` CTAs, one per
    SM); at least 1.  Measured (session 14, ``session14_probe_joint14b_h200.jsonl``, no
    ping-pong turns): at 64 CTAs 2 splits took 0.58-0.60x the time of 1 (Hq=32 B=256 and Hq=8
    B=1024, P=4K S=64); at 256 CTAs 1 split took 0.95x the time of 2 (Hq=32 B=1024)."""
    from pallas_kernels import prefix_attention_mgpu as pm  # noqa: PLC0415
    sms = pm.SMS if sms is None else sms
    best = 1
    for c in (2, 4, 8, 16):
        if n_tiles % c == 0 and ctas * c <= sms:
            best = c
    return best


def joint_plan(b: int, hq: int, hkv: int, p: int, s: int, d: int, dtype, *,
               interpret: bool = False, force: bool = False) -> dict | None:
    """Static plan of the one-pass decode kernel (``joint_decode_mgpu``): its keyword arguments,
    or ``None`` where it does not apply (the Mosaic GPU prefix kernel not taken, or shapes
    outside ``joint_supported``) or, unless ``force``, where it was not measured to pay
    (``JOINT_REGIONS``)."""
    from pallas_kernels import joint_decode_mgpu as jd  # noqa: PLC0415
    if mgpu_decode_splits(b, hq, hkv, p, d, jnp.dtype(dtype).itemsize, interpret=interpret) is None:
        return None
    if jd.joint_supported(batch=b, heads_q=hq, heads_kv=hkv, prefix_len=p, suffix_cap=s,
                          head_dim=d, dtype=dtype) is not None:
        return None
    g = hq // hkv
    ctas = hkv * cdiv(b * g, 128)
    in_region = any(pr[0] <= p <= pr[1] and sr[0] <= s <= sr[1] and g >= g_min and ctas >= c_min
                    for pr, sr, g_min, c_min in JOINT_REGIONS)
    if not force and not in_region:
        return None
    block_kv = jd.joint_tiles(d, jnp.dtype(dtype).itemsize, JOINT_STAGES)[0]
    splits = joint_splits(p // block_kv, ctas) if JOINT_SPLITS is None else JOINT_SPLITS
    return dict(num_splits=splits, schedule_barrier=JOINT_SCHEDULE_BARRIER, steps=JOINT_STAGES)


# The one-pass kernel under ``MGPU_MERGE = "auto"``: regions (prefix keys, suffix capacity,
# minimum G, minimum (kv head, 128-row) CTAs before splitting), each a measured range.
# Session 14, H200, one process, interleaved loops against the default path
# (``bench/results/logs/session14_probe_joint14{a,b}_h200.jsonl``; the kernel with 128-key
# prefix tiles at D=128, ``JOINT_SCHEDULE_BARRIER = False``, splits by ``joint_splits``):
# 0.84x the default's time at Hq=32/Hkv=8 B=256 P=4K S=64 (57.2 against 68.4 us), 0.94x at
# B=1024 P=4K S=64 (199.5 / 212.4), 0.84x at Hq=8/Hkv=1 B=1024 P=4K S=64 (47.7 / 57.1), 0.92x
# at Hq=8 B=1024 P=4K S=256 (70.7 / 76.8); but 1.02-1.10x at P=16K S=64 (Hq=32 B=256 and
# B=1024, Hq=8 B=256), 1.04x at Hq=32 B=256 P=4K S=128, and mixed at Hq=8 B=256 P=4K S=64 (16
# CTAs: 0.92x with the ping-pong turns, 1.10x without), so those stay on the default.  A second
# probe (``session14_probe_joint14d_h200.jsonl``) at shorter prefixes: 0.86x at Hq=32 B=256
# P=1K S=64, 0.97x at B=1024 P=1K S=64, 0.74x / 0.88x at Hq=8 B=1024 P=1K S=64 / S=256, 0.84x at
# Hq=32 B=256 P=2K S=64, 0.80x at Hq=8 B=1024 P=2K S=64, 0.98x at Hq=32 B=512 P=2K S=128 (G=4,
# S=128: left out, as at P=4K).  A third (``session14_probe_joint14f_h200.jsonl``) at 16-32 CTAs:
# 0.94x at Hq=32 B=64 P=4K S=64, 0.93x at B=64 P=1K S=64, 0.92x at B=128 P=4K S=64, 0.83x at
# Hq=8 B=256 P=1K S=64, 0.88x at Hq=8 B=256 P=4K S=64 (0.88x in probe c too, 1.10x in probe b),
# 0.98x at Hq=8 B=256 P=1K S=256 (0.99x at P=4K S=256, probe c); 1.01x at Hq=32 B=64 P=4K S=256
# (G=4, outside the regions).  Grid run 22 (all columns of a point in one run) then confirmed
# the S=64 points (Hq=32 B=64 P=1K 21.8 -> 19.5 us, P=4K 26.4 -> 25.0; Hq=8 B=256 P=1K 18.7 ->
# 18.5, P=4K 23.1 -> 22.4) but found Hq=8 B=256 S=256 slower (P=1K 22.7 -> 24.9 us, P=4K 27.8 ->
# 29.2): so S=64 from 16 CTAs, G >= 8 with S up to 256 only from 64 (the first probes' range).
JOINT_REGIONS = (((1024, 4096), (64, 64), 4, 16),
                 ((1024, 4096), (64, 256), 8, 64))
JOINT_SPLITS: int | None = None  # prefix splits of the one-pass kernel (None: joint_splits)
# Ping-pong turns of the one-pass kernel's prefix tiles.  Off: a warpgroup's suffix tile (the
# other has none at that step) then does not hold the other warpgroup at its next turn.  Session
# 14: without the turns the kernel took 0.92-0.95x the time with them at the three 2-split P=4K
# points above, 0.93x at Hq=32 B=1024 (1 split), 0.93-1.00x at the six P=1K-2K points.
JOINT_SCHEDULE_BARRIER = False
# Pipeline stages of the one-pass kernel (its tiles follow: ``joint_tiles``).  3 stages fit only
# with 64-key prefix tiles at D=128; session 14 measured them 0.96-1.00x the 2-stage time at
# Hq=8 B=1024 P=4K S=256 and Hq=32 B=256/1024 P=4K S=128, 1.11-1.21x at P=8K-16K and at
# S=64 (``session14_probe_joint14e_h200.jsonl``), and no faster than the default path anywhere
# there: 2 stages of 128-key prefix tiles stay.
JOINT_STAGES = 2


def _joint_decode(q, pk, pv, p_len, suffix_k, suffix_v, s_len, *, scale, interpret, num_splits,
                  schedule_barrier, steps):
    """Decode with one prefix through the one-pass kernel; with one prefix split its output is
    the attention itself (a layout change only), else one XLA merge of the splits."""
    from pallas_kernels import joint_decode_mgpu as jd  # noqa: PLC0415
    b, _, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, m = _rows_128(q, hkv, g)
    o, lse = jd.joint_decode_mgpu(qm, pk, pv, p_len, suffix_k, suffix_v, s_len, scale=scale,
                                  group=g, num_splits=num_splits, interpret=interpret,
                                  schedule_barrier=schedule_barrier, steps=steps,
                                  _cpu_check=interpret)
    if o.shape[0] == 1:
        return (rows_to_out(o[0, :, :m], b, 1, hq, g).astype(q.dtype),
                rows_to_out(lse[0, :, :m], b, 1, hq, g))
    return _merge_row_parts([(o, lse, g)], b=b, tq=1, hq=hq, r=g, dtype=q.dtype, inv=None)


def shared_prefix_forward(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
                          *, scale, interpret=False, prefix_cfg=None, suffix_block_k=None,
                          suffix_warps=None, suffix_stages=None, suffix_splits=None, variant=None,
                          prefix_len_g=None):
    """Shared path: batched prefix kernel, then suffix decode with the merge in its epilogue.

    When ``B * Hkv`` is too small to fill the GPU the suffix keys are split across programs
    too; the suffix then writes partials and one small XLA reduction merges prefix and suffix
    partials (3 stages instead of 2).

    ``q [B, Tq, Hq, D]``, ``prefix_k/v [G, P, Hkv, D]``, ``suffix_k/v [B, S, Hkv, D]``,
    ``seq_to_prefix [B]``, ``lim_p/lim_s [B, Tq]`` per-row key limits.  ``prefix_len_g``
    (optional, ``[G]`` int32): the prefix lengths; when decoding with one prefix
    (``Tq == G == 1``), where ``lim_p`` is that length on every row, the kernels take it as it
    is instead of per-row arrays built from ``lim_p`` (each one more XLA launch on the GPU).
    Returns ``(out [B, Tq, Hq, D] in q's dtype, lse [B, Tq, Hq] float32)``.
    """
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    check_rows_per_tile(tq, hq, hkv)
    # (suffix tiling None: each suffix kernel's own default)
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    cfg = prefix_config(b, r, hkv, p) if prefix_cfg is None else prefix_cfg
    block_m = cfg["block_m"]
    q = q.astype(prefix_k.dtype)
    variant = VARIANT if variant is None else variant
    if variant == "auto":
        variant = choose_variant(b, hkv, r2)

    if g == 1:
        order = inv = None
        s2p_sorted = np.zeros((b,), np.int32)  # (a constant: see ``seq_rows``)
    else:
        order = jnp.argsort(seq_to_prefix, stable=True).astype(jnp.int32)
        inv = jnp.argsort(order).astype(jnp.int32)
        s2p_sorted = seq_to_prefix[order]

    # Launch 1: prefix partials over compact rows (R2 per sequence), sorted by group.
    m = b * r2
    # (+R16 rows: the fused variant's suffix pass reads whole R16-row tiles of the partials past
    # the last sequence; the overlap variant's merge reads only the real rows)
    m_pad = cdiv(m + (0 if variant == "overlap" else r16), block_m) * block_m
    qp = rows_from_q(q, hkv, r2, order)
    qp = jnp.pad(qp, ((0, 0), (0, m_pad - m), (0, 0))) if m_pad > m else qp
    grp_rows = pad_rows(seq_rows(s2p_sorted, r2), m_pad - m, mode="edge")
    # tail padding rows (zero queries, results never used): the last real row's entry and
    # limit, so they load no key that the real rows of their block do not (a prefix may hold
    # anything, NaN included, past its length: 0 * NaN in ``p @ v`` would reach those rows)
    lim_rows = pad_rows(row_meta(lim_p, grp, r2, order), m_pad - m, mode="edge")
    # decoding with one prefix and its length given: that length for every row
    one_len = prefix_len_g.reshape(1) if g == 1 and tq == 1 and prefix_len_g is not None else None
    if g == 1 and tq == 1:  # the Mosaic GPU kernel, where it applies
        if MGPU_MERGE not in MGPU_MERGES:
            raise ValueError(f"MGPU_MERGE must be one of {MGPU_MERGES}, got {MGPU_MERGE!r}")
        ss = (mgpu_suffix_splits(b, hkv, suffix_k.shape[1], suffix_block_k or 64)
              if suffix_splits is None else suffix_splits)
        plan = (one_launch_plan(b, hq, hkv, p, suffix_k.shape[1], d, q.dtype, interpret=interpret,
                                force=MGPU_MERGE == "one_launch")
                if MGPU_MERGE in ("one_launch", "auto") and ss == 1 else None)
        p_len = jnp.max(lim_p) if one_len is None else one_len.reshape(())
        splan = (split_plan(b, hq, hkv, p, suffix_k.shape[1], d, q.dtype, interpret=interpret,
                            force=MGPU_MERGE == "split")
                 if MGPU_MERGE in ("split", "auto") else None)
        if splan is not None:
            return _split_decode(q, prefix_k[0], prefix_v[0], p_len, suffix_k, suffix_v,
                                 lim_s[:, 0], scale=scale, interpret=interpret, **splan)
        jplan = (joint_plan(b, hq, hkv, p, suffix_k.shape[1], d, q.dtype, interpret=interpret,
                            force=MGPU_MERGE == "joint")
                 if MGPU_MERGE in ("joint", "auto") else None)
        if jplan is not None:
            return _joint_decode(q, prefix_k[0], prefix_v[0], p_len, suffix_k, suffix_v,
                                 lim_s[:, 0], scale=scale, interpret=interpret, **jplan)
        if plan is not None:  # (its own plan checks that the Mosaic GPU kernel applies)
            return _one_launch_decode(q, prefix_k[0], prefix_v[0], p_len, suffix_k,
                                      suffix_v, lim_s[:, 0], scale=scale, interpret=interpret,
                                      **plan)
        mg = _mgpu_decode_partials(q[:, 0], prefix_k[0], prefix_v[0], p_len, scale=scale,
                                   interpret=interpret, num_splits=MGPU_SPLITS)
        if mg is not None and MGPU_MERGE != "epilogue" and (ss == 1
                                                             or SPLIT_SUFFIX_LAYOUT == "own"):
            return _independent_merge(q, suffix_k, suffix_v, lim_s, mg[0], mg[1], b=b, hq=hq,
                                      hkv=hkv, d=d, r=r, r2=r2, scale=scale, interpret=interpret,
                                      suffix_splits=ss)
        if mg is not None:
            return _suffix_with_merge(q, suffix_k, suffix_v, lim_s, mg[0], mg[1], order, inv,
                                      b=b, tq=tq, hq=hq, hkv=hkv, r=r, r2=r2, r16=r16, scale=scale,
                                      interpret=interpret, two_phase=False,
                                      suffix_block_k=suffix_block_k, suffix_warps=suffix_warps,
                                      suffix_stages=suffix_stages, suffix_splits=ss)
    if variant == "overlap":
        if one_len is not None:  # no per-row arrays: one pool entry, one length
            grp_rows, lim_rows = None, one_len
        return _overlap_forward(q, prefix_k, prefix_v, suffix_k, suffix_v, qp, grp_rows, lim_rows,
                                lim_s, order, inv, cfg=cfg, scale=scale, interpret=interpret,
                                suffix_block_k=suffix_block_k or 64, suffix_splits=suffix_splits)
    o_pre, lse_pre = prefix_partials(qp, prefix_k, prefix_v, grp_rows, lim_rows, scale=scale,
                                     block_m=block_m, block_k=cfg["block_k"],
                                     num_splits=cfg["num_splits"], num_warps=cfg["num_warps"],
                                     num_stages=cfg["num_stages"], interpret=interpret,
                                     two_phase=cfg.get("two_phase", False))

    return _suffix_with_merge(q, suffix_k, suffix_v, lim_s, o_pre, lse_pre, order, inv, b=b, tq=tq,
                              hq=hq, hkv=hkv, r=r, r2=r2, r16=r16, scale=scale,
                              interpret=interpret, two_phase=cfg.get("two_phase", False),
                              suffix_block_k=suffix_block_k, suffix_warps=suffix_warps,
                              suffix_stages=suffix_stages, suffix_splits=suffix_splits)


def shared_prefix_forward_unfused(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                                  lim_p, lim_s, *, scale, interpret=False):
    """Three-stage variant (prefix kernel, suffix kernel, XLA merge) kept for comparison."""
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    cfg = prefix_config(b, r, hkv, p)
    q = q.astype(prefix_k.dtype)
    order = None if g == 1 else jnp.argsort(seq_to_prefix, stable=True).astype(jnp.int32)
    inv = None if g == 1 else jnp.argsort(order).astype(jnp.int32)
    s2p_sorted = np.zeros((b,), np.int32) if order is None else seq_to_prefix[order]
    m = b * r2
    m_pad = cdiv(m, cfg["block_m"]) * cfg["block_m"]
    qp = jnp.pad(rows_from_q(q, hkv, r2, order), ((0, 0), (0, m_pad - m), (0, 0)))
    grp_rows = pad_rows(seq_rows(s2p_sorted, r2), m_pad - m, mode="edge")
    # tail padding rows (zero queries, results never used): the last real row's entry and
    # limit, so they load no key that the real rows of their block do not (a prefix may hold
    # anything, NaN included, past its length: 0 * NaN in ``p @ v`` would reach those rows)
    lim_rows = pad_rows(row_meta(lim_p, grp, r2, order), m_pad - m, mode="edge")
    o_pre, lse_pre = prefix_partials(qp, prefix_k, prefix_v, grp_rows, lim_rows, scale=scale,
                                     interpret=interpret, **cfg)
    o_pre, lse_pre = merge_partials(o_pre, lse_pre)
    o_pre = rows_to_out(o_pre[:, :m], b, tq, hq, r2, inv)
    lse_pre = rows_to_out(lse_pre[:, :m], b, tq, hq, r2, inv)
    src_s = Source(suffix_k, suffix_v, seq_rows(np.arange(b, dtype=np.int32), r16),
                   row_meta(lim_s, grp, r16))
    o_s, lse_s = ragged_attention(rows_from_q(q, hkv, r16), [src_s], scale=scale, block_m=r16,
                                  finalize=False, interpret=interpret)
    o_s = rows_to_out(o_s[0], b, tq, hq, r16)
    lse_s = rows_to_out(lse_s[0], b, tq, hq, r16)
    o, lse = merge_partials(jnp.stack([o_pre, o_s]), jnp.stack([lse_pre, lse_s]))
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------- overlap variant

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
    """
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
        scale_log2=float(scale) * math.log2(math.e), precision=precision,
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


def _overlap_forward(q, prefix_k, prefix_v, suffix_k, suffix_v, qp, grp_rows, lim_rows, lim_s,
                     order, inv, *, cfg, scale, interpret, suffix_block_k, suffix_splits=None):
    """The overlap variant: one launch of interleaved prefix and suffix programs, then one XLA
    merge.  The suffix keys are split like the fused variant's (``default_suffix_splits``) so a
    small batch with a long suffix does not leave ``B * Hkv`` programs walking it alone."""
    b, tq, hq, d = q.shape
    hkv = prefix_k.shape[2]
    if suffix_splits is None:
        suffix_splits = default_suffix_splits(b, hkv, suffix_k.shape[1], suffix_block_k)
    grp = hq // hkv
    r, r16 = q_rows_layout(tq, hq, hkv)
    r2 = next_pow2(r)
    qs = rows_from_q(q, hkv, r16, order)
    sidx = seq_rows(np.arange(b, dtype=np.int32) if order is None else order, r16)
    # decoding: one key limit per sequence, broadcast to its rows in the kernel
    lims = lim_s[:, 0] if tq == 1 and order is None else row_meta(lim_s, grp, r16, order)
    o_pre, lse_pre, o_s, lse_s = overlap_partials(
        qp, grp_rows, lim_rows, prefix_k, prefix_v, qs, sidx, lims, suffix_k, suffix_v,
        scale=scale, block_m=cfg["block_m"], block_k=cfg["block_k"],
        num_splits=cfg["num_splits"], r16=r16, suffix_block_k=suffix_block_k,
        suffix_splits=suffix_splits, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        interpret=interpret)
    return _merge_row_parts([(o_pre, lse_pre, r2), (o_s, lse_s, r16)], b=b, tq=tq, hq=hq, r=r,
                            dtype=q.dtype, inv=inv)
