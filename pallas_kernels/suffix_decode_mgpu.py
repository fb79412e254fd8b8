"""Decode attention over each sequence's own suffix, streamed by self-scheduled Mosaic GPU
warpgroups in one launch: the stream role of :mod:`pallas_kernels.split_decode_mgpu` on every
CTA.

For decoding (one query per sequence, GQA group ``G = Hq / Hkv``) each (sequence, kv head)
attends over its suffix keys ``[0, s_len[b])``: bound by HBM bandwidth, each suffix K/V byte read
once.  Each CTA holds ``wgs`` (2 or 3) workers, one per compute warpgroup; a worker walks
``(row block, kv head)`` tasks with the swapped products of :mod:`pallas_kernels.suffix_stream_mgpu`
and issues its own TMA loads: after a step's products it refills the slot it just consumed with
the step ``stages`` ahead (``stages - 1`` steps in flight during each step's math).  The
workers' cross-warp reductions use separate scratch (each worker's code is traced inside
nested collective padding allocations).

This module holds the role (:func:`stream_role`, with its static layout :func:`stream_launch`
and :func:`stream_rows`, which reorders its outputs) for the kernels that run it beside other
roles, and the launch that runs it alone (:func:`suffix_decode_partials_mgpu`).

Layouts: ``q_hmd [Hkv, M, D]`` (row ``b * G + j`` is query head ``h * G + j`` of sequence
``b``; ``M >= ceil(B G / cols) cols``, ``cols = max(16, G)``), suffix ``k/v [B, S, Hkv, D]``
(``S`` a multiple of 64), ``s_len [B]`` int32 (dynamic, in ``[0, S]``; NaN past it never
reaches the output).  With ``kv_rows [B]`` int32 sequence ``b`` reads row ``kv_rows[b]`` of
``k/v [R, S, Hkv, D]`` instead: several sequences stream one shared buffer, e.g. their prefix
group's (the flat decode's prefix pass).  The partial states come back in the row layout ``(o [1, Hkv, B G, D],
lse [1, Hkv, B G])`` (an empty sequence's rows: ``lse = -inf``, ``o = 0``) for the caller to
merge with other parts.  ``interpret=True`` runs Mosaic GPU's CPU interpreter (with ``Q^T`` and
``V^T`` in memory, ``P`` staged through shared memory).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import suffix_stream_mgpu as ss
from pallas_kernels._common import LOG2E
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["StreamLaunch", "stream_launch", "stream_role", "stream_rows", "stream_smem_limit",
           "suffix_decode_partials_mgpu", "suffix_decode_supported", "STREAM_WGS"]

STREAM_WGS = 3          # workers per CTA (three compute warpgroups)


def stream_smem_limit(smem_bytes: int, wgs: int = STREAM_WGS) -> int:
    """Bytes of the stream role's buffers that fit in ``smem_bytes`` of shared memory per CTA,
    less the workers' reduction scratch and room for barriers."""
    return smem_bytes - 1024 - max(2, wgs) * ss.red_bytes(wgs)


class StreamLaunch(NamedTuple):
    """Static layout of the stream role: its geometry, ``wgs`` workers per CTA, ``stages``
    steps in flight per worker, ``n_q`` query buffers per worker, ``n_steps`` steps per worker,
    ``s_tasks`` tasks, ``n_out`` output slots (``rounds x workers``)."""
    geo: ss.StreamGeometry
    wgs: int
    stages: int
    n_q: int
    n_steps: int
    s_tasks: int
    n_out: int


