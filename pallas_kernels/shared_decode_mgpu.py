"""One-launch shared-prefix decode through Pallas Mosaic GPU: the prefix partials and the
per-sequence suffix states computed by the CTAs of *one* kernel, so the compute-bound prefix
work (tensor cores) and the bandwidth-bound suffix work (HBM) run at the same time on
different SMs instead of one launch after the other.

Why: with two launches the shared path costs about ``t_prefix + t_suffix``, while its floor is
``max(bytes / bandwidth, flops / matmul rate)``.  Interleaving the two kinds of tasks in one
grid lets the suffix tasks stream while the prefix tasks compute (measured against two
launches: ``docs/performance.md``, "Kernel design measurements", and ``ONE_LAUNCH_REGIONS`` in
"Planner regions and tilings").

Scope (static, checked by :func:`fused_supported`): decoding (one query per sequence), one
prefix shared by every sequence (all see the same ``p_len`` keys), 16-bit inputs, ``head_dim``
64 or 128, ``G = Hq / Hkv`` a power of two dividing 64, ``P % 128 == 0``, suffix capacity
``S % block_s == 0``.

Layouts: ``q_hmd [Hkv, M, D]`` rows ``b * G + j`` (query head ``h * G + j`` of sequence ``b``,
``M`` a multiple of 128, rows ``>= B * G`` padding); prefix ``k/v [P, Hkv, D]``; suffix
``k/v [B, S, Hkv, D]`` with ``s_len [B]`` int32 valid keys (dynamic); ``p_len [1]`` int32.
Outputs: ``o_pre [splits, Hkv, M, D]`` / ``lse_pre [splits, Hkv, M]`` as
:func:`prefix_attention_mgpu.prefix_partials_mgpu`, and ``o_suf [suffix_splits, Hkv, M, D]`` /
``lse_suf`` the same for the suffix keys (normalised, q's dtype; LSE float32, natural log,
``-inf`` and ``o = 0`` where nothing was seen).  The caller merges the partial sets (one small
XLA fusion).

Kernel: one grid axis of tasks, suffix and prefix tasks alternating while both last
(:func:`task_order`); every CTA has two compute warpgroups of 64 rows and one memory
warpgroup (TMA pipeline):

* prefix task ``(h, 128-row block, split)``: ``prefix_attention_mgpu.prefix_task`` (both
  warpgroups share each 128-key tile; ping-pong schedule);
* suffix task ``(h, 128-row block, suffix split)``: warpgroup ``w``'s 64 rows are the ``64 / G``
  sequences ``b0 + w * 64 / G + i``; the pipeline walks those sequences one after another, each
  in ``block_s``-key tiles of its own suffix (one TMA box ``[block_s, D]`` per warpgroup and
  tensor per step), so a step's scores ``[64, block_s]`` count only for the ``G`` rows of the
  current sequence (the others are masked: they see an empty tile).  That spends ``64 / G``
  times the useful tensor-core work (16x at G = 4) to keep every load a whole TMA tile and
  every store a whole 64-row block; the suffix is bandwidth-bound, so the tensor cores have
  the room.  Tiles wholly past a sequence's length are not fetched again (the index map
  repeats its last tile, which is then masked) and the ``V`` rows past the length are zeroed
  in shared memory before ``P V``, so whatever the cache holds there (even NaN) never reaches
  the output.

Interpret mode runs Mosaic GPU's CPU interpreter (with ``_cpu_check``), which cannot trace two
pipelines in one kernel: there the prefix and the suffix tasks run as two launches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels._common import LOG2E, partial_state_types
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu

__all__ = ["fused_supported", "shared_decode_partials_mgpu", "task_order", "suffix_step",
           "last_tile"]



def fused_supported(*, batch: int, heads_q: int, heads_kv: int, prefix_len: int, suffix_cap: int,
                    head_dim: int, dtype, block_s: int = 64) -> str | None:
    """``None`` when the one-launch kernel handles these static shapes, else the reason."""
    g = heads_q // heads_kv
    if g < 1 or heads_q % heads_kv or g & (g - 1) or 64 % g:
        return f"query heads per kv head must be a power of two dividing 64, got {heads_q}/{heads_kv}"
    rows = -(-batch * g // 128) * 128
    why = pm.mgpu_supported(rows=rows, prefix_len=prefix_len, head_dim=head_dim, dtype=dtype)
    if why is not None:
        return why
    if suffix_cap % block_s or suffix_cap == 0:
        return f"suffix capacity {suffix_cap} must be a positive multiple of block_s={block_s}"
    return None


def task_order(t, n_pre: int, n_suf: int):
    """Map grid index ``t`` to ``(is_suffix, index among its kind)``: suffix and prefix tasks
    alternate while both last (a suffix task first), then the rest."""
    c = min(n_pre, n_suf)
    mixed = t < 2 * c
    is_suf = jnp.where(mixed, t % 2 == 0, n_suf > n_pre)
    return is_suf, jnp.where(mixed, t // 2, t - c)


def _suffix_lengths(len_ref, b, batch):
    """``(b clamped to a real sequence, its valid suffix keys; 0 for padding sequences)``."""
    return jnp.minimum(b, batch - 1), jnp.where(b < batch, len_ref[jnp.minimum(b, batch - 1)], 0)


def last_tile(n, block_s):
    """The last tile holding a valid key (0 when there is none): tiles past the length are
    fetched as this one again (an L2 hit), and masked."""
    return jnp.maximum((n + block_s - 1) // block_s - 1, 0)


def suffix_step(*, q_smem, k_smem, v_smem, k_done, v_done, carry, seq, n, key0, group,
                block_s, scale_log2, dtype, p_smem, cpu_check):
    """One suffix tile for one warpgroup: its 64 rows against ``k/v_smem [block_s, D]`` (keys
    ``key0 + j`` of local sequence ``seq``): only rows ``[seq * group, +group)`` and keys
    ``< n`` count; ``V`` rows past ``n`` are zeroed first (NaN-safe).  ``k_done`` / ``v_done``:
    the pipeline's consumed barriers, arrived on as soon as each tile is read (None: the caller
    arrives; also used by :mod:`pallas_kernels.joint_decode_mgpu`)."""
    d = v_smem.shape[-1]
    s = pm.wg_scores(q_smem, k_smem, shape=(64, block_s), cpu_check=cpu_check)
    if k_done is not None:
        plgpu.barrier_arrive(k_done)
    rows = lax.broadcasted_iota(jnp.int32, (64, block_s), 0)
    cols = lax.broadcasted_iota(jnp.int32, (64, block_s), 1)
    valid = (rows >= seq * group) & (rows < (seq + 1) * group) & (key0 + cols < n)

    @pl.when(key0 + block_s > n)
    def _zero_past_length():             # keep NaN / Inf past the length out of P V
        keys = lax.broadcasted_iota(jnp.int32, (block_s, d), 0)
        v_smem[...] = jnp.where(key0 + keys < n, v_smem[...], jnp.zeros_like(v_smem[...]))
        plgpu.commit_smem()
    acc, m_new, l_i, p16 = pm.softmax_step(s, valid, carry, scale_log2=scale_log2, dtype=dtype)
    acc = pm.wg_accumulate_pv(acc, p16, v_smem, p_smem, cpu_check=cpu_check)
    if v_done is not None:
        plgpu.barrier_arrive(v_done)
    return acc, m_new, l_i


def _suffix_task(*, h, mb, ss, q_ref, k_ref, v_ref, len_ref, o_ref, lse_ref, q_smem2, lse_smem2,
                 q_barriers, p_smem2, batch, group, block_s, tiles_per_split, steps, scale_log2,
                 cpu_check):
    """One suffix CTA of kv head ``h`` over the suffix tiles ``[ss * tiles_per_split,
    +tiles_per_split)`` of its sequences (see the module docstring): rows ``[mb * 128, +128)``,
    64 per warpgroup; each pipeline step brings a ``K``/``V`` tile for each warpgroup (4 TMA
    boxes); state written to split ``ss``."""
    wg = lax.axis_index("wg")
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
    seqs = 64 // group                                    # sequences per 64 rows
    first_tile = ss * tiles_per_split
    r0 = mb * 128 + wg * 64
    split = ss
    compute_context = pm.wg_compute_context(
        q_src=q_ref.at[h, pl.ds(r0, 64)], q_smem=q_smem2.at[wg], q_barrier=q_barriers.at[wg],
        lse_smem=lse_smem2.at[wg], o_dst=o_ref.at[split, h, pl.ds(r0, 64)],
        lse_dst=lse_ref.at[split, h, pl.ds(r0, 64)], block_q=64, d=d, dtype=dtype)
    step = functools.partial(suffix_step, group=group, block_s=block_s, scale_log2=scale_log2,
                             dtype=dtype, cpu_check=cpu_check)
    p_smem = None if p_smem2 is None else p_smem2.at[wg]

    def seq_tile(t, w):
        """(local sequence, clamped sequence, its valid keys, nominal tile) of step ``t``."""
        i, j = t // tiles_per_split, t % tiles_per_split
        b, n = _suffix_lengths(len_ref, mb * 2 * seqs + w * seqs + i, batch)
        return i, b, n, first_tile + j

    def spec(w, transposed):
        def index_map(t):
            _, b, n, tile = seq_tile(t, w)
            tile = jnp.minimum(tile, last_tile(n, block_s))
            return (b, 0, tile) if transposed else (b, tile, 0)
        shape = (None, d, block_s) if transposed else (None, block_s, d)
        return plgpu.BlockSpec(block_shape=shape, index_map=index_map)

    def tile_body(indices, k0, k1, v0, v1, k0_done, k1_done, v0_done, v1_done, carry):
        t = indices[0]

        @pl.when(wg == 0)                             # the other warpgroup's tiles
        def _():
            plgpu.barrier_arrive(k1_done)
            plgpu.barrier_arrive(v1_done)

        @pl.when(wg == 1)
        def _():
            plgpu.barrier_arrive(k0_done)
            plgpu.barrier_arrive(v0_done)
        i, _, n, tile = seq_tile(t, wg)
        kw = dict(q_smem=q_smem2.at[wg], carry=carry, seq=i, n=n, key0=tile * block_s,
                  p_smem=p_smem)
        return lax.cond(wg == 0,
                        lambda: step(k_smem=k0, v_smem=v0, k_done=k0_done, v_done=v0_done, **kw),
                        lambda: step(k_smem=k1, v_smem=v1, k_done=k1_done, v_done=v1_done, **kw))
    in_specs = [spec(0, cpu_check), spec(1, cpu_check), spec(0, False), spec(1, False)]

    pipeline = pm.wg_pipeline(tile_body, n_steps=seqs * tiles_per_split, steps=steps,
                              compute_context=compute_context, in_specs=in_specs)
    kh = k_ref.at[:, h] if cpu_check else k_ref.at[:, :, h, :]
    vh = v_ref.at[:, :, h, :]
    pipeline(kh, kh, vh, vh)


def shared_decode_partials_mgpu(q_hmd, pk_phd, pv_phd, p_len, sk_bshd, sv_bshd, s_len, *, scale,
                                group: int, num_splits: int = 1, suffix_splits: int = 1,
                                block_s: int = 64, prefix_steps: int = 2, suffix_steps: int = 2,
                                schedule_barrier: bool = True, tasks=("prefix", "suffix"),
                                interpret: bool = False, _cpu_check: bool = False):
    """Prefix partials and suffix states of every row in one Mosaic GPU launch.

    ``q_hmd [Hkv, M, D]`` (row ``b * group + j``), ``pk/pv [P, Hkv, D]``, ``p_len`` int32 scalar
    (prefix keys ``>= p_len`` masked), ``sk/sv [B, S, Hkv, D]``, ``s_len [B]`` int32.
    Returns ``(o_pre [splits, Hkv, M, D], lse_pre [splits, Hkv, M], o_suf [suffix_splits, Hkv,
    M, D], lse_suf [suffix_splits, Hkv, M])`` (module docstring).  ``num_splits``: prefix
    splits.  ``suffix_steps``: pipeline stages of the suffix tasks.
    ``tasks``: run only the ``"prefix"`` or the ``"suffix"`` tasks (the other outputs are left
    unwritten; for timing the two parts apart).  ``interpret`` runs Mosaic GPU's CPU
    interpreter and needs ``_cpu_check`` (tests only).

    Raises ``ValueError`` for shapes outside the kernel's scope or splits that do not divide
    the tiles.
    """
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    dtype = q_hmd.dtype
    pm.check_decode_operands(q_hmd, pk_phd, pv_phd, sk_bshd, sv_bshd, group, prefix=False)
    why = fused_supported(batch=b, heads_q=hkv * group, heads_kv=hkv, prefix_len=p,
                          suffix_cap=s_cap, head_dim=d, dtype=dtype, block_s=block_s)
    if why is not None:
        raise ValueError(f"shared_decode_partials_mgpu cannot run these shapes: {why}")
    pk_phd, pv_phd, sk_bshd, sv_bshd = pm.decode_operands(pk_phd, pv_phd, sk_bshd, sv_bshd, dtype,
                                                          cpu_check=_cpu_check)
    m_blocks = m // 128
    n_tiles = p // 128
    splits = int(num_splits)
    s_tiles = s_cap // block_s
    if n_tiles % splits or s_tiles % suffix_splits:
        raise ValueError(f"num_splits={splits} must divide the {n_tiles} prefix tiles and "
                         f"suffix_splits={suffix_splits} the {s_tiles} suffix tiles")
    n_pre = hkv * m_blocks * splits
    suf_blocks = m_blocks
    n_suf = hkv * suf_blocks * suffix_splits
    n_suf_out = suffix_splits
    pre_cfg = dict(tiles_per_split=n_tiles // splits, n_tiles=n_tiles,
                   steps=max(1, min(prefix_steps, n_tiles // splits)), block_q=64, block_kv=128,
                   scale_log2=float(scale) * LOG2E, schedule_barrier=schedule_barrier,
                   cpu_check=_cpu_check)
    suf_cfg = dict(batch=b, group=group, block_s=block_s,
                   tiles_per_split=s_tiles // suffix_splits,
                   steps=max(1, min(suffix_steps, (64 // group) * (s_tiles // suffix_splits))),
                   scale_log2=float(scale) * LOG2E, cpu_check=_cpu_check)

    def launch(kinds):
        n_p = n_pre if "prefix" in kinds else 0
        n_s = n_suf if "suffix" in kinds else 0

        def kernel(plen_ref, slen_ref, q_ref, pk_ref, pv_ref, sk_ref, sv_ref, o_pre_ref,
                   lse_pre_ref, o_suf_ref, lse_suf_ref, q_smem2, lse_smem2, q_barriers,
                   sched_barrier, *maybe_p):
            p_pre, p_suf = maybe_p if _cpu_check else (None, None)
            is_suf, idx = task_order(lax.axis_index("t"), n_p, n_s)
            common = dict(q_ref=q_ref, q_smem2=q_smem2, lse_smem2=lse_smem2, q_barriers=q_barriers)

            def prefix():
                hb, sp = idx // splits, idx % splits
                pm.prefix_task(h=hb // m_blocks, mb=hb % m_blocks, sp=sp, n_keys=plen_ref[0],
                               k_ref=pk_ref, v_ref=pv_ref, o_ref=o_pre_ref, lse_ref=lse_pre_ref,
                               sched_barrier=sched_barrier, p_smem2=p_pre, **common, **pre_cfg)

            def suffix():
                hb, ss = idx // suffix_splits, idx % suffix_splits
                _suffix_task(h=hb // suf_blocks, mb=hb % suf_blocks, ss=ss, k_ref=sk_ref, v_ref=sv_ref,
                             len_ref=slen_ref, o_ref=o_suf_ref, lse_ref=lse_suf_ref,
                             p_smem2=p_suf, **common, **suf_cfg)
            if n_p:
                pl.when(jnp.logical_not(is_suf))(prefix)
            if n_s:
                pl.when(is_suf)(suffix)

        return plgpu.kernel(
            kernel,
            grid=(n_p + n_s,),
            grid_names=("t",),
            num_threads=3,
            thread_name="wg",
            out_type=(partial_state_types(splits, hkv, m, d, dtype)
                      + partial_state_types(n_suf_out, hkv, m, d, dtype)),
            scratch_types=(plgpu.SMEM((2, 64, d), dtype),
                           plgpu.SMEM((2, 64), jnp.float32),
                           plgpu.Barrier(num_barriers=2),
                           plgpu.Barrier(num_arrivals=2))
                          + ((plgpu.SMEM((2, 64, 128), dtype), plgpu.SMEM((2, 64, block_s), dtype))
                             if _cpu_check else ()),
            compiler_params=plgpu.CompilerParams(
                approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            **({"interpret": gpu_interpret_params()} if interpret else {}),
        )(jnp.asarray(p_len, jnp.int32).reshape(1), jnp.asarray(s_len, jnp.int32).reshape(b), q_hmd,
          pk_phd, pv_phd, sk_bshd, sv_bshd)

    if not set(tasks) <= {"prefix", "suffix"} or not tasks:
        raise ValueError(f"tasks must name 'prefix' and/or 'suffix', got {tasks!r}")
    if not interpret or len(set(tasks)) == 1:
        return launch(tuple(tasks))
    # Mosaic GPU's CPU interpreter cannot trace two pipelines in one kernel (it leaks a tracer):
    # interpret mode launches the same prefix and suffix tasks as two kernels.  The
    # interleaving itself is ``task_order``, tested on its own.
    o_pre, lse_pre, _, _ = launch(("prefix",))
    _, _, o_suf, lse_suf = launch(("suffix",))
    return o_pre, lse_pre, o_suf, lse_suf
