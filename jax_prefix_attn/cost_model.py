"""Cost model choosing between the shared and the flat path of shared-prefix attention.

Both paths are exact; they differ in memory traffic, tensor-core work, parallelism and
launches.  With ``B`` sequences, ``Tq`` queries each, ``Hq``/``Hkv`` heads of size ``D``, ``G``
prefix groups of padded length ``P``, suffix capacity ``S`` and ``e`` bytes per element, one
token of K+V is ``kv = 2 * Hkv * D * e`` bytes.  Each kernel costs

    t = max(max(bytes / BW, flops / MMA) / util, serial_keys * T_KEY) + T_LAUNCH
    util = min(1, programs / SLOTS)       # serial_keys: one program's chain of keys (latency)

(``util`` models a grid too small to fill the GPU), and

* **flat** (one ragged split-KV decode launch over shared storage, + one small XLA merge when
  the keys are split to fill the GPU): DRAM ``bytes = (G * P + B * S) * kv``; the other
  ``(B - G) * P * kv`` bytes of prefix re-reads by every sequence come from L2 (all sequences
  stream the same prefix at the same time), charged at ``L2_BW``.  Matrix-vector flops never
  bind.
* **shared**: either batched prefix kernel + suffix kernel with fused merge (2 launches; the
  suffix is split, + 1 XLA merge, when ``B * Hkv`` is small), or, for large batches, one launch
  of interleaved prefix and suffix programs + 1 XLA merge (``max`` of the two parts plus 30% of
  the smaller for imperfect overlap): prefix ``bytes = G * P * kv``,
  ``flops = 4 * B * R2 * Hkv * P * D`` (``R2`` = query rows per sequence and kv head, padded to a
  power of two) at the Triton tensor-core rate ``MMA``; suffix ``bytes = B * S * kv`` plus the
  float32 partials.

The constants were measured for these kernels on an H200 (``bench/shared_prefix.py --tune``
and the grid in ``bench/results/shared_prefix_h200_session2_triton.json``, measured with the
Triton prefix kernel; the Mosaic GPU prefix kernel, default on Hopper since, makes ``shared``
faster at large batch, so the model errs towards ``flat`` there); only static shapes enter.
Session 5 changed two of them after the benchmark's timing loop stopped adding a host
synchronisation (14-20 us) to every call, which had hidden part of the shared path's extra
launches: ``T_LAUNCH`` 8 -> 3 us and ``MMA`` 2.05e14 -> 3e14 (the Triton prefix kernel's
measured 205-322 TFLOP/s).  On the session-5 grid (``bench/results/shared_prefix_h200.json``,
runs 0-1) the old constants chose within 5% of the better path at 66 of 75 points, these at 71
(in-sample); run 2 of that file re-measured the 34 small points with these constants: 28 of
them within 5% (25 of 34 in run 1 with the old ones), 69 of 75 over the grid, the worst 1.46x
(B=16, P=16K, Hq=8/Hkv=1, 24 us against 35 us).
Session 6 added the Mosaic GPU path, which the shared path takes on Hopper where
``pallas_kernels.prefix_attention.mgpu_decode_splits`` says it runs: q row gather, the prefix
kernel (one CTA per SM, ``MMA_MGPU``; 5e14 until session 9 made the kernel 6-12% faster,
which changes no choice on the grid; no per-key latency term: 128-key TMA tiles prefetched two
ahead), the suffix kernel (split as the Triton path splits it; since session 8 only below 256
(sequence, kv head) programs) and one XLA merge, all in sequence; and it stopped charging the
overlap variant's suffix programs for the prefix partials (its XLA merge reads them).  On the
session-6 grid (``bench/results/shared_prefix_h200.json``) that chose within 5% of the better
path at 69 of 75 points (in-sample; the grid's measured ``auto`` column, run with the model
before these two changes, at 66), and at 9 of 12 shapes
outside the grid (``bench/results/logs/session6_validate_auto_h200.json``, worst 1.14x: B=32,
P=2K, S=512, Hq=8/Hkv=1, auto 22 us where the better path took 19 us).  The misses left are
all Hq=8/Hkv=1 or B=16 points under 0.05 ms where the two paths differ by 8-23%.
Session 7's one-launch kernel (prefix 4K, suffix capacity 128-256, >= 64 prefix CTAs; since
session 8 also G = 8, prefix 16K, suffix 1K) is not modelled separately: it is charged as the
two launches in sequence, an overestimate of the shared path by up to ~17% at those points
(measured), where the model already picks shared (flat is 3.9-7.6x slower there in grid run 3,
4.6x in run 5), so the choice does not change.
Session 8 fit the latency terms to a probe of both paths at the 45 small grid points
(``bench/results/logs/session8_probe_small_h200.json``: B <= 64, and Hq=8 B=256), where the
misses were: ``T_LAUNCH`` 3 -> 3.5 us, ``T_KEY`` 4e-8 -> 3e-8 s for the shared kernels with a
separate ``T_KEY_FLAT`` = 4e-8 s for the flat decode kernel, and ``SLOTS`` (programs that reach
full bandwidth) 264 -> 198; and the overlap variant now splits its suffix keys as the fused
variant does (the model had assumed so) with one merge of all parts (it had been charged a
second).  Grid run 4 (``bench/results/shared_prefix_h200.json``) re-measured the 24 points that
changed: the measured ``auto`` column is within 5% of the better path at 74 of 75 points (worst
1.09x: Hq=8/Hkv=1 B=64 P=1K S=1K, 26.5 us against 24.4 us); out of sample
(``bench/results/logs/session8_validate_auto_h200.json``, 26 shapes not used in the fit) at 25
of 26 (worst 1.11x: Hq=32 B=40 P=1K S=2K, where the overlap variant's suffix streams slower
than the flat kernel).
Session 10 removed XLA glue kernels from both paths (constant row indices, one-fusion merges:
the flat path 3-4 kernels instead of 6-8, the shared path 6-7 instead of 8-9 at small points) and
stopped padding the overlap variant's prefix rows by 16 (modelled: ``n_rb_ov``); the glue
is not modelled kernel by kernel.  On the grid's re-measured small points (runs 9-11) the model
chooses within 5% of the better path at 42 of 45, 72 of 75 over the grid; the three misses are
Hq=8/Hkv=1 B=16 points of 14-21 us where the two paths are 1-1.5 us apart (worst 1.11x), below
the 5-16% spread of repeated timings of one path there
(``bench/results/logs/session10_probe_timing10_h200.json``).
Session 11 moved the flat path's decoding to the queries' own layout (0.71-1.09x its time over
the grid, median 0.88x): ``T_KEY_FLAT`` 4e-8 -> 3e-8 s (median model/measured 1.02 over the 36
small points of grid runs 12-13; the session-10 value overestimated the new kernel by ~20%), and
its merge reads only the real rows.  On the re-measured grid (runs 12-15) auto is within 5% at 72
of 75 points (misses: Hq=8/Hkv=1 B=16 P=4K S=64 1.05x and S=256 1.13x, Hq=32 B=16 P=1K S=64
1.11x, where auto takes flat and shared was 1-2 us faster), and out of sample at 14 of 15 shapes
(``bench/results/logs/session11_validate_auto11_h200.json``, worst 1.15x: Hq=32 B=40 P=1K S=2K).
Session 12 removed the decode path's remaining XLA glue before the Pallas calls (row limits,
per-row metadata arrays: the overlap variant's glue went from 3-4 kernels to 1) and the grid's
timing loops became one CUDA graph each (``bench.timing.GRAPH_ALWAYS``).  Re-measured (runs
18-19), the shared path took a median 0.98x its session-11 time (0.80-1.05x), the flat path
1.00x (0.84-1.13x); the model then overestimated the overlap variant by a median
24% at the 45 small points against 6% for flat, and chose within 5% at 70 of 75 points (worst
1.23x: Hq=32 B=16 P=1K S=256, flat 23.3 us where shared took 19.0).  ``T_KEY_FLAT`` back to
4e-8 s: 71 of 75 (worst 1.12x) in-sample; out of sample
(``bench/results/logs/session12_validate_auto12_h200.json``, 14 shapes measured in
the same session at commit 89a36c0, before a fix that made flat 1.1-1.65x faster at some Hq=32
shapes: its flat times there may be high) 12 of 14 within 5% instead of 11 (worst 1.11x either way).  No
setting of ``T_LAUNCH`` (2-3.5 us), ``T_KEY_FLAT`` (3-4e-8 s) or the overlap weight (0-0.3)
got below 4 misses: they are points 1-4 us apart, below the model's resolution.
Session 14's one-pass kernel (``pallas_kernels.joint_decode_mgpu``, taken in
``prefix_attention.JOINT_REGIONS``: prefix 1K-4K, short suffixes) is not modelled
separately either: it is charged as the Mosaic GPU path above, which overestimates the shared
path there (0.74-0.97x measured), where flat is 1.6-9.5x slower (grid runs 20-22), so no choice
changes.
Session 15 checked the model, unchanged, against every measured pair of times
(``bench/results/logs/session15_cost_model_scan.py`` and ``.txt``): within 5% of the better path
at 74 of the H200 grid's 78 points (the issue's three small-GQA points added), 62 of 63 on an
H100 (``bench/results/shared_prefix_h100.json``; its one miss, Hq=32 B=16 P=1K S=64, is a miss
on the H200 too), 15 of 18 fresh out-of-sample shapes
(``bench/results/logs/session15_validate_auto15_h200.jsonl``, worst 1.09x), 177 of 188 in all.
A scan of ``SLOTS`` (33-198), ``T_KEY``, ``T_KEY_FLAT`` and ``T_LAUNCH`` found at best 179 of
188 (many settings), the same worst case and the same 15 of 18 out of sample: no change.
Session 22's role-split launch (``pallas_kernels.split_decode_mgpu``, taken in
``prefix_attention.SPLIT_REGIONS``: G = 4, B >= 512, prefix 4K-16K, suffix 64-256) is not
modelled separately either: charged as the Mosaic GPU path above, it is overestimated there
(0.72-1.005x measured), where flat is 5-12x slower (grid run 24), so no choice changes.
RelayAttention's speedup model ``p = (s + c + 2) / (s / b + c + 7)`` is this comparison
without the flops, parallelism and L2 terms.
"""
from __future__ import annotations

