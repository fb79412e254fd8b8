"""One-pass shared-prefix decode through Pallas Mosaic GPU: every CTA streams its own rows'
suffix tiles through the *same* pipeline as the shared prefix tiles, into the *same* online
softmax state, so one SM's tensor cores work on prefix tiles while its memory warpgroup brings
suffix tiles from HBM.

Why: the shared path's two parts are each near their own roofline (H200, Hq=32/Hkv=8, B=1024
P=4K S=64: the prefix kernel 113 us at ~600 TFLOP/s, the suffix kernel 72 us at ~3.7 TB/s,
``bench/results/logs/session9_kernel_profile_misses_h200.json``) but run one after the other,
while the floor is the larger of the two (103 us).  Running them in different CTAs of one
launch (:mod:`pallas_kernels.shared_decode_mgpu`) or as concurrent launches overlapped little:
an SM that holds a suffix task waits on memory with its tensor cores idle.  Here each step of a
CTA's pipeline brings one prefix tile (shared by the CTA's two compute warpgroups) and one
suffix tile for one of the warpgroups (they take turns); the suffix tile belongs to one
sequence of the warpgroup's 64 rows and counts only for that sequence's ``G`` rows (the others
are masked), so the suffix costs ``64 / G`` times its useful tensor-core work and no merge of
prefix and suffix states is needed at all: the state a CTA writes is the final attention of its
rows when the prefix is not split.

Scope (static, :func:`joint_supported`): decoding (one query per sequence), one prefix shared
by every sequence (all see ``p_len`` keys), 16-bit inputs, ``head_dim`` 64 or 128,
``G = Hq / Hkv`` a power of two dividing 64, ``P % 128 == 0``, suffix capacity
``S % block_s == 0``.

Layouts: ``q_hmd [Hkv, M, D]`` rows ``b * G + j`` (query head ``h * G + j`` of sequence ``b``;
``M`` a multiple of 128, rows ``>= B * G`` padding), prefix ``k/v [P, Hkv, D]`` with ``p_len``
valid keys (``[1]`` or scalar int32, dynamic), suffix ``k/v [B, S, Hkv, D]`` with ``s_len [B]``
int32 valid keys (dynamic).  Output ``o [splits, Hkv, M, D]`` (q's dtype, normalised) and
``lse [splits, Hkv, M]`` (float32, natural log; ``-inf`` and ``o = 0`` where a split saw no
key).  Split ``sp`` holds prefix key tiles ``[sp * T, (sp + 1) * T)`` and the suffixes of the
sequences ``sp * n, ..., sp * n + n - 1`` of each warpgroup's ``64 / G`` (``n = ceil(64 / G /
splits)``); the caller merges the splits by their LSE (nothing to merge with one split).

Kernel: grid ``(Hkv, M / 128, splits)``, two compute warpgroups of 64 rows and one memory
warpgroup (TMA pipeline, ``steps`` stages).  Step ``t`` of ``max(T, 2 * n * S / block_s)``:
prefix tile ``t`` (while ``t < T``; with ``schedule_barrier`` the two warpgroups take turns on
the tensor cores, the ping-pong schedule of :mod:`pallas_kernels.prefix_attention_mgpu`,
warpgroup 0 taking its closing turn right after tile ``T - 1``), then, for warpgroup ``t % 2``
only, its suffix tile ``u = t // 2`` (sequence ``u // (S / block_s)`` of the split's, tile
``u % (S / block_s)``).  Tiles
past a sequence's length, and steps past a part's end, repeat the last fetched tile (no new
load) and are skipped or masked; ``V`` rows past a suffix length are zeroed in shared memory
before ``P V`` so that whatever the cache holds there (NaN included) never reaches the output.
Keys of the prefix past ``p_len`` are masked in the scores only: they must be finite (as for
:func:`pallas_kernels.prefix_attention_mgpu.prefix_partials_mgpu`).

Pipeline specs: prefix ``K``, ``V`` tiles of ``block_kv`` keys (both warpgroups) and suffix
``K``, ``V`` tiles of ``block_s`` keys, which go to the warpgroups in turn (step ``t`` to
warpgroup ``t % 2``).  Shared memory (:func:`joint_tiles`): at ``D = 128`` two stages of
``(2 * 128 + 2 * 64) * D`` bf16 plus the queries take 229,376 of Hopper's 232,448 bytes per
CTA, the barriers and alignment 2,664 more (measured from the lowering); this fits only because
the LSE is stored from registers straight to global memory instead of through a 512-byte
shared buffer (session 13, with that buffer, had to use 64-key prefix tiles).  Mosaic GPU's
layout inference fails for tiles under 64 keys.

Measured, H200, whole shared path against the default path (one process, interleaved loops):
* session 13, 64-key prefix tiles, ping-pong turns (``bench/results/logs/
  session13_probe_joint13_h200.jsonl``): 1.03-1.41x the default's time at 7 Hq=32 points;
* session 14, 128-key prefix tiles (``session14_probe_joint14{a,b,c,d,e}_h200.jsonl``): with
  the turns 0.89-1.11x at 9 points (the better of the default splits and 2); without them
  (``schedule_barrier=False``: a warpgroup's suffix step then does not hold the other at its
  next turn) and with ``prefix_attention.joint_splits``: 0.84x at Hq=32/Hkv=8 B=256 P=4K S=64,
  0.94x at B=1024 P=4K S=64, 0.84x / 0.92x at Hq=8/Hkv=1 B=1024 P=4K S=64 / S=256, 0.74-0.97x
  at six points with P=1K-2K; but 1.02-1.10x at P=16K and at Hq=32 B=256 P=4K S=128.
  ``MGPU_MERGE = "auto"`` takes it in the measured regions (``prefix_attention.JOINT_REGIONS``).
What bounds it: the suffix steps, one sequence's ``G`` rows of 64 per product, add tensor-core
and softmax work (``64 / G`` times the useful work) on top of a prefix pass already near the
matmul rate, and a step can only start when both its prefix and suffix tiles have landed (two
stages fit).  Session 15 measured the second part alone (``bench/results/logs/
session15_probe_bound15_h200.jsonl``, timing-only variants, H200): with the suffix tiles loaded
but no suffix compute, Hq=32/Hkv=8 B=1024 P=4K S=64 took 157.6 us (the real kernel 200.0 us, the
prefix kernel alone 131.9 us), Hq=8/Hkv=1 B=1024 S=64 41.2 us (47.6, 38.0), Hq=32 B=256 S=64
46.2 us (56.3, 41.2), Hq=8 B=1024 S=256 61.7 us (72.8, 39.7).  So a cheaper suffix product (the
"swap AB" form ``S^T = K Q^T``) could recover at most the difference to the first number.
Nor is that load cost HBM latency: asking for each suffix tile in L2 2, 4 or 8 steps ahead
(``plgpu.async_prefetch``; commit 02b4628, reverted) took 0.98-1.04x the time without it at the
five P=4K points, 1.01-1.08x in the load-only variant (``session15_probe_prefetch15_h200.jsonl``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import shared_decode_mgpu as sd
from pallas_kernels.prefix_attention_mgpu import plgpu

__all__ = ["joint_supported", "joint_decode_mgpu", "joint_tiles"]

_LOG2E = math.log2(math.e)
SMEM_BYTES = 232448  # shared memory per CTA on Hopper


def joint_tiles(head_dim: int, itemsize: int = 2, steps: int = 2) -> tuple[int, int]:
    """``(block_kv, block_s)``: prefix and suffix tile keys, the largest in {128, 64} (prefix
    first) whose ``steps``-stage pipeline fits in shared memory (Mosaic GPU's layout inference
    needs tiles of at least 64 keys).  ``(128, 64)`` at ``D = 128``, ``(128, 128)`` at 64."""
    q_bytes = 2 * 64 * head_dim * itemsize
    for bkv, bs in ((128, 128), (128, 64), (64, 64)):
        stage = 2 * (bkv + bs) * head_dim * itemsize
        if steps * stage + q_bytes + 3072 <= SMEM_BYTES:  # (+ barriers, alignment: 2664 B measured)
            return bkv, bs
    return 64, 64


def joint_supported(*, batch: int, heads_q: int, heads_kv: int, prefix_len: int, suffix_cap: int,
                    head_dim: int, dtype, block_s: int | None = None) -> str | None:
    """``None`` when :func:`joint_decode_mgpu` handles these static shapes, else the reason: the
    one-launch kernel's conditions (:func:`pallas_kernels.shared_decode_mgpu.fused_supported`,
    the same row layout and suffix tiles) with this kernel's suffix tile (:func:`joint_tiles`)."""
    bs = joint_tiles(head_dim)[1] if block_s is None else block_s
    return sd.fused_supported(batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                              prefix_len=prefix_len, suffix_cap=suffix_cap, head_dim=head_dim,
                              dtype=dtype, block_s=bs)


