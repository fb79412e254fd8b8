"""Shared-prefix decode attention with the SMs split by role in ONE launch (Pallas Mosaic GPU).

For decoding (one query per sequence, one prefix shared by all ``B`` sequences, GQA group
``G = Hq / Hkv``) the shared path has a tensor-core-bound part (every sequence's queries against
the prefix, batched: ``prefix_attention_mgpu``) and an HBM-bound part (each sequence against its
own suffix).  Run one after the other, where the two take about as long the time is near their
sum.  This kernel runs them *at the same time on different SMs*: its first ``prefix_ctas`` CTAs
are persistent prefix workers (the prefix kernel's task -- two ping-pong compute warpgroups and
a memory warpgroup -- looped over ``Hkv x row blocks x splits`` tasks, round robin), the other
``stream_ctas`` CTAs stream the suffixes (three compute warpgroups, each a worker over
``(row block, kv head)`` tasks with the swapped products of :mod:`suffix_stream_mgpu`).  Each
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
from pallas_kernels import suffix_stream_mgpu as ss
from pallas_kernels._common import LOG2E, partial_state_types
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["split_decode_partials_mgpu", "split_supported", "stream_smem_limit", "STREAM_WGS"]

STREAM_WGS = 3          # stream workers per CTA (the prefix role's three warpgroups)


def stream_smem_limit(smem_bytes: int, wgs: int = STREAM_WGS) -> int:
    """Bytes of the stream role's buffers that fit in ``smem_bytes`` of shared memory per CTA,
    less the workers' reduction scratch and room for barriers."""
    return smem_bytes - 1024 - max(2, wgs) * ss.red_bytes(wgs)


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
    block_q, block_kv, bs, wgs = 64, 128, ss.BLOCK_S, int(stream_wgs)
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
    spt = cols // g
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
    s_tasks = n_blk * hkv
    workers = wgs * n_str
    if not 1 <= n_str or workers > wgs * s_tasks:
        raise ValueError(f"stream_ctas={stream_ctas} must be in [1, {s_tasks}] (the suffix tasks)")
    s_rounds = -(-s_tasks // workers)
    s_tiles = s_cap // bs
    per_task = spt * s_tiles
    n_steps = s_rounds * per_task
    isz = jnp.dtype(dtype).itemsize
    red = ss.red_bytes(wgs)
    smem_limit = stream_smem_limit(smem_bytes, wgs)

    def fits(st):
        return ss.stream_smem_bytes(st, ss.n_q_buffers(st, per_task), cols, d, isz, wgs,
                                    bs) <= smem_limit
    if stream_stages is None:
        stream_stages = max([st for st in (1, 2, 3, 4) if fits(st)], default=0)
    st = int(stream_stages)
    if not 1 <= st <= 4 or not fits(st):
        raise ValueError(f"stream_stages={stream_stages} must be in [1, 4] and fit in shared memory")
    n_q = ss.n_q_buffers(st, per_task)

    cpu = bool(interpret)
    scale_log2 = float(scale) * LOG2E
    geo = ss.StreamGeometry(b=b, s_cap=s_cap, hkv=hkv, d=d, cols=cols, spt=spt, s_tiles=s_tiles,
                            per_task=per_task, workers=workers, n_blk=n_blk, bs=bs,
                            log2_g=g.bit_length() - 1, scale_log2=scale_log2, dtype=dtype,
                            cpu=cpu)
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
            cs = c - n_pre

            def read_len(seq):
                return jnp.where(seq < b, slen_ref[jnp.minimum(seq, b - 1)], 0)

            def body(k_smem, v_smem, q_smem, p_smem, k_bar, v_bar, q_bar):
                def worker_code(w: int):
                    worker = wgs * cs + w

                    def issue(u, n_prev):
                        """Start step ``u``'s loads (and, at a task's first step, its queries)
                        into slot ``u % stages``; returns the length of its sequence: read from
                        memory at the sequence's first step, whose tile 0 needs no length (so
                        the read's latency is hidden until the value is used, a step or more
                        later), carried (``n_prev``, step ``u - 1``'s) otherwise."""
                        _, h, blk, _, seq, bc, t = ss.stream_step_geometry(worker, u, geo)
                        if s_tiles > 1:
                            n, tile = lax.cond(
                                t == 0, lambda: (read_len(seq), jnp.int32(0)),
                                lambda: (n_prev, jnp.minimum(t, ss.last_tile(n_prev, geo))))
                        else:
                            n, tile = read_len(seq), jnp.int32(0)
                        ss.stream_issue_loads(
                            u, w=w, i=w * st + lax.rem(u, st), h=h, blk=blk, bc=bc, tile=tile,
                            n_q=n_q, q_ref=qs_ref, k_ref=sk_ref, v_ref=sv_ref, q_smem=q_smem,
                            k_smem=k_smem, v_smem=v_smem, q_bar=q_bar, k_bar=k_bar, v_bar=v_bar,
                            geo=geo)
                        return n

                    # the lengths of the steps in flight (u .. u + stages - 1), as issued
                    ring, n_iss = [], jnp.int32(0)
                    for u0 in range(min(st, n_steps)):   # the pipeline's first steps
                        n_iss = issue(jnp.int32(u0), n_iss)
                        ring.append(n_iss)
                    ring += [jnp.int32(0)] * (st - len(ring))

                    def step(u, carry):
                        ring, state = carry
                        n = ring[0]
                        task, _, _, j, _, _, t = ss.stream_step_geometry(worker, u, geo)
                        key0 = t * bs
                        i = w * st + lax.rem(u, st)
                        iq = w * n_q + lax.rem(lax.div(u, per_task), n_q)

                        @pl.when(lax.rem(u, per_task) == 0)
                        def _():
                            plgpu.barrier_wait(q_bar.at[iq])
                        plgpu.barrier_wait(k_bar.at[i])
                        plgpu.barrier_wait(v_bar.at[i])
                        k_tile, v_tile, q_tile = k_smem.at[i], v_smem.at[i], q_smem.at[iq]

                        def attend(*state):
                            return ss.stream_attend(
                                state, k_tile=k_tile, v_tile=v_tile, q_tile=q_tile,
                                p_tile=lambda: p_smem.at[w], key0=key0, n=n, j=j, geo=geo,
                                before_max=lambda: None, after_max=lambda: None)
                        state = lax.cond(key0 < n, attend, lambda *s: s, *state)
                        # slot i is consumed (both products waited on): refill it
                        nxt = u + st
                        n_new = lax.cond(nxt < n_steps, lambda: issue(nxt, ring[-1]),
                                         lambda: ring[-1])

                        def finish(*state):
                            ss.stream_finish(state, o_dst=o_st_ref.at[task],
                                             lse_dst=lse_st_ref.at[task], o_stage=None, geo=geo,
                                             before_sum=lambda: None, after_sum=lambda: None)
                            return ss.stream_fresh(geo)
                        state = lax.cond(lax.rem(u, per_task) == per_task - 1, finish,
                                         lambda *s: s, *state)
                        return tuple(ring[1:]) + (n_new,), state

                    lax.fori_loop(0, n_steps, step, (tuple(ring), ss.stream_fresh(geo)))

                # Worker w's code is traced inside w nested collective allocations of one
                # reduction scratch's size, so the workers' cross-warp reduction scratch lies at
                # different offsets (see suffix_stream_mgpu: one shared area races).
                def place(w):
                    if w < wgs - 1:
                        pl.run_scoped(lambda _pad: place(w + 1),
                                      plgpu.SMEM((red // 4,), jnp.float32), collective_axes="wg")
                    pl.when(wg == w)(functools.partial(worker_code, w))
                place(0)

            pl.run_scoped(
                body,
                plgpu.SMEM((wgs * st, bs, d), dtype),
                plgpu.SMEM((wgs * st,) + ((d, bs) if cpu else (bs, d)), dtype),
                plgpu.SMEM((wgs * n_q,) + ((d, cols) if cpu else (cols, d)), dtype),
                plgpu.SMEM((wgs, bs, cols), dtype),
                plgpu.Barrier(num_barriers=wgs * st),
                plgpu.Barrier(num_barriers=wgs * st),
                plgpu.Barrier(num_barriers=wgs * n_q),
                collective_axes="wg")

        # The stream role's code comes first in program order: the prefix role changes the
        # per-thread register limit (setmaxnreg: 232 for its compute warpgroups, 40 for its
        # memory warpgroup), and code after it runs much slower (ptxas appears to compile what
        # follows for the lowest limit; see the module docstring).
        pl.when(jnp.logical_not(is_pre))(stream_role)
        pl.when(is_pre)(prefix_role)

    n_out = s_rounds * workers
    o_pre, lse_pre, o_t, lse_t = plgpu.kernel(
        kernel,
        grid=(n_pre + n_str,),
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        out_type=(*partial_state_types(splits, hkv, m, d, dtype),
                  jax.ShapeDtypeStruct((n_out, d, cols), dtype),
                  jax.ShapeDtypeStruct((n_out, cols), jnp.float32)),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=red,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(jnp.asarray(p_len, jnp.int32).reshape(1), s_len, q_hmd, qs, pk_phd, pv_phd, sk_bshd,
      sv_bshd)
    # suffix task i = block i // Hkv of kv head i % Hkv -> the row layout [1, Hkv, B * G(, D)]
    o = o_t[:s_tasks].reshape(n_blk, hkv, d, cols)
    o = jnp.transpose(o, (1, 0, 3, 2)).reshape(hkv, n_blk * cols, d)[None, :, :b * g]
    lse = jnp.swapaxes(lse_t[:s_tasks].reshape(n_blk, hkv, cols), 0, 1).reshape(hkv, n_blk * cols)
    return (o_pre, lse_pre), (o, lse[None, :, :b * g])