import dataclasses

__all__ = ["PathCosts", "estimate", "choose_path"]

BW = 2.5e12          # bytes/s the decode kernels stream from DRAM (fit to the H200 grid)
L2_BW = 8.9e12       # bytes/s of prefix re-reads served by L2 in the flat kernel (measured)
MMA = 3.0e14         # FLOP/s of the Triton-lowered prefix kernel's dots (measured 205-322)
T_LAUNCH = 3.5e-6    # seconds per kernel launch / dependent stage (launch + ramp + tail)
T_KEY = 3.0e-8       # seconds per key on one program's critical path (tile load latency)
T_KEY_FLAT = 4.0e-8  # the same for the flat decode kernel (session 11: 4e-8 -> 3e-8, 12: back)
MMA_MGPU = 5.5e14    # FLOP/s of the Mosaic GPU prefix kernel (H200: 429-620 measured, session 9)
SMS = 132            # streaming multiprocessors (H100 / H200)
SLOTS = 198          # programs that reach full bandwidth (fewer: proportionally less)


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel_s(nbytes: float, flops: float, programs: int, *, l2_bytes: float = 0.0,
              serial_keys: float = 0.0, mma: float = MMA, slots: int | None = None,
              t_key: float | None = None) -> float:
    util = min(1.0, programs / (SLOTS if slots is None else slots))
    throughput = max(nbytes / BW + l2_bytes / L2_BW, flops / mma) / util
    return max(throughput, serial_keys * (T_KEY if t_key is None else t_key)) + T_LAUNCH


