"""Inter-sequence batched prefix attention through Pallas Mosaic GPU (Hopper: TMA, wgmma,
warp specialisation): the compute-bound part of the shared path when decoding with one prefix.

Why: the prefix matmul dominates the shared path at large batch, and this kernel runs it at
a higher tensor-core rate than the Triton-lowered prefix kernel
(:mod:`pallas_kernels.prefix_attention`); the ping-pong schedule barrier shortens the whole
shared path (measurements: ``docs/performance.md``, "Kernel design measurements").

Scope (static conditions, :func:`mgpu_supported`): one prefix shared by all rows, every row
sees the same number of keys ``length`` (true for decoding, ``Tq == 1``), 16-bit inputs,
``head_dim`` 64 or 128, ``P % block_kv == 0``, rows ``M % (2 * block_q) == 0``.

Layouts: ``q [Hkv, M, D]`` (rows of kv head ``h``), ``k/v [P, Hkv, D]``, ``length [1]`` int32
(keys ``>= length`` are masked; dynamic, read in the kernel; the masked keys' values must be
finite: the last tile is read whole and its masked scores give weight 0, and 0 times a NaN or
an infinity in ``v`` is NaN -- the Triton kernels do not load masked keys; zeroing those ``V``
rows in shared memory, as the suffix kernels do, makes Mosaic GPU's layout inference of the
role-split kernel several times slower).  Outputs the same
partial states as ``prefix_partials`` except that ``o [splits, Hkv, M, D]`` (normalised) is in
q's 16-bit dtype (written through the queries' shared-memory buffer: a float32 staging buffer
does not fit next to the K/V pipeline), and ``lse [splits, Hkv, M]`` float32, natural log,
``-inf`` (and ``o = 0``) where a split sees no key.

Several prefixes (``block_group``): ``k/v [G, P, Hkv, D]``, ``length [G]``, and
``block_group [M / (2 * block_q)]`` int32 naming the prefix of each CTA's ``2 * block_q`` rows
(the caller places each group's rows in blocks of their own): a CTA reads its group's keys
``[0, length[g])``.

Kernel: grid ``(Hkv, M / (2 * block_q), splits)``; three warpgroups per CTA: two compute
warpgroups of ``block_q`` rows each and one memory warpgroup streaming the split's K/V tiles
through shared memory (``emit_pipeline_warp_specialized``).  Per tile: ``S = Q K^T`` (wgmma,
float32 accumulator), online softmax in base 2 with the scale folded in (``p = exp2(s * c -
m)``, one fused multiply-add per score; the length mask is built only on a tile that holds a
masked key), ``O += P V`` (wgmma with ``P`` from registers).  A two-arrival barrier makes the
compute warpgroups alternate, so one's matrix products overlap the other's softmax
(FlashAttention-3's ping-pong schedule).  Two pipeline stages by default: at D = 128 a third
fits only with the LSE stored from registers (``max_concurrent_steps=3``), exact but not faster
(``docs/performance.md``, "Kernel design measurements").  ``persistent_ctas=n`` launches
``n`` CTAs that loop over the tasks (round robin), so the kernel holds at most ``n`` SMs.

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter; it lacks two operand
forms, which ``_cpu_check=True`` swaps (K pre-transposed in memory for ``Q K^T``; ``P`` staged
through shared memory and ``P V`` into a fresh accumulator instead of in place).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, partial_state_types
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["prefix_partials_mgpu", "mgpu_supported", "head_refs"]

# K/V pipeline stages (``max_concurrent_steps``) when the caller does not say; at D = 128 a
# third stage fits only with the LSE stored from registers (see ``prefix_partials_mgpu``).
PIPELINE_STAGES = 2


def mgpu_supported(*, rows: int, prefix_len: int, head_dim: int, dtype, block_q: int = 64,
                   block_kv: int = 128) -> str | None:
    """``None`` when the kernel handles these static shapes, else the reason."""
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not available"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if head_dim not in (64, 128):
        return f"head_dim must be 64 or 128, got {head_dim}"
    if prefix_len % block_kv:
        return f"prefix length {prefix_len} must be a multiple of block_kv={block_kv}"
    if rows % (2 * block_q):
        return f"rows {rows} must be a multiple of 2 * block_q = {2 * block_q}"
    return None


def check_decode_operands(q_hmd, pk_phd, pv_phd, sk_bshd, sv_bshd, group: int, *,
                          prefix: bool = True) -> None:
    """Shape checks shared by the one-launch decode kernels: ``q_hmd [Hkv, M, D]`` rows a
    multiple of 128 covering ``B * group``; prefix ``k/v [P, Hkv, D]`` (unless ``prefix`` is
    False); suffix ``k/v [B, S, Hkv, D]``.  Raises ``ValueError`` naming the operand."""
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    if m % 128 or m < b * group:
        raise ValueError(f"q rows {m} must be a multiple of 128 covering {b} x {group} rows")
    if prefix and (pk_phd.shape != (p, hkv, d) or pv_phd.shape != pk_phd.shape):
        raise ValueError(f"prefix k/v must have shape {(p, hkv, d)}, got {pk_phd.shape} and "
                         f"{pv_phd.shape}")
    if sk_bshd.shape != (b, s_cap, hkv, d) or sv_bshd.shape != sk_bshd.shape:
        raise ValueError(f"suffix k/v must have shape {(b, s_cap, hkv, d)}, got "
                         f"{sk_bshd.shape} and {sv_bshd.shape}")


def decode_operands(pk_phd, pv_phd, sk_bshd, sv_bshd, dtype, *, cpu_check: bool):
    """The one-launch decode kernels' K/V operands in ``dtype``; for Mosaic GPU's CPU
    interpreter (``cpu_check``), whose wgmma cannot read a transposed ref, the keys transposed
    to ``pk [Hkv, D, P]`` and ``sk [B, Hkv, D, S]``."""
    pk_phd, pv_phd, sk_bshd, sv_bshd = (x.astype(dtype) for x in (pk_phd, pv_phd, sk_bshd, sv_bshd))
    if cpu_check:
        pk_phd = jnp.transpose(pk_phd, (1, 2, 0))
        sk_bshd = jnp.transpose(sk_bshd, (0, 2, 3, 1))
    return pk_phd, pv_phd, sk_bshd, sv_bshd


def prefix_partials_mgpu(q_hmd: jax.Array, k_phd: jax.Array, v_phd: jax.Array, length: jax.Array, *,
                         scale: float, num_splits: int = 1, block_q: int = 64,
                         block_kv: int = 128, max_concurrent_steps: int | None = None,
                         schedule_barrier: bool = True, out_rows: int | None = None,
                         persistent_ctas: int | None = None, block_group: jax.Array | None = None,
                         interpret: bool = False, _cpu_check: bool = False):
    """Partial states of every row over the prefix keys ``[0, length)``, split along the prefix.

    ``num_splits``: prefix splits, one CTA each, of ``ceil(n_tiles / num_splits)`` of the
    ``n_tiles = P / block_kv`` key tiles each (every split must get at least one).
    Returns ``(o, lse)``: ``o [splits, Hkv, M, D]`` in q's dtype (normalised) and
    ``lse [splits, Hkv, M]`` float32; see the module docstring for the layouts and the
    conditions (:func:`mgpu_supported`).  ``interpret`` runs Mosaic GPU's CPU interpreter and
    needs ``_cpu_check`` (the operand forms it supports; tests only).

    Raises ``ValueError`` for unsupported shapes or ``out_rows < M``.

    ``schedule_barrier``: the two compute warpgroups take turns on the tensor cores (one issues
    its ``Q K^T`` / ``P V`` while the other runs its softmax; FlashAttention-3's "ping-pong"
    scheduling, through one two-arrival barrier).  ``out_rows``: rows of ``o``/``lse`` to
    allocate (``>= M``, rounded up to a multiple of 16); rows ``>= M`` are left unwritten, for a
    consumer that reads whole tiles past the last real row and discards them (the suffix pass),
    instead of computing a padding row block.  ``persistent_ctas``: launch that many CTAs, each
    looping over the ``Hkv * M / (2 * block_q) * splits`` tasks (round robin), instead of one CTA
    per task: the kernel then holds at most that many SMs, and the rest are free for a kernel
    running beside it.  ``block_group``: int32 ``[M / (2 * block_q)]``, the prefix of each row
    block, with ``k/v [G, P, Hkv, D]`` and ``length [G]`` (module docstring); None: one prefix.
    """
    hkv, m, d = q_hmd.shape
    grouped = block_group is not None
    p = k_phd.shape[-3]
    m_out = m if out_rows is None else -(-int(out_rows) // 16) * 16  # (TMA tiling of the rows)
    if m_out < m:
        raise ValueError(f"out_rows={out_rows} must be at least the {m} query rows")
    why = mgpu_supported(rows=m, prefix_len=p, head_dim=d, dtype=q_hmd.dtype, block_q=block_q,
                         block_kv=block_kv)
    if why is not None:
        raise ValueError(f"prefix_partials_mgpu cannot run these shapes: {why}")
    want = (k_phd.shape[0], p, hkv, d) if grouped else (p, hkv, d)
    if k_phd.shape != want or v_phd.shape != k_phd.shape:
        raise ValueError(f"k/v must have shape {want}, got {k_phd.shape} and {v_phd.shape}")
    dtype = q_hmd.dtype
    k_phd = k_phd.astype(dtype)
    v_phd = v_phd.astype(dtype)
    if _cpu_check:  # CPU-interpreter check only: its wgmma cannot read a transposed ref
        k_phd = jnp.transpose(k_phd, (0, 2, 3, 1) if grouped else (1, 2, 0))  # [(G,) Hkv, D, P]
    n_tiles = p // block_kv
    m_blocks = m // (2 * block_q)
    if grouped and tuple(block_group.shape) != (m_blocks,):
        raise ValueError(f"block_group must have shape {(m_blocks,)} (one entry per "
                         f"{2 * block_q}-row block), got {tuple(block_group.shape)}")
    splits = int(num_splits)
    tiles_per_split = -(-n_tiles // max(splits, 1))
    if not 1 <= splits <= n_tiles or (splits - 1) * tiles_per_split >= n_tiles:
        raise ValueError(f"num_splits={splits} must leave every split some of the {n_tiles} key tiles "
                         f"(each takes {tiles_per_split})")
    stages = PIPELINE_STAGES if max_concurrent_steps is None else int(max_concurrent_steps)
    steps = max(1, min(stages, tiles_per_split))
    # The LSE goes through a [2, block_q] shared buffer and TMA with up to 2 stages; with more it
    # is stored from registers (the 512 bytes are what a third stage lacks at D = 128).
    lse_in_smem = steps <= 2
    scale_log2 = float(scale) * LOG2E

    n_tasks = hkv * m_blocks * splits
    if persistent_ctas is not None and not 1 <= int(persistent_ctas) <= n_tasks:
        raise ValueError(f"persistent_ctas={persistent_ctas} must be in [1, {n_tasks}] (the tasks)")

    def kernel(len_ref, *refs):
        grp_ref, refs = (refs[0], refs[1:]) if grouped else (None, refs)
        q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem2, *rest = refs
        lse_smem2, q_barriers, sched_barrier, *maybe_p = rest if lse_in_smem else (None, *rest)
        common = dict(n_tiles=n_tiles, q_ref=q_ref, o_ref=o_ref,
                      lse_ref=lse_ref, q_smem2=q_smem2, lse_smem2=lse_smem2, q_barriers=q_barriers,
                      sched_barrier=sched_barrier, p_smem2=maybe_p[0] if _cpu_check else None,
                      tiles_per_split=tiles_per_split, steps=steps, block_q=block_q,
                      block_kv=block_kv, scale_log2=scale_log2, schedule_barrier=schedule_barrier,
                      cpu_check=_cpu_check)
        if grouped:
            def task(*, h, mb, sp, allocations=None):
                g = grp_ref[mb]
                prefix_task(h=h, mb=mb, sp=sp, n_keys=jnp.minimum(len_ref[g], p),
                            k_ref=k_ref.at[g], v_ref=v_ref.at[g], allocations=allocations,
                            **common)
        else:
            task = functools.partial(prefix_task, n_keys=jnp.minimum(len_ref[0], p), k_ref=k_ref,
                                     v_ref=v_ref, **common)
        if persistent_ctas is None:
            task(h=lax.axis_index("h"), mb=lax.axis_index("m"), sp=lax.axis_index("s"))
            return
        # Persistent: CTA c runs tasks c, c + n, c + 2n, ... (split fastest, then row block,
        # then kv head) through one set of pipeline buffers and barriers.
        allocs = prefix_pipeline(None, None, first_tile=0, tiles_per_split=tiles_per_split,
                                 n_tiles=n_tiles, steps=steps, d=d, block_kv=block_kv,
                                 cpu_check=_cpu_check).get_allocations(
                                     *head_refs(k_ref.at[0] if grouped else k_ref,
                                                v_ref.at[0] if grouped else v_ref, 0, _cpu_check))

        def scope(**pipeline_allocs):
            @plgpu.nd_loop((n_tasks,), collective_axes="c")
            def _tasks(info):
                (t,) = info.index
                task(h=t // (m_blocks * splits), mb=(t // splits) % m_blocks, sp=t % splits,
                     allocations=pipeline_allocs)
        pl.run_scoped(scope, **allocs, collective_axes="wg")

    grid, names = (((hkv, m_blocks, splits), ("h", "m", "s")) if persistent_ctas is None
                   else ((int(persistent_ctas),), ("c",)))
    o, lse = plgpu.kernel(
        kernel,
        grid=grid,
        grid_names=names,
        num_threads=3,
        thread_name="wg",
        out_type=partial_state_types(splits, hkv, m_out, d, dtype),
        scratch_types=(plgpu.SMEM((2, block_q, d), dtype),)
                      + ((plgpu.SMEM((2, block_q), jnp.float32),) if lse_in_smem else ())
                      + (plgpu.Barrier(num_barriers=2),
                       plgpu.Barrier(num_arrivals=2))
                      + ((plgpu.SMEM((2, block_q, block_kv), dtype),) if _cpu_check else ()),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(jnp.asarray(length, jnp.int32).reshape(k_phd.shape[0] if grouped else 1),
      *((jnp.asarray(block_group, jnp.int32),) if grouped else ()), q_hmd, k_phd, v_phd)
    return o, lse


# ----------------------------------------------------------------------------- kernel pieces
# Shared by this module's kernel and the one-launch kernels (``shared_decode_mgpu``,
# ``joint_decode_mgpu``, ``split_decode_mgpu``); all run inside a Mosaic GPU kernel with
# warpgroup semantics.

def take_turn(sched_barrier, enabled: bool):
    """Both compute warpgroups arrive on the two-arrival ``sched_barrier``, then wait (the
    ping-pong schedule; nothing when not ``enabled``)."""
    if enabled:
        plgpu.barrier_arrive(sched_barrier)
        plgpu.barrier_wait(sched_barrier)


def wg_scores(q_smem, k_smem, *, shape, cpu_check: bool, after_issue=None):
    """``S = Q K^T`` as float32 ``shape = (rows, keys)`` on the tensor cores: ``q_smem [rows, D]``,
    ``k_smem [keys, D]`` (``[D, keys]`` pre-transposed with ``cpu_check``).  ``after_issue`` runs
    between issuing the product and reading it (the ping-pong turn)."""
    def scores(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem if cpu_check else k_smem.transpose((1, 0)))
        if after_issue is not None:
            after_issue()
        return s_ref[...]
    return pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))


def softmax_step(s, valid, carry, *, scale_log2: float, dtype):
    """One online-softmax step in base 2 over the raw score tile ``s [rows, keys]`` float32
    (the scale is applied here), entries where ``valid`` is false excluded; ``valid=None``
    means every entry is a real key (the fast form: no select, no guard for rows that have
    seen no key).  ``carry = (acc [rows, D], m [rows], l [rows])`` with ``m`` the running max
    of the scaled base-2 scores, so ``p = exp2(s * scale_log2 - m)`` is one fused multiply-add
    per score.  Returns ``(acc rescaled, m_new, l_new, p)`` with ``p`` the probabilities in
    ``dtype`` (rows that have seen no key keep ``m = -inf``, ``l = 0``, ``acc = 0``)."""
    acc, m_i, l_i = carry
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
    m_use = m_new if valid is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet
    alpha = jnp.exp2(m_i - m_use)
    prob = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_new = l_i * alpha + prob.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_new, l_new, prob.astype(dtype)


def masked_softmax_step(s, valid_fn, any_masked, carry, *, scale_log2: float, dtype):
    """:func:`softmax_step` that builds and applies the mask only where the tile has a masked
    entry (``any_masked``, a dynamic scalar bool; a uniform branch): ``valid_fn()`` gives the
    ``[rows, keys]`` mask.  Full tiles, all but the last tile of a prefix, take the fast form."""
    return lax.cond(
        any_masked,
        lambda s, c: softmax_step(s, valid_fn(), c, scale_log2=scale_log2, dtype=dtype),
        lambda s, c: softmax_step(s, None, c, scale_log2=scale_log2, dtype=dtype),
        s, carry)


def wgmma_iota(shape, dim, hint: bool = True):
    """An int32 iota in the wgmma register layout (a layout hint: without it Mosaic GPU's layout
    inference can run out of search fuel; the CPU interpreter has no layout casts:
    ``hint=False``)."""
    if not hint:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def wg_accumulate(acc, operands, *, cpu_check: bool):
    """``acc + a @ b`` on the tensor cores, ``(a, b) = operands()``: in place in the accumulator,
    or with ``cpu_check`` into a fresh accumulator then added (Mosaic GPU's CPU interpreter has
    no in-place one).  ``operands`` is called inside the product's scope: a shared-memory ref
    indexed outside it would become an input of that scope, which Mosaic GPU cannot lower."""
    if cpu_check:
        def fresh(ref):
            plgpu.wgmma(ref, *operands())
            return ref[...]
        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def in_place(acc_ref):
        plgpu.wgmma(acc_ref, *operands())
    return pl.run_state(in_place)(plgpu.ACC.init(acc))


def wg_accumulate_pv(acc, p16, v_smem, p_smem, *, cpu_check: bool):
    """``acc + P V`` on the tensor cores (``P`` from registers; with ``cpu_check`` staged through
    ``p_smem`` into a fresh accumulator, the operand forms Mosaic GPU's CPU interpreter has)."""
    if cpu_check:
        p_smem[...] = p16
        plgpu.commit_smem()
        return wg_accumulate(acc, lambda: (p_smem, v_smem), cpu_check=True)
    return wg_accumulate(acc, lambda: (p16, v_smem), cpu_check=False)


def prefix_tile_step(carry, *, q_smem, k_smem, v_smem, p_smem, k_consumed, v_consumed, first_key,
                     n_keys, turn, schedule_barrier: bool, scale_log2: float, cpu_check: bool):
    """One prefix key tile for one compute warpgroup, as every kernel here runs it: ``S = Q K^T``
    (``turn`` between issuing and reading it), ``k_consumed`` arrived on, the online softmax
    with keys ``>= n_keys`` masked (``first_key()`` gives the tile's first key), then (after the
    ping-pong ``turn`` when ``schedule_barrier``)
    ``O += P V`` and ``v_consumed`` arrived on.  ``q_smem [rows, D]``, ``k_smem/v_smem
    [keys, D]`` (``k_smem [D, keys]`` with ``cpu_check``); ``carry = (acc, m, l)`` as
    :func:`softmax_step`.  Used by the prefix kernel and the one-pass kernel.  Returns the new
    carry."""
    rows, keys = q_smem.shape[0], k_smem.shape[-1] if cpu_check else k_smem.shape[0]
    s = wg_scores(q_smem, k_smem, shape=(rows, keys), cpu_check=cpu_check, after_issue=turn)
    plgpu.barrier_arrive(k_consumed)
    key0 = first_key()
    acc, m_new, l_i, p16 = masked_softmax_step(
        s, lambda: key0 + lax.broadcasted_iota(jnp.int32, (rows, keys), 1) < n_keys,
        key0 + keys > n_keys, carry, scale_log2=scale_log2, dtype=q_smem.dtype)
    if schedule_barrier:  # softmax done: wait for the tensor cores' turn
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        turn()
    acc = wg_accumulate_pv(acc, p16, v_smem, p_smem, cpu_check=cpu_check)
    plgpu.barrier_arrive(v_consumed)
    return acc, m_new, l_i


def wg_compute_context(*, q_src, q_smem, q_barrier, lse_smem, o_dst, lse_dst, block_q, d, dtype,
                       before=None, after=None):
    """A ``compute_context`` for ``emit_pipeline_warp_specialized``: load this warpgroup's
    ``block_q`` query rows from ``q_src`` into ``q_smem``, run the pipeline from the empty state
    (``before`` / ``after`` around it), then write the normalised output (through ``q_smem``) to
    ``o_dst [block_q, D]`` and the natural-log LSE (``-inf`` for rows that saw no key) to
    ``lse_dst [block_q]``: through ``lse_smem [block_q]`` by TMA, or, with ``lse_smem=None``,
    stored from registers straight to global memory (no shared buffer: the one-pass kernel
    needs those bytes for its tiles)."""
    def compute_context(run_pipeline):
        plgpu.copy_gmem_to_smem(q_src, q_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        carry = (jnp.zeros((block_q, d), jnp.float32),
                 jnp.full((block_q,), -jnp.inf, jnp.float32),
                 jnp.zeros((block_q,), jnp.float32))
        if before is not None:
            before()
        acc, m_i, l_i = run_pipeline(carry)
        if after is not None:
            after()
        empty = l_i == 0.0   # (a NaN score leaves l NaN: the row's lse is NaN, not -inf)
        l_safe = jnp.where(empty, 1.0, l_i)
        q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, (block_q, d), [0])).astype(dtype)
        lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        if lse_smem is None:
            lse_dst[...] = lse
        else:
            lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_dst)
        if lse_smem is not None:
            plgpu.copy_smem_to_gmem(lse_smem, lse_dst)
        plgpu.wait_smem_to_gmem(0)
    return compute_context


