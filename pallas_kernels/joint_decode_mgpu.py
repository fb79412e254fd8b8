"""One-pass shared-prefix decode through Pallas Mosaic GPU: every CTA streams its own rows'
suffix tiles through the *same* pipeline as the shared prefix tiles, into the *same* online
softmax state, so one SM's tensor cores work on prefix tiles while its memory warpgroup brings
suffix tiles from HBM.

Why: the shared path's two parts are each near their own roofline (the prefix kernel near the
matmul rate, the suffix kernel near the memory bandwidth) but run one after the other, while
the floor is the larger of the two (``docs/performance.md``, "Kernel design measurements").
An SM that holds a suffix-only task waits on memory with its tensor cores idle; here each step
of a CTA's pipeline brings one prefix tile (shared by the CTA's two compute warpgroups) and one
suffix tile for one of the warpgroups (they take turns); the suffix tile belongs to one sequence
of the warpgroup's 64 rows and counts only for that sequence's ``G`` rows (the others are
masked), so the suffix costs ``64 / G`` times its useful tensor-core work and no merge of
prefix and suffix states is needed at all: the state a CTA writes is the final attention of its
rows when the prefix is not split.  With short suffixes and prefixes of 1K-4K keys that costs
less than the second launch it saves; with long prefixes or suffixes the extra tensor-core work
does not (measured regions: ``docs/performance.md``, "Planner regions and tilings",
``JOINT_REGIONS``).

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
``u % (S / block_s)``).  Tiles past a sequence's length, and steps past a part's end, repeat
the last fetched tile (no new load) and are skipped or masked; ``V`` rows past a suffix length
are zeroed in shared memory before ``P V`` so that whatever the cache holds there (NaN
included) never reaches the output.  Keys of the prefix past ``p_len`` are masked in the
scores only: they must be finite (as for
:func:`pallas_kernels.prefix_attention_mgpu.prefix_partials_mgpu`).

Shared memory (:func:`joint_tiles`): at ``D = 128`` two stages of ``(2 * 128 + 2 * 64) * D``
bf16 plus the queries take 229,376 bytes, the barriers and alignment 2,664 more (measured from
the lowering); this fits Hopper's 232,448 bytes per CTA only because the LSE is stored from
registers straight to global memory.  Mosaic GPU's layout inference fails for tiles under 64
keys.

Interpret mode runs Mosaic GPU's CPU interpreter (with ``_cpu_check``: ``K`` pre-transposed in
memory, ``P`` staged through shared memory).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import shared_decode_mgpu as sd
from pallas_kernels._common import LOG2E, partial_state_types
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["joint_supported", "joint_decode_mgpu", "joint_tiles"]



def joint_tiles(head_dim: int, smem_bytes: int, itemsize: int = 2, steps: int = 2) -> tuple[int, int]:
    """``(block_kv, block_s)``: prefix and suffix tile keys, the largest in {128, 64} (prefix
    first) whose ``steps``-stage pipeline fits in ``smem_bytes`` of shared memory per CTA
    (232,448 on Hopper; Mosaic GPU's layout inference
    needs tiles of at least 64 keys).  ``(128, 64)`` at ``D = 128``, ``(128, 128)`` at 64."""
    q_bytes = 2 * 64 * head_dim * itemsize
    for bkv, bs in ((128, 128), (128, 64), (64, 64)):
        stage = 2 * (bkv + bs) * head_dim * itemsize
        if steps * stage + q_bytes + 3072 <= smem_bytes:  # (+ barriers, alignment: 2664 B measured)
            return bkv, bs
    return 64, 64


def joint_supported(*, batch: int, heads_q: int, heads_kv: int, prefix_len: int, suffix_cap: int,
                    head_dim: int, dtype, block_s: int) -> str | None:
    """``None`` when :func:`joint_decode_mgpu` handles these static shapes with suffix tiles of
    ``block_s`` keys (:func:`joint_tiles`), else the reason: the one-launch kernel's conditions
    (:func:`pallas_kernels.shared_decode_mgpu.fused_supported`, the same row layout and suffix
    tiles)."""
    return sd.fused_supported(batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                              prefix_len=prefix_len, suffix_cap=suffix_cap, head_dim=head_dim,
                              dtype=dtype, block_s=block_s)


def joint_decode_mgpu(q_hmd, pk_phd, pv_phd, p_len, sk_bshd, sv_bshd, s_len, *, scale: float,
                      group: int, block_kv: int, block_s: int, num_splits: int = 1,
                      steps: int = 2, schedule_barrier: bool = True,
                      interpret: bool = False, _cpu_check: bool = False):
    """Attention of every row over the prefix keys ``[0, p_len)`` and its own sequence's suffix
    keys ``[0, s_len[b])``, in one pass; see the module docstring for layouts and scope.

    Returns ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])``.  ``num_splits``: prefix splits.
    ``block_kv`` / ``block_s``: prefix / suffix tile keys (:func:`joint_tiles` gives the
    largest that fit).
    ``interpret`` runs Mosaic GPU's CPU interpreter and needs ``_cpu_check`` (tests only).

    Raises ``ValueError`` for shapes outside the scope or splits that do not divide the prefix
    tiles.
    """
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    dtype = q_hmd.dtype
    pm.check_decode_operands(q_hmd, pk_phd, pv_phd, sk_bshd, sv_bshd, group)
    block_kv = int(block_kv)
    bs = int(block_s)
    why = joint_supported(batch=b, heads_q=hkv * group, heads_kv=hkv, prefix_len=p,
                          suffix_cap=s_cap, head_dim=d, dtype=dtype, block_s=bs)
    if why is not None:
        raise ValueError(f"joint_decode_mgpu cannot run these shapes: {why}")
    if p % block_kv:
        raise ValueError(f"prefix length {p} must be a multiple of block_kv={block_kv}")
    pk_phd, pv_phd, sk_bshd, sv_bshd = pm.decode_operands(pk_phd, pv_phd, sk_bshd, sv_bshd, dtype,
                                                          cpu_check=_cpu_check)
    m_blocks = m // 128
    n_tiles = p // block_kv
    splits = int(num_splits)
    if splits < 1 or n_tiles % splits:
        raise ValueError(f"num_splits={splits} must divide the {n_tiles} prefix tiles")
    t_pre = n_tiles // splits                      # prefix tiles per split
    seqs = 64 // group                             # sequences per warpgroup (64 rows)
    n_seq = -(-seqs // splits)                     # of them, per split
    s_tiles = s_cap // bs
    t_suf = 2 * n_seq * s_tiles                    # suffix steps: the warpgroups alternate
    n_steps = max(t_pre, t_suf)
    stages = max(1, min(steps, n_steps))
    scale_log2 = float(scale) * LOG2E

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
        out_type=partial_state_types(splits, hkv, m, d, dtype),
        scratch_types=(plgpu.SMEM((2, 64, d), dtype),
                       plgpu.Barrier(num_barriers=2),
                       plgpu.Barrier(num_arrivals=2))
                      + ((plgpu.SMEM((2, 64, block_kv), dtype), plgpu.SMEM((2, 64, bs), dtype))
                         if _cpu_check else ()),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(jnp.asarray(p_len, jnp.int32).reshape(1), jnp.asarray(s_len, jnp.int32).reshape(b), q_hmd,
      pk_phd, pv_phd, sk_bshd, sv_bshd)
