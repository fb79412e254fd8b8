"""Shared-prefix decode attention with the SMs split by role in ONE launch (Pallas Mosaic GPU).

For decoding (one query per sequence, one prefix shared by all ``B`` sequences, GQA group
``G = Hq / Hkv``) the shared path has a tensor-core-bound part (every sequence's queries against
the prefix, batched: ``prefix_attention_mgpu``) and an HBM-bound part (each sequence against its
own suffix).  Run one after the other, where the two take about as long the time is near their
sum.  This kernel runs them *at the same time on different SMs*: its first ``prefix_ctas`` CTAs
are persistent prefix workers (the prefix kernel's task -- two ping-pong compute warpgroups and
a memory warpgroup -- looped over ``Hkv x row blocks x splits`` tasks, round robin), the other
``stream_ctas`` CTAs stream the suffixes (three compute warpgroups, each a worker over
``(row block, kv head)`` tasks with the swapped products of :mod:`suffix_stream_mgpu`: the
stream role of :mod:`suffix_decode_mgpu`, which also launches it alone).  Each
stream CTA moves only a small share of the memory bandwidth (its workers are bound by their
steps' latency), so the split pays where the suffix is a modest share of the work
(measurements: ``docs/performance.md``, "Kernel design measurements", and ``SPLIT_REGIONS`` in
"Planner regions and tilings").

Both roles need three warpgroups, so one kernel holds them with no register conflict: the
prefix role keeps its 232/232/40 register split (set by its pipeline), and the stream role, which
has no memory warpgroup, has its workers issue their own TMA loads: after a step's products a
worker refills the slot it just consumed with the step ``stages`` ahead (so ``stages - 1`` steps
are in flight during each step's math).  Each role allocates its shared memory in its own scope
(the larger, the stream's, sets the kernel's footprint).  The stream workers' cross-warp
reductions use separate scratch (nested collective padding allocations).

Layouts: ``q_hmd [Hkv, M, D]`` (row ``b * G + j`` is query head ``h * G + j`` of sequence
``b``; ``M`` a multiple of 128 with zero rows past ``B G``: ``_common.rows_128``), prefix
``k/v [P, Hkv, D]`` (``P`` a multiple of 128), ``p_len [1]`` int32 (dynamic; keys past it
masked, their values must be finite), suffix ``k/v [B, S, Hkv, D]`` (``S`` a multiple of 64),
``s_len [B]`` int32 (dynamic, in ``[0, S]``; NaN past it never reaches the output).  Returns the
two sets of partial states in the row layout ``(o [n, Hkv, >= B G, D], lse [n, Hkv, >= B G])``:
prefix ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])`` and suffix ``(o [1, Hkv, B G, D], lse
[1, Hkv, B G])``, for the caller to merge (one XLA fusion).  ``interpret=True`` runs Mosaic
GPU's CPU interpreter (with the operand forms it has: ``K^T``, ``Q^T`` and ``V^T`` in memory,
``P`` staged through shared memory).

Static arguments: every shape, ``group``, ``prefix_ctas``, ``stream_ctas``, ``num_splits``,
``stages``, ``stream_stages``, ``schedule_barrier``, ``scale``; one compile per combination.

Code order matters: the stream role is traced *before* the prefix role.  The prefix role
changes the per-thread register limit (setmaxnreg); with its code first the launch took the sum
of the two roles' times instead of overlapping them (``docs/performance.md``, "Kernel
design measurements"), which fits ptxas compiling the code after it for the lowest limit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import suffix_decode_mgpu as sdm
from pallas_kernels import suffix_stream_mgpu as ss
from pallas_kernels.suffix_decode_mgpu import STREAM_WGS, stream_smem_limit
from pallas_kernels._common import LOG2E, partial_state_types
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["split_decode_partials_mgpu", "split_supported", "stream_smem_limit", "STREAM_WGS"]

def split_supported(*, batch: int, heads_q: int, heads_kv: int, prefix_len: int, suffix_cap: int,
                    head_dim: int, dtype, smem_bytes: int) -> str | None:
    """``None`` when :func:`split_decode_partials_mgpu` handles these static shapes (rows padded
    to 128 as ``_common.rows_128`` does) within ``smem_bytes`` of shared memory per CTA, else the
    reason."""
    if heads_kv < 1 or heads_q % heads_kv:
        return f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}"
    g = heads_q // heads_kv
    m128 = -(-batch * g // 128) * 128
    why = (pm.mgpu_supported(rows=m128, prefix_len=prefix_len, head_dim=head_dim, dtype=dtype)
           or ss.stream_supported(heads_q=heads_q, heads_kv=heads_kv, suffix_cap=suffix_cap,
                                  head_dim=head_dim, dtype=dtype))
    if why is not None:
        return why
    cols = ss.cols_for(g)
    per_task = cols // g * (suffix_cap // ss.BLOCK_S)
    if ss.stream_smem_bytes(1, ss.n_q_buffers(1, per_task), cols, head_dim,
                            jnp.dtype(dtype).itemsize, STREAM_WGS) > stream_smem_limit(smem_bytes):
        return "the stream role's buffers do not fit in shared memory"
    return None


def split_decode_partials_mgpu(q_hmd, pk_phd, pv_phd, p_len, sk_bshd, sv_bshd, s_len, *,
                               scale: float, group: int, prefix_ctas: int, stream_ctas: int,
                               num_splits: int, smem_bytes: int, stages: int | None = None,
                               stream_stages: int | None = None, schedule_barrier: bool = True,
                               stream_wgs: int = STREAM_WGS, interpret: bool = False):
    """The prefix and suffix partial states of every row in one launch of
    ``prefix_ctas + stream_ctas`` CTAs (see the module docstring for layouts and outputs).

    ``num_splits``: prefix splits (a divisor of the 128-key prefix tiles).  ``smem_bytes``:
    shared memory per CTA (232,448 on Hopper).  ``stages``: the prefix pipeline's stages (None:
    the prefix kernel's default).  ``stream_stages``: steps in flight per stream worker (None:
    the most, up to 4, that fit).  ``stream_wgs``: stream workers per CTA, 3 (default) or 2
    (the third warpgroup then idles in the stream CTAs; more stages fit).

    Raises ``ValueError`` for shapes either role cannot run or out-of-range counts."""
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    g = int(group)
    dtype = q_hmd.dtype
    n_pre, n_str = int(prefix_ctas), int(stream_ctas)
    block_q, block_kv, wgs = 64, 128, int(stream_wgs)
    if wgs not in (2, 3):
        raise ValueError(f"stream_wgs={stream_wgs} must be 2 or 3")
    why = (pm.mgpu_supported(rows=m, prefix_len=p, head_dim=d, dtype=dtype, block_q=block_q,
                             block_kv=block_kv)
           or ss.stream_supported(heads_q=hkv * g, heads_kv=hkv, suffix_cap=s_cap, head_dim=d,
                                  dtype=dtype))
    if why is not None:
        raise ValueError(f"split_decode_partials_mgpu cannot run these shapes: {why}")
    if pk_phd.shape != (p, hkv, d) or pv_phd.shape != pk_phd.shape:
        raise ValueError(f"prefix k/v must have shape {(p, hkv, d)}, got {pk_phd.shape} and "
                         f"{pv_phd.shape}")
    if sk_bshd.shape != (b, s_cap, hkv, d) or sv_bshd.shape != sk_bshd.shape:
        raise ValueError(f"suffix k/v must have shape {(b, s_cap, hkv, d)}, got "
                         f"{sk_bshd.shape} and {sv_bshd.shape}")
    cols = ss.cols_for(g)
    n_blk = -(-b * g // cols)
    if m < max(n_blk * cols, b * g):
        raise ValueError(f"q_hmd has {m} rows; needs at least {max(n_blk * cols, b * g)}")

    # ---- prefix role: the prefix kernel's tasks, round robin over the first n_pre CTAs
    n_tiles = p // block_kv
    m_blocks = m // (2 * block_q)
    splits = int(num_splits)
    if splits < 1 or n_tiles % splits:
        raise ValueError(f"num_splits={splits} must divide the {n_tiles} prefix key tiles")
    tiles_per_split = n_tiles // splits
    pre_tasks = hkv * m_blocks * splits
    if not 1 <= n_pre <= pre_tasks:
        raise ValueError(f"prefix_ctas={prefix_ctas} must be in [1, {pre_tasks}] (the prefix tasks)")
    pre_rounds = -(-pre_tasks // n_pre)
    steps = max(1, min(pm.PIPELINE_STAGES if stages is None else int(stages), tiles_per_split))
    lse_in_smem = steps <= 2

    # ---- stream role: STREAM_WGS self-issuing workers per CTA on the other n_str CTAs
    cpu = bool(interpret)
    launch = sdm.stream_launch(b=b, s_cap=s_cap, hkv=hkv, group=g, d=d, dtype=dtype,
                               stream_ctas=n_str, smem_bytes=smem_bytes, scale=scale,
                               stream_stages=stream_stages, wgs=wgs, cpu=cpu)
    scale_log2 = float(scale) * LOG2E
    pk_phd, pv_phd = pk_phd.astype(dtype), pv_phd.astype(dtype)
    sk_bshd, sv_bshd = sk_bshd.astype(dtype), sv_bshd.astype(dtype)
    qs = q_hmd
    if cpu:   # the interpreter's wgmma reads no transposed ref
        pk_phd = jnp.transpose(pk_phd, (1, 2, 0))        # [Hkv, D, P]
        qs = jnp.transpose(q_hmd, (0, 2, 1))             # [Hkv, D, M]
        sv_bshd = jnp.transpose(sv_bshd, (0, 2, 3, 1))   # [B, Hkv, D, S]
    s_len = jnp.asarray(s_len, jnp.int32).reshape(b)

    def kernel(plen_ref, slen_ref, q_ref, qs_ref, pk_ref, pv_ref, sk_ref, sv_ref, o_pre_ref,
               lse_pre_ref, o_st_ref, lse_st_ref):
        c = lax.axis_index("c")
        wg = lax.axis_index("wg")
        cp = c                                   # index among the prefix CTAs
        is_pre = c < n_pre

        # -------------------------------------------------------------- prefix CTAs
        def prefix_role():
            def body(q_smem2, *rest):
                lse_smem2, q_barriers, sched_barrier, *maybe_p = (rest if lse_in_smem
                                                                  else (None, *rest))
                task = functools.partial(
                    pm.prefix_task, n_keys=plen_ref[0], q_ref=q_ref, k_ref=pk_ref, v_ref=pv_ref,
                    o_ref=o_pre_ref, lse_ref=lse_pre_ref, q_smem2=q_smem2, lse_smem2=lse_smem2,
                    q_barriers=q_barriers, sched_barrier=sched_barrier,
                    p_smem2=maybe_p[0] if cpu else None, tiles_per_split=tiles_per_split, n_tiles=n_tiles,
                    steps=steps, block_q=block_q, block_kv=block_kv, scale_log2=scale_log2,
                    schedule_barrier=schedule_barrier, cpu_check=cpu)
                allocs = pm.prefix_pipeline(
                    None, None, first_tile=0, tiles_per_split=tiles_per_split, n_tiles=n_tiles, steps=steps, d=d,
                    block_kv=block_kv, cpu_check=cpu).get_allocations(
                        *pm.head_refs(pk_ref, pv_ref, 0, cpu))

                def scope(**pipeline_allocs):
                    def one_round(r, carry):
                        t = cp + r * n_pre     # split fastest, then row block, then kv head

                        @pl.when(t < pre_tasks)
                        def _():
                            task(h=t // (m_blocks * splits), mb=(t // splits) % m_blocks,
                                 sp=t % splits, allocations=pipeline_allocs)
                        return carry
                    lax.fori_loop(0, pre_rounds, one_round, None)
                pl.run_scoped(scope, **allocs, collective_axes="wg")

            pl.run_scoped(
                body, plgpu.SMEM((2, block_q, d), dtype),
                *((plgpu.SMEM((2, block_q), jnp.float32),) if lse_in_smem else ()),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=2),
                *((plgpu.SMEM((2, block_q, block_kv), dtype),) if cpu else ()),
                collective_axes="wg")

        # -------------------------------------------------------------- stream CTAs
        def stream_role():
            sdm.stream_role(c - n_pre, wg, launch, slen_ref=slen_ref, q_ref=qs_ref,
                            k_ref=sk_ref, v_ref=sv_ref, o_ref=o_st_ref, lse_ref=lse_st_ref)

        # The stream role's code comes first in program order: the prefix role changes the
        # per-thread register limit (setmaxnreg: 232 for its compute warpgroups, 40 for its
        # memory warpgroup), and code after it runs much slower (ptxas appears to compile what
        # follows for the lowest limit; see the module docstring).
        pl.when(jnp.logical_not(is_pre))(stream_role)
        pl.when(is_pre)(prefix_role)

    o_pre, lse_pre, o_t, lse_t = plgpu.kernel(
        kernel,
        grid=(n_pre + n_str,),
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        out_type=(*partial_state_types(splits, hkv, m, d, dtype),
                  jax.ShapeDtypeStruct((launch.n_out, d, cols), dtype),
                  jax.ShapeDtypeStruct((launch.n_out, cols), jnp.float32)),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             reduction_scratch_bytes=ss.red_bytes(wgs),
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(jnp.asarray(p_len, jnp.int32).reshape(1), s_len, q_hmd, qs, pk_phd, pv_phd, sk_bshd,
      sv_bshd)
    return (o_pre, lse_pre), sdm.stream_rows(o_t, lse_t, launch)
