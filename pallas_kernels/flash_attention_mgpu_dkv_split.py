"""The dK/dV kernel of the Mosaic GPU flash attention backward for wide heads, its accumulators'
columns split between the two compute warpgroups (the ``split_dkv_columns`` tile of
:func:`pallas_kernels.flash_attention_mgpu_bwd.flash_attention_mgpu_bwd`, which launches it),
and the pieces the backward's kernels share: the streamed-tile schedule of a dK/dV CTA
(:class:`DkvSchedule`, :func:`dkv_slots`), its probabilities (:func:`dkv_probs`), the paired
products (:func:`accumulate_and_score`) and the warp-specialised pipeline (:func:`bwd_pipeline`).

Why: a dK/dV warpgroup of the default kernel holds ``dK`` and ``dV`` of its keys in registers,
two float32 ``[64, D]`` accumulators: 256 registers per thread at ``D = 256`` before any score,
so that kernel spills.  Here both compute warpgroups own the same ``block_kv_dkv`` keys and
warpgroup ``w`` accumulates the columns ``cols_w = [w D/2, (w+1) D/2)`` of ``dK`` and ``dV``:
``2 x [64, D/2]`` float32, 128 registers per thread at ``D = 256``, next to ``S^T``/``P^T`` and
``dP^T`` (32 each at 64 x 64) within the 232 that a compute thread of two gets beside a
40-register memory warpgroup.

Per streamed tile (the query rows of :class:`DkvSchedule`, as in the default kernel) each
warpgroup computes the full ``S^T = K Q^T`` and ``dP^T = V dO^T`` (their contraction runs over
all of ``D``: both warpgroups issue the same products on the same data and get the same ``P^T``
and ``dS^T``), then ``dV_w += P^T dO[:, cols_w]`` (issued with ``dP^T``) and ``dK_w += dS^T
Q[:, cols_w]``, the column halves read through slices of the streamed tiles' shared-memory refs.
In units of one ``[block_kv, block_q] x D`` product a warpgroup runs ``1 + 1 + 1/2 + 1/2 = 3``
per tile, the pair 6 against the default kernel's 4 (the score products duplicated); in
exchange each warpgroup's accumulators take half the registers, and the CTA's ``K``/``V`` tiles
are loaded once for both.  The two
warpgroups take no ping-pong turns (the default kernel has none either): they issue their
products at about the same time and share the tensor cores.

``K`` and ``V`` are loaded once per CTA (by warpgroup 0, one barrier both wait on); at the end
both warpgroups meet on a two-arrival barrier (neither still reads ``K``/``V``), each writes its
columns of ``dK`` (scaled) and ``dV`` into those of the ``K``/``V`` buffers, they meet again and
warpgroup 0 stores the buffers by TMA (a TMA copy needs a contiguous shared-memory tile, which a
column half is not).  Shared memory: ``K``, ``V`` once, the streamed ring as in the default
kernel (and in interpret mode the pre-transposed copies and each warpgroup's staged
``P^T``/``dS^T``).  Needs ``D >= 128``: column halves of at least 64 elements, the 128-byte
swizzle span of 16-bit tiles.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LOG2E, cdiv
from pallas_kernels.mgpu_compat import plgpu
from pallas_kernels.prefix_attention_mgpu import take_turn, wg_accumulate, wg_scores, wgmma_iota

__all__ = ["dkv_split_kernel", "DkvSchedule", "dkv_slots", "dkv_probs", "accumulate_and_score",
           "arrive", "transposed", "bwd_pipeline"]


def arrive(barriers) -> None:
    """Arrive on each of ``barriers`` (the consumed barriers of pipeline slots)."""
    for bar in barriers:
        plgpu.barrier_arrive(bar)


def transposed(b, pre_t: bool):
    """``b`` (pre-transposed in memory with ``pre_t``) or its transposed shared-memory view."""
    return b if pre_t else b.transpose((1, 0))


def accumulate_and_score(acc, p16, p_smem, operands, *, shape, cpu_check: bool, pre_t: bool):
    """``(acc + p16 @ b, a @ c^T)`` with ``(b, a, c) = operands()`` (called inside the products'
    scope: a shared-memory ref indexed outside it would become an input of that scope; ``c``
    pre-transposed with ``pre_t``), both issued before either is read: ``acc`` in place with
    ``p16`` from registers, or with ``cpu_check`` ``p16`` staged through ``p_smem`` into fresh
    accumulators (the forms Mosaic GPU's CPU interpreter has)."""
    if cpu_check:
        p_smem[...] = p16
        plgpu.commit_smem()

        def fresh(r0, r1):
            b, a, c = operands()
            plgpu.wgmma(r0, p_smem, b)
            plgpu.wgmma(r1, a, transposed(c, pre_t))
            return r0[...], r1[...]
        more, score = pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32),
                                    plgpu.ACC(shape, jnp.float32))
        return acc + more, score

    def in_place(refs):
        acc_ref, s_ref = refs
        b, a, c = operands()
        plgpu.wgmma(acc_ref, p16, b)
        plgpu.wgmma(s_ref, a, transposed(c, False))
    return pl.run_state(in_place)((plgpu.ACC.init(acc),
                                   plgpu.ACC.init(jnp.zeros(shape, jnp.float32))))