def joint_decode_mgpu(q_hmd, pk_phd, pv_phd, p_len, sk_bshd, sv_bshd, s_len, *, scale: float,
                      group: int, num_splits: int | None = None, block_kv: int | None = None,
                      block_s: int | None = None, steps: int = 2, schedule_barrier: bool = True,
                      interpret: bool = False, _cpu_check: bool = False):
    """Attention of every row over the prefix keys ``[0, p_len)`` and its own sequence's suffix
    keys ``[0, s_len[b])``, in one pass; see the module docstring for layouts and scope.

    Returns ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])``.  ``num_splits``: prefix splits
    (None: :func:`prefix_attention_mgpu.choose_splits` over the ``Hkv * M / 128`` CTAs).
    ``block_kv`` / ``block_s``: prefix / suffix tile keys (None: :func:`joint_tiles`).
    ``interpret`` runs Mosaic GPU's CPU interpreter and needs ``_cpu_check`` (tests only).

    Raises ``ValueError`` for shapes outside the scope or splits that do not divide the prefix
    tiles.
    """
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    dtype = q_hmd.dtype
    pm.check_decode_operands(q_hmd, pk_phd, pv_phd, sk_bshd, sv_bshd, group)
    t_kv, t_s = joint_tiles(d, jnp.dtype(dtype).itemsize, steps)
    block_kv = t_kv if block_kv is None else int(block_kv)
    bs = t_s if block_s is None else int(block_s)
    why = joint_supported(batch=b, heads_q=hkv * group, heads_kv=hkv, prefix_len=p,
                          suffix_cap=s_cap, head_dim=d, dtype=dtype, block_s=bs)
    if why is not None:
        raise ValueError(f"joint_decode_mgpu cannot run these shapes: {why}")
    if p % block_kv:
        raise ValueError(f"prefix length {p} must be a multiple of block_kv={block_kv}")
    pk_phd, pv_phd, sk_bshd, sv_bshd = (x.astype(dtype) for x in (pk_phd, pv_phd, sk_bshd, sv_bshd))
    if _cpu_check:  # CPU-interpreter check only: its wgmma cannot read a transposed ref
        pk_phd = jnp.transpose(pk_phd, (1, 2, 0))       # [Hkv, D, P]
        sk_bshd = jnp.transpose(sk_bshd, (0, 2, 3, 1))  # [B, Hkv, D, S]
    m_blocks = m // 128
    n_tiles = p // block_kv
    splits = (pm.choose_splits(p // 128, hkv * m_blocks) if num_splits is None
              else int(num_splits))
    if splits < 1 or n_tiles % splits:
        raise ValueError(f"num_splits={splits} must divide the {n_tiles} prefix tiles")
    t_pre = n_tiles // splits                      # prefix tiles per split
    seqs = 64 // group                             # sequences per warpgroup (64 rows)
    n_seq = -(-seqs // splits)                     # of them, per split
    s_tiles = s_cap // bs
    t_suf = 2 * n_seq * s_tiles                    # suffix steps: the warpgroups alternate
    n_steps = max(t_pre, t_suf)
    stages = max(1, min(steps, n_steps))
    scale_log2 = float(scale) * _LOG2E

    def kernel(plen_ref, slen_ref, q_ref, pk_ref, pv_ref, sk_ref, sv_ref, o_ref, lse_ref,
               q_smem2, q_barriers, sched_barrier, *maybe_p):
        h, mb, sp = lax.axis_index("h"), lax.axis_index("m"), lax.axis_index("s")
        wg = lax.axis_index("wg")
        n_keys = plen_ref[0]
        first_tile = sp * t_pre
        r0 = mb * 128 + wg * 64
        turn = functools.partial(pm.take_turn, sched_barrier, schedule_barrier)
        compute_context = pm.wg_compute_context(
            q_src=q_ref.at[h, pl.ds(r0, 64)], q_smem=q_smem2.at[wg], q_barrier=q_barriers.at[wg],
            lse_smem=None, o_dst=o_ref.at[sp, h, pl.ds(r0, 64)],
            lse_dst=lse_ref.at[sp, h, pl.ds(r0, 64)], block_q=64, d=d, dtype=dtype,
            before=lambda: pl.when(wg == 1)(turn))
        p_pre, p_suf = (maybe_p[0].at[wg], maybe_p[1].at[wg]) if _cpu_check else (None, None)

        def suffix_slot(t):
            """(owner warpgroup, local sequence, clamped global sequence, its valid keys, tile)
            of step ``t`` (clamped to the last suffix step): steps alternate between the
            warpgroups; each walks its split's sequences, each sequence tile by tile."""
            t = jnp.minimum(t, t_suf - 1)
            w, u = t % 2, t // 2
            i = sp * n_seq + u // s_tiles
            g_seq = mb * 2 * seqs + w * seqs + i
            real = (i < seqs) & (g_seq < b)
            bc = jnp.minimum(g_seq, b - 1)
            n = jnp.where(real, slen_ref[bc], 0)
            return w, i, bc, n, u % s_tiles

        def pre_body(t, pk_s, pv_s, pk_done, pv_done, carry):
            acc, m_new, l_i = pm.prefix_tile_step(
                carry, q_smem=q_smem2.at[wg], k_smem=pk_s, v_smem=pv_s, p_smem=p_pre,
                k_consumed=pk_done, v_consumed=pv_done,
                first_key=lambda: (first_tile + t) * block_kv, n_keys=n_keys, turn=turn,
                schedule_barrier=schedule_barrier, scale_log2=scale_log2, cpu_check=_cpu_check)
            # Warpgroup 0's closing turn right after the last prefix tile (not after the
            # pipeline, as in the prefix kernel): warpgroup 1 waits on it there, and the
            # suffix steps that follow need both warpgroups to release their tiles.
            pl.when((wg == 0) & (t == t_pre - 1))(turn)
            return acc, m_new, l_i

        def tile_body(indices, pk_s, pv_s, sk_s, sv_s, pk_done, pv_done, sk_done, sv_done, carry):
            t = indices[0]

            def skip_pre(c):
                plgpu.barrier_arrive(pk_done)
                plgpu.barrier_arrive(pv_done)
                return c
            carry = lax.cond(t < t_pre, lambda c: pre_body(t, pk_s, pv_s, pk_done, pv_done, c),
                             skip_pre, carry)
            w, i, _, n, tile = suffix_slot(t)
            key0 = tile * bs
            part = functools.partial(sd.suffix_step, q_smem=q_smem2.at[wg], k_smem=sk_s,
                                     v_smem=sv_s, k_done=None, v_done=None, seq=i, n=n,
                                     key0=key0, group=group, block_s=bs, scale_log2=scale_log2,
                                     dtype=dtype, p_smem=p_suf, cpu_check=_cpu_check)
            carry = lax.cond((wg == w) & (t < t_suf) & (key0 < n), lambda c: part(carry=c),
                             lambda c: c, carry)
            plgpu.barrier_arrive(sk_done)
            plgpu.barrier_arrive(sv_done)
            return carry

        def pre_spec(transposed):
            def index_map(t):
                tile = first_tile + jnp.minimum(t, t_pre - 1)
                return (0, tile) if transposed else (tile, 0)
            shape = (d, block_kv) if transposed else (block_kv, d)
            return plgpu.BlockSpec(block_shape=shape, index_map=index_map)

        def suf_spec(transposed):
            def index_map(t):
                _, _, bc, n, tile = suffix_slot(t)
                tile = jnp.minimum(tile, sd.last_tile(n, bs))
                return (bc, 0, tile) if transposed else (bc, tile, 0)
            shape = (None, d, bs) if transposed else (None, bs, d)
            return plgpu.BlockSpec(block_shape=shape, index_map=index_map)

        pipeline = pm.wg_pipeline(
            tile_body, n_steps=n_steps, steps=stages, compute_context=compute_context,
            in_specs=[pre_spec(_cpu_check), pre_spec(False), suf_spec(_cpu_check),
                      suf_spec(False)])
        pipeline(pk_ref.at[h] if _cpu_check else pk_ref.at[:, h, :], pv_ref.at[:, h, :],
                 sk_ref.at[:, h] if _cpu_check else sk_ref.at[:, :, h, :], sv_ref.at[:, :, h, :])

    return plgpu.kernel(
        kernel,
        grid=(hkv, m_blocks, splits),
        grid_names=("h", "m", "s"),
        num_threads=3,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((splits, hkv, m, d), dtype),
                  jax.ShapeDtypeStruct((splits, hkv, m), jnp.float32)),
        scratch_types=(plgpu.SMEM((2, 64, d), dtype),
                       plgpu.Barrier(num_barriers=2),
                       plgpu.Barrier(num_arrivals=2))
                      + ((plgpu.SMEM((2, 64, block_kv), dtype), plgpu.SMEM((2, 64, bs), dtype))
                         if _cpu_check else ()),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": pm._gpu_interpret_params()} if interpret else {}),
    )(jnp.asarray(p_len, jnp.int32).reshape(1), jnp.asarray(s_len, jnp.int32).reshape(b), q_hmd,
      pk_phd, pv_phd, sk_bshd, sv_bshd)