def stream_launch(*, b: int, s_cap: int, hkv: int, group: int, d: int, dtype, stream_ctas: int,
                  smem_bytes: int, scale: float, stream_stages: int | None, wgs: int,
                  cpu: bool) -> StreamLaunch:
    """The role's static layout on ``stream_ctas`` CTAs of ``wgs`` workers; ``stream_stages``
    None: the most (up to 4) that fit.  Raises ``ValueError`` for out-of-range counts."""
    g = int(group)
    cols = ss.cols_for(g)
    spt = cols // g
    n_blk = -(-b * g // cols)
    bs = ss.BLOCK_S
    s_tasks = n_blk * hkv
    workers = wgs * stream_ctas
    if not 1 <= stream_ctas or workers > wgs * s_tasks:
        raise ValueError(f"stream_ctas={stream_ctas} must be in [1, {s_tasks}] (the suffix tasks)")
    s_rounds = -(-s_tasks // workers)
    s_tiles = s_cap // bs
    per_task = spt * s_tiles
    n_steps = s_rounds * per_task
    isz = jnp.dtype(dtype).itemsize
    smem_limit = stream_smem_limit(smem_bytes, wgs)

    def fits(st):
        return ss.stream_smem_bytes(st, ss.n_q_buffers(st, per_task), cols, d, isz, wgs,
                                    bs) <= smem_limit
    if stream_stages is None:
        stream_stages = max([st for st in (1, 2, 3, 4) if fits(st)], default=0)
    st = int(stream_stages)
    if not 1 <= st <= 4 or not fits(st):
        raise ValueError(f"stream_stages={stream_stages} must be in [1, 4] and fit in shared memory")
    geo = ss.StreamGeometry(b=b, s_cap=s_cap, hkv=hkv, d=d, cols=cols, spt=spt, s_tiles=s_tiles,
                            per_task=per_task, workers=workers, n_blk=n_blk, bs=bs,
                            log2_g=g.bit_length() - 1, scale_log2=float(scale) * LOG2E,
                            dtype=dtype, cpu=cpu)
    return StreamLaunch(geo=geo, wgs=wgs, stages=st, n_q=ss.n_q_buffers(st, per_task),
                        n_steps=n_steps, s_tasks=s_tasks, n_out=s_rounds * workers)


def stream_role(cs, wg, launch: StreamLaunch, *, slen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                kv_rows_ref=None):
    """The code of stream CTA ``cs`` (its index among the stream CTAs) for warpgroup ``wg``:
    its workers' tasks into ``o_ref [n_out, D, cols]`` and ``lse_ref [n_out, cols]`` (task ``i``
    = row block ``i // Hkv`` of kv head ``i % Hkv``).  ``q_ref``: ``q_hmd`` (``Q^T [Hkv, D, M]``
    in the interpreter); ``k_ref``/``v_ref`` the suffix (``V^T [B, Hkv, D, S]`` there), row
    ``kv_rows_ref[b]`` of them for sequence ``b`` where given."""
    geo, wgs, st, n_q, n_steps = launch.geo, launch.wgs, launch.stages, launch.n_q, launch.n_steps
    b, s_tiles, per_task, bs, d, cols = geo.b, geo.s_tiles, geo.per_task, geo.bs, geo.d, geo.cols
    dtype, cpu, red = geo.dtype, geo.cpu, ss.red_bytes(wgs)

    def read_len(seq):
        return jnp.where(seq < b, slen_ref[jnp.minimum(seq, b - 1)], 0)

    def body(k_smem, v_smem, q_smem, p_smem, k_bar, v_bar, q_bar):
        def worker_code(w: int):
            worker = wgs * cs + w

            def issue(u, n_prev):
                """Start step ``u``'s loads (and, at a task's first step, its queries) into slot
                ``u % stages``; returns the length of its sequence: read from memory at the
                sequence's first step, whose tile 0 needs no length (so the read's latency is
                hidden until the value is used, a step or more later), carried (``n_prev``,
                step ``u - 1``'s) otherwise."""
                _, h, blk, _, seq, bc, t = ss.stream_step_geometry(worker, u, geo)
                if s_tiles > 1:
                    n, tile = lax.cond(
                        t == 0, lambda: (read_len(seq), jnp.int32(0)),
                        lambda: (n_prev, jnp.minimum(t, ss.last_tile(n_prev, geo))))
                else:
                    n, tile = read_len(seq), jnp.int32(0)
                if kv_rows_ref is not None:
                    bc = kv_rows_ref[bc]
                ss.stream_issue_loads(
                    u, w=w, i=w * st + lax.rem(u, st), h=h, blk=blk, bc=bc, tile=tile,
                    n_q=n_q, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, q_smem=q_smem,
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
                    ss.stream_finish(state, o_dst=o_ref.at[task], lse_dst=lse_ref.at[task],
                                     o_stage=None, geo=geo, before_sum=lambda: None,
                                     after_sum=lambda: None)
                    return ss.stream_fresh(geo)
                state = lax.cond(lax.rem(u, per_task) == per_task - 1, finish,
                                 lambda *s: s, *state)
                return tuple(ring[1:]) + (n_new,), state

            lax.fori_loop(0, n_steps, step, (tuple(ring), ss.stream_fresh(geo)))

        # Worker w's code is traced inside w nested collective allocations of one reduction
        # scratch's size, so the workers' cross-warp reduction scratch lies at different
        # offsets (see suffix_stream_mgpu: one shared area races).
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


def stream_rows(o_t, lse_t, launch: StreamLaunch):
    """The role's outputs ``o_t [n_out, D, cols]``, ``lse_t [n_out, cols]`` in the row layout
    ``(o [1, Hkv, B G, D], lse [1, Hkv, B G])``."""
    geo = launch.geo
    n_blk, hkv, d, cols = geo.n_blk, geo.hkv, geo.d, geo.cols
    bg = geo.b * (1 << geo.log2_g)
    o = o_t[:launch.s_tasks].reshape(n_blk, hkv, d, cols)
    o = jnp.transpose(o, (1, 0, 3, 2)).reshape(hkv, n_blk * cols, d)[None, :, :bg]
    lse = jnp.swapaxes(lse_t[:launch.s_tasks].reshape(n_blk, hkv, cols), 0, 1).reshape(
        hkv, n_blk * cols)
    return o, lse[None, :, :bg]


def suffix_decode_supported(*, batch: int, heads_q: int, heads_kv: int, suffix_cap: int,
                            head_dim: int, dtype, smem_bytes: int,
                            wgs: int = STREAM_WGS) -> str | None:
    """``None`` when :func:`suffix_decode_partials_mgpu` handles these static shapes within
    ``smem_bytes`` of shared memory per CTA, else the reason."""
    why = ss.stream_supported(heads_q=heads_q, heads_kv=heads_kv, suffix_cap=suffix_cap,
                              head_dim=head_dim, dtype=dtype)
    if why is not None:
        return why
    cols = ss.cols_for(heads_q // heads_kv)
    per_task = cols // (heads_q // heads_kv) * (suffix_cap // ss.BLOCK_S)
    if ss.stream_smem_bytes(1, ss.n_q_buffers(1, per_task), cols, head_dim,
                            jnp.dtype(dtype).itemsize, wgs) > stream_smem_limit(smem_bytes, wgs):
        return "the stream role's buffers do not fit in shared memory"
    return None


def suffix_decode_partials_mgpu(q_hmd, sk_bshd, sv_bshd, s_len, *, scale: float, group: int,
                                stream_ctas: int, smem_bytes: int,
                                stream_stages: int | None = None, stream_wgs: int = STREAM_WGS,
                                kv_rows: jax.Array | None = None, interpret: bool = False):
    """The suffix partial states of every row, ``(o [1, Hkv, B G, D], lse [1, Hkv, B G])``
    (layouts: the module docstring), in one launch of ``stream_ctas`` CTAs of ``stream_wgs``
    (2 or 3) workers.  ``stream_stages``: steps in flight per worker (None: the most, up to 4,
    that fit in ``smem_bytes``).  ``kv_rows [B]`` int32: the row of ``sk/sv [R, S, Hkv, D]``
    each sequence reads (in ``[0, R)``; None: its own, ``R = B``).  Raises ``ValueError`` for
    shapes it cannot run or out-of-range counts."""
    hkv, m, d = q_hmd.shape
    s_cap = sk_bshd.shape[1]
    b = int(jnp.size(s_len))                                   # sequences
    g = int(group)
    dtype = q_hmd.dtype
    wgs = int(stream_wgs)
    if wgs not in (2, 3):
        raise ValueError(f"stream_wgs={stream_wgs} must be 2 or 3")
    why = ss.stream_supported(heads_q=hkv * g, heads_kv=hkv, suffix_cap=s_cap, head_dim=d,
                              dtype=dtype)
    if why is not None:
        raise ValueError(f"suffix_decode_partials_mgpu cannot run these shapes: {why}")
    rows = sk_bshd.shape[0] if kv_rows is not None else b
    if sk_bshd.shape != (rows, s_cap, hkv, d) or sv_bshd.shape != sk_bshd.shape:
        raise ValueError(f"suffix k/v must have shape {(rows, s_cap, hkv, d)}, got "
                         f"{sk_bshd.shape} and {sv_bshd.shape}")
    if kv_rows is not None and tuple(kv_rows.shape) != (b,):
        raise ValueError(f"kv_rows must have shape ({b},), got {tuple(kv_rows.shape)}")
    cols = ss.cols_for(g)
    need = max(-(-b * g // cols) * cols, b * g)
    if m < need:
        raise ValueError(f"q_hmd has {m} rows; needs at least {need}")
    cpu = bool(interpret)
    launch = stream_launch(b=b, s_cap=s_cap, hkv=hkv, group=g, d=d, dtype=dtype,
                           stream_ctas=int(stream_ctas), smem_bytes=smem_bytes, scale=scale,
                           stream_stages=stream_stages, wgs=wgs, cpu=cpu)
    sk_bshd, sv_bshd = sk_bshd.astype(dtype), sv_bshd.astype(dtype)
    qs = q_hmd
    if cpu:   # the interpreter's wgmma reads no transposed ref
        qs = jnp.transpose(q_hmd, (0, 2, 1))             # [Hkv, D, M]
        sv_bshd = jnp.transpose(sv_bshd, (0, 2, 3, 1))   # [B, Hkv, D, S]
    s_len = jnp.asarray(s_len, jnp.int32).reshape(b)

    def kernel(slen_ref, *refs):
        rows_ref, refs = (refs[0], refs[1:]) if kv_rows is not None else (None, refs)
        qs_ref, sk_ref, sv_ref, o_ref, lse_ref = refs
        stream_role(lax.axis_index("c"), lax.axis_index("wg"), launch, slen_ref=slen_ref,
                    q_ref=qs_ref, k_ref=sk_ref, v_ref=sv_ref, o_ref=o_ref, lse_ref=lse_ref,
                    kv_rows_ref=rows_ref)

    o_t, lse_t = plgpu.kernel(
        kernel,
        grid=(int(stream_ctas),),
        grid_names=("c",),
        num_threads=wgs,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((launch.n_out, d, cols), dtype),
                  jax.ShapeDtypeStruct((launch.n_out, cols), jnp.float32)),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             reduction_scratch_bytes=ss.red_bytes(wgs),
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(s_len, *(() if kv_rows is None else (jnp.asarray(kv_rows, jnp.int32),)), qs, sk_bshd,
      sv_bshd)
    return stream_rows(o_t, lse_t, launch)