def bwd_pipeline(body, *, n_steps, stages, wgs, context, specs):
    """``n_steps`` streamed tiles of ``specs``, ``stages`` in flight, fed by one memory warpgroup
    to ``wgs`` compute warpgroups (axis ``"wg"``) that arrive on the consumed barriers
    themselves; the carry runs through ``context``."""
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(n_steps,), max_concurrent_steps=stages, num_compute_wgs=wgs,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=context, in_specs=specs, out_specs=[])


class DkvSchedule:
    """The streamed tiles of a dK/dV CTA whose keys start at ``k0`` (query heads ``h * group +
    [0, group)`` of kv head ``h``; ``static = (causal, tq, group, scale, block_q, block_kv)``):
    step ``t`` is query block :meth:`qblock` of head :meth:`head`, over the query blocks that
    some key in ``[k0, length)`` sees (causal: from the diagonal on); ``n_steps`` of them."""

    def __init__(self, k0, length, h, static):
        self.causal, self.tq, self.group, _, self.block_q, _ = static
        self.h, self.diag = h, length - self.tq        # query t sees keys j <= t + diag
        self.n_q = cdiv(self.tq, self.block_q)
        self.lo = self.first_block(k0)
        per_head = jnp.where(k0 < length, self.n_q - self.lo, 0)
        self.div = jnp.maximum(per_head, 1)
        self.n_steps = self.group * per_head

    def first_block(self, key):
        """The first query block with a row that sees ``key``."""
        if not self.causal:
            return jnp.int32(0)
        return jnp.minimum(jnp.maximum(key - self.diag, 0) // self.block_q, self.n_q)

    def head(self, t):
        return self.h * self.group + lax.div(t, self.div)

    def qblock(self, t):
        return self.lo + lax.rem(t, self.div)

    def specs(self, d: int, pre_t: bool):
        """Block specs of the streams ``q, do`` (``[Tqp, Hq, D]``; with ``pre_t`` also ``qT,
        doT [Hq, D, Tqp]``), ``lse, delta [Hq, Tqp]``."""
        rows = plgpu.BlockSpec(block_shape=(self.block_q, None, d),
                               index_map=lambda t: (self.qblock(t), self.head(t), 0))
        stat = plgpu.BlockSpec(block_shape=(None, self.block_q),
                               index_map=lambda t: (self.head(t), self.qblock(t)))
        specs = [rows, rows]
        if pre_t:
            specs += [plgpu.BlockSpec(block_shape=(None, d, self.block_q),
                                      index_map=lambda t: (self.head(t), 0, self.qblock(t)))] * 2
        return specs + [stat, stat]


def dkv_slots(smem, consumed, pre_t: bool):
    """The streamed tiles of one step, ``(q, do, qT, doT, lse, delta)`` (``qT, doT`` are ``q,
    do`` without ``pre_t``), and the consumed barriers ``(of dO, lse and delta; of Q)``: ``Q`` is
    read last."""
    if pre_t:
        q_t, do_t, qT_t, doT_t, lse_t, delta_t = smem
        q_like = (True, False, True, False, False, False)
    else:
        q_t, do_t, lse_t, delta_t = smem
        qT_t, doT_t = q_t, do_t
        q_like = (True, False, False, False)
    first = [c for c, x in zip(consumed, q_like) if not x]
    last = [c for c, x in zip(consumed, q_like) if x]
    return (q_t, do_t, qT_t, doT_t, lse_t, delta_t), (first, last)


def dkv_probs(k_smem, qT_t, lse_t, *, key0, qb, length, static, cpu_check: bool, pre_t: bool):
    """``P^T [block_kv, block_q]`` float32 of the keys ``key0 + [0, block_kv)`` (``k_smem``)
    against the rows of query block ``qb`` (``qT_t``, ``lse_t``): ``S^T = K Q^T`` on the tensor
    cores, ``exp2(S^T scale log2(e) - lse log2(e))``, the mask applied only on tiles that have a
    masked entry (a uniform branch)."""
    causal, tq, _, scale, block_q, block_kv = static
    diag = length - tq
    shape = (block_kv, block_q)
    st = wg_scores(k_smem, qT_t, shape=shape, cpu_check=pre_t)
    p = jnp.exp2(st * (scale * LOG2E) - lax.broadcast_in_dim(lse_t[...] * LOG2E, shape, [1]))

    def masked(p):
        key = key0 + wgmma_iota(shape, 0, hint=not cpu_check)
        ok = key < length
        if causal:
            ok = ok & (key <= qb * block_q + wgmma_iota(shape, 1, hint=not cpu_check) + diag)
        return jnp.where(ok, p, 0.0)
    any_masked = key0 + block_kv > length
    if causal:
        any_masked = any_masked | (key0 + block_kv - 1 > qb * block_q + diag)
    return lax.cond(any_masked, masked, lambda p: p, p)


def dkv_split_kernel(len_ref, k_ref, v_ref, *rest, static, stages, cpu_check, pre_t):
    """One CTA (grid ``(Hkv, B, key blocks of block_kv)``, two compute warpgroups): ``k/v [B, Tkp,
    Hkv, D]`` (resident); streamed ``q/do [B, Tqp, Hq, D]`` (interpreter: and ``qT/doT [B, Hq, D,
    Tqp]``), ``lse/delta [B, Hq, Tqp]``; outputs ``dk/dv`` as ``k``; scratch ``K``, ``V`` tiles
    ``[block_kv, D]``, the two-arrival load barrier, the two-arrival end barrier (and in
    interpret mode the staged products ``[2, block_kv, block_q]``).  ``static = (causal, tq,
    group, scale, block_q, block_kv)``."""
    n_in = 6 if pre_t else 4
    streams, (dk_ref, dv_ref, k_smem, v_smem, loaded, done, *maybe_p) = rest[:n_in], rest[n_in:]
    scale, block_q, block_kv = static[3], static[4], static[5]
    h, bb, nb = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("n")
    wg = lax.axis_index("wg")
    length = len_ref[bb]
    d = k_ref.shape[-1]
    half = d // 2
    k0 = nb * block_kv
    sched = DkvSchedule(k0, length, h, static)
    keys = pl.ds(k0, block_kv)
    cols = pl.ds(pl.multiple_of(wg * half, half), half)   # the warpgroup's columns

    def context(run_pipeline):
        @pl.when(wg == 0)
        def _load():
            plgpu.copy_gmem_to_smem(k_ref.at[bb, keys, h], k_smem, loaded)
            plgpu.copy_gmem_to_smem(v_ref.at[bb, keys, h], v_smem, loaded)
        plgpu.barrier_wait(loaded)
        zeros = jnp.zeros((block_kv, half), jnp.float32)
        dk, dv = run_pipeline((zeros, zeros))
        take_turn(done, True)   # neither warpgroup reads K or V any more
        k_smem.at[:, cols][...] = (dk * scale).astype(k_smem.dtype)
        v_smem.at[:, cols][...] = dv.astype(v_smem.dtype)
        plgpu.commit_smem()
        take_turn(done, True)   # both halves written

        @pl.when(wg == 0)
        def _store():
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[bb, keys, h])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[bb, keys, h])
            plgpu.wait_smem_to_gmem(0)

    def body(indices, *args):
        (q_t, do_t, qT_t, doT_t, lse_t, delta_t), (first, last) = dkv_slots(
            args[:n_in], args[n_in:2 * n_in], pre_t)
        carry = args[-1]
        qb = sched.qblock(indices[0])
        p_smem = maybe_p[0].at[wg] if cpu_check else None
        shape = (block_kv, block_q)
        dk, dv = carry   # (every step's query block sees some of these keys: none to skip)
        p = dkv_probs(k_smem, qT_t, lse_t, key0=k0, qb=qb, length=length, static=static,
                      cpu_check=cpu_check, pre_t=pre_t)
        dv, dpt = accumulate_and_score(dv, p.astype(k_smem.dtype), p_smem,
                                       lambda: (do_t.at[:, cols], v_smem, doT_t),
                                       shape=shape, cpu_check=cpu_check, pre_t=pre_t)
        ds16 = (p * (dpt - lax.broadcast_in_dim(delta_t[...], shape, [1]))).astype(k_smem.dtype)
        arrive(first)
        if cpu_check:   # (the interpreter's wgmma reads both operands from shared memory)
            p_smem[...] = ds16
            plgpu.commit_smem()
        dk = wg_accumulate(dk, lambda: (p_smem if cpu_check else ds16, q_t.at[:, cols]),
                           cpu_check=cpu_check)
        arrive(last)
        return dk, dv

    bwd_pipeline(body, n_steps=sched.n_steps, stages=stages, wgs=2, context=context,
                 specs=sched.specs(d, pre_t))(*(r.at[bb] for r in streams))