def wg_pipeline(tile_body, *, n_steps, steps, compute_context, in_specs):
    """The K/V pipeline both kernels use: two compute warpgroups (axis ``"wg"``) consuming
    ``n_steps`` steps of ``in_specs`` tiles, ``steps`` of them in flight, fed by one memory
    warpgroup; consumed barriers arrived on by the body itself; carries through
    ``compute_context``."""
    return plgpu.emit_pipeline_warp_specialized(
        tile_body, grid=(n_steps,), max_concurrent_steps=steps, num_compute_wgs=2,
        memory_registers=40, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute_context, in_specs=in_specs, out_specs=[])


def prefix_task(*, h, mb, sp, n_keys, n_tiles, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem2, lse_smem2,
                q_barriers, sched_barrier, p_smem2, tiles_per_split, steps, block_q, block_kv,
                scale_log2, schedule_barrier, cpu_check, allocations=None):
    """One CTA of the prefix kernel: rows ``[mb * 2 * block_q, +2 * block_q)`` of kv head ``h``
    (one ``block_q``-row block per compute warpgroup) against key tiles
    ``[sp * tiles_per_split, +tiles_per_split)`` of the prefix (keys ``>= n_keys`` masked; steps
    past the last of the ``n_tiles`` tiles re-read it and mask all of its keys, so
    ``tiles_per_split`` need not divide ``n_tiles``; ``n_keys <= n_tiles * block_kv``),
    partial state written to split ``sp`` of ``o_ref [splits, Hkv, M, D]`` / ``lse_ref``.
    ``k_ref/v_ref [P, Hkv, D]`` (``k_ref [Hkv, D, P]`` with ``cpu_check``).  ``allocations``: the
    pipeline's shared-memory buffers and barriers allocated once by the caller
    (:func:`prefix_pipeline`'s ``get_allocations``), so a persistent CTA can run several tasks."""
    wg = lax.axis_index("wg")
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
    first_tile = sp * tiles_per_split
    r0 = mb * (2 * block_q) + wg * block_q
    turn = functools.partial(take_turn, sched_barrier, schedule_barrier)
    # Warpgroup 1 starts one phase behind (one extra turn before its first tile, warpgroup 0
    # one after its last): their tensor-core and softmax phases alternate.
    compute_context = wg_compute_context(
        q_src=q_ref.at[h, pl.ds(r0, block_q)], q_smem=q_smem2.at[wg], q_barrier=q_barriers.at[wg],
        lse_smem=None if lse_smem2 is None else lse_smem2.at[wg],
        o_dst=o_ref.at[sp, h, pl.ds(r0, block_q)],
        lse_dst=lse_ref.at[sp, h, pl.ds(r0, block_q)], block_q=block_q, d=d, dtype=dtype,
        before=lambda: pl.when(wg == 1)(turn), after=lambda: pl.when(wg == 0)(turn))

    def tile_body(indices, k_smem, v_smem, k_consumed, v_consumed, carry):
        return prefix_tile_step(
            carry, q_smem=q_smem2.at[wg], k_smem=k_smem, v_smem=v_smem,
            p_smem=None if p_smem2 is None else p_smem2.at[wg], k_consumed=k_consumed,
            v_consumed=v_consumed, first_key=lambda: (first_tile + indices[0]) * block_kv,
            n_keys=n_keys, turn=turn, schedule_barrier=schedule_barrier, scale_log2=scale_log2,
            cpu_check=cpu_check)

    pipeline = prefix_pipeline(tile_body, compute_context, first_tile=first_tile,
                               tiles_per_split=tiles_per_split, n_tiles=n_tiles, steps=steps, d=d,
                               block_kv=block_kv, cpu_check=cpu_check)
    pipeline(*head_refs(k_ref, v_ref, h, cpu_check), allocations=allocations)


def head_refs(k_ref, v_ref, h, cpu_check: bool):
    """kv head ``h``'s ``K`` and ``V`` refs as the prefix pipeline reads them."""
    return (k_ref.at[h] if cpu_check else k_ref.at[:, h, :]), v_ref.at[:, h, :]


def prefix_pipeline(tile_body, compute_context, *, first_tile, tiles_per_split, n_tiles, steps, d,
                    block_kv, cpu_check):
    """The prefix task's K/V pipeline over ``tiles_per_split`` tiles from ``first_tile``; a step
    past the last of the ``n_tiles`` tiles loads the last one again (the caller masks its keys)."""
    def tile(t):
        return jnp.minimum(first_tile + t, n_tiles - 1)
    return wg_pipeline(
        tile_body, n_steps=tiles_per_split, steps=steps, compute_context=compute_context,
        in_specs=[plgpu.BlockSpec(block_shape=(d, block_kv), index_map=lambda t: (0, tile(t)))
                  if cpu_check else
                  plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (tile(t), 0)),
                  plgpu.BlockSpec(block_shape=(block_kv, d), index_map=lambda t: (tile(t), 0))])