@dataclasses.dataclass(frozen=True)
class PathCosts:
    flat_s: float
    shared_s: float
    flat_bytes: float
    shared_bytes: float
    shared_flops: float

    @property
    def choice(self) -> str:
        return "shared" if self.shared_s <= self.flat_s else "flat"


def estimate(*, batch: int, tq: int, heads_q: int, heads_kv: int, head_dim: int, groups: int,
             prefix_len: int, suffix_len: int, itemsize: int) -> PathCosts:
    """Modelled seconds of both paths (see the module docstring)."""
    b, p, s = batch, prefix_len, suffix_len
    g = min(groups, b)
    kv = 2 * heads_kv * head_dim * itemsize
    q_bytes = 2 * b * tq * heads_q * head_dim * itemsize  # q in, out written
    r2 = _next_pow2(tq * heads_q // heads_kv)

    # flat: one launch over (B, Hkv) programs, keys split to reach 2 * SMS programs.
    flat_dram = (g * p + b * s) * kv + q_bytes
    flat_l2 = (b - g) * p * kv
    splits = 1 if b * heads_kv >= 2 * SMS else max(1, min(_cdiv(2 * SMS, b * heads_kv),
                                                          _cdiv(p + s, 256)))
    flat_s = _kernel_s(flat_dram, 0.0, b * heads_kv * splits, l2_bytes=flat_l2,
                       serial_keys=_cdiv(p + s, splits), t_key=T_KEY_FLAT)
    if splits > 1:  # XLA merge of float32 partials: the real rows when decoding (own layout),
        # else rows padded to >= 16 per (sequence, kv head)
        rows_m = b * heads_q if tq == 1 else b * heads_kv * max(16, r2)
        flat_s += _kernel_s(2 * splits * rows_m * (head_dim + 1) * 4, 0.0, 2 * SMS)

    # shared: prefix kernel (row blocks of 128 or 64 rows, prefix split to fill the GPU).
    rows = b * r2
    block_m = 128 if rows >= 1024 else 64
    n_rb = _cdiv(rows + 16, block_m)
    p_splits = 1 if heads_kv * n_rb >= 2 * SMS else max(1, min(_cdiv(2 * SMS, heads_kv * n_rb),
                                                               _cdiv(p, 256)))
    partial_bytes = p_splits * n_rb * block_m * heads_kv * (head_dim + 1) * 4
    prefix_flops = 4.0 * n_rb * block_m * heads_kv * p * head_dim
    t_prefix = _kernel_s(g * p * kv + partial_bytes, prefix_flops,
                         heads_kv * n_rb * p_splits, serial_keys=_cdiv(p, p_splits))
    s_splits = 1 if b * heads_kv >= 2 * SMS else max(1, min(_cdiv(2 * SMS, b * heads_kv),
                                                            _cdiv(s, 128)))
    suffix_bytes = b * s * kv + q_bytes + partial_bytes
    t_suffix = _kernel_s(suffix_bytes, 0.0, b * heads_kv * s_splits,
                         serial_keys=_cdiv(s, s_splits))
    # the overlap variant's suffix programs do not read the prefix partials (its XLA merge does)
    t_suffix_own = _kernel_s(b * s * kv + q_bytes, 0.0, b * heads_kv * s_splits,
                             serial_keys=_cdiv(s, s_splits))
    from pallas_kernels.prefix_attention import (  # noqa: PLC0415
        choose_variant, mgpu_decode_splits, mgpu_suffix_splits)
    mg_splits = (mgpu_decode_splits(b, heads_q, heads_kv, p, head_dim, itemsize)
                 if tq == 1 and g == 1 else None)
    if mg_splits is not None:
        # Mosaic GPU prefix kernel (one CTA per SM, 128-row blocks, normalised 16-bit partials),
        # XLA row gather of q before it; suffix kernel; XLA merge (or the split suffix + merge).
        m128 = _cdiv(b * r2, 128) * 128
        ctas = heads_kv * (m128 // 128) * mg_splits
        part16 = mg_splits * heads_kv * m128 * (head_dim * itemsize + 4)
        # (no per-key latency chain: 128-key TMA tiles, prefetched two ahead)
        t_prefix = _kernel_s(g * p * kv + part16, 4.0 * m128 * heads_kv * p * head_dim, ctas,
                             mma=MMA_MGPU, slots=SMS)
        ss = mgpu_suffix_splits(b, heads_kv, s)
        t_suffix = _kernel_s(b * s * kv + q_bytes, 0.0, b * heads_kv * ss,
                             serial_keys=_cdiv(s, ss))
        n_parts = mg_splits + ss
        t_merge = _kernel_s(part16 + n_parts * b * heads_q * (head_dim + 1) * 4 + q_bytes, 0.0,
                            2 * SMS)
        t_gather = _kernel_s(q_bytes, 0.0, 2 * SMS)
        return PathCosts(flat_s=flat_s, shared_s=t_gather + t_prefix + t_suffix + t_merge,
                         flat_bytes=flat_dram + flat_l2, shared_bytes=g * p * kv + b * s * kv,
                         shared_flops=4.0 * m128 * heads_kv * p * head_dim)
    if choose_variant(b, heads_kv, r2) == "overlap":
        # One launch with interleaved prefix and suffix programs (the suffix keys split like the
        # fused variant's): the two overlap (imperfectly), then one XLA merge of all the float32
        # partials.  Its prefix rows are not padded for a suffix pass (session 10).
        n_rb_ov = _cdiv(rows, block_m)
        t_prefix = _kernel_s(g * p * kv + p_splits * n_rb_ov * block_m * heads_kv
                             * (head_dim + 1) * 4, 4.0 * n_rb_ov * block_m * heads_kv * p * head_dim,
                             heads_kv * n_rb_ov * p_splits, serial_keys=_cdiv(p, p_splits))
        shared_s = (max(t_prefix, t_suffix_own) + 0.3 * min(t_prefix, t_suffix_own)
                    + _kernel_s(2 * (p_splits + s_splits) * b * tq * heads_q * (head_dim + 1) * 4,
                                0.0, 2 * SMS))
    else:
        shared_s = t_prefix + t_suffix
        if s_splits > 1:
            shared_s += _kernel_s((p_splits + s_splits) * b * tq * heads_q * (head_dim + 1) * 4,
                                  0.0, 2 * SMS)
    return PathCosts(flat_s=flat_s, shared_s=shared_s, flat_bytes=flat_dram + flat_l2,
                     shared_bytes=g * p * kv + suffix_bytes, shared_flops=prefix_flops)


def choose_path(**shapes) -> str:
    """``"shared"`` or ``"flat"``, whichever :func:`estimate` finds faster."""
    return estimate(**shapes).choice
