"""Decoupled one-launch shared-prefix decode (EXPERIMENTAL, not dispatched: slower, see "Status").

Shared-prefix decode through one Pallas Mosaic GPU kernel whose CTAs run the prefix pass and,
*decoupled from it*, a share of the suffix pass: a fourth warpgroup per CTA streams suffix
tiles through its own buffers and barriers while the two compute warpgroups work through the
prefix on the tensor cores.

Why: at the issue-4 points still above 1.5x the floor, the prefix part (tensor-core bound) and
the suffix part (bandwidth bound) are each near their own roofline but run one after the other,
while the floor counts only the larger.  Earlier overlaps fell short: two launches run
concurrently (the prefix CTAs fill every SM), prefix and suffix tasks in different CTAs of one
launch (``shared_decode_mgpu``: a suffix CTA holds its SM while it waits on memory), and suffix
tiles streamed through the prefix pipeline into the same softmax state (``joint_decode_mgpu``:
a step waits for both of its tiles, and each suffix tile costs ``64 / G`` times its useful
tensor-core work).  Here the suffix has its own pipeline, in its own warpgroup, so the two
parts only share the SM's issue slots, tensor cores and shared memory.

The suffix product is taken transposed ("swap AB"): for one sequence ``b`` and kv head ``h``,
``S^T = K Q^T`` is ``[64 keys, 16]`` (the wgmma's M = 64 is the keys, its N = 16 columns are
rows ``b * G .. b * G + 15`` of the queries, of which the first ``G`` are the sequence's query
heads), the online softmax runs down the columns, and ``O^T += V^T P^T`` is ``[D, 16]``.  So a
suffix tile costs ``16 / G`` times its useful tensor-core work (4x at G = 4; 64/G in the other
kernels) and the warpgroup's accumulators are small (``O^T``: 16 registers per thread at
D = 128), which is what leaves registers for a fourth warpgroup.

Scope (static, :func:`decoupled_supported`): decoding (one query per sequence), one prefix
shared by every sequence (all see ``p_len`` keys), 16-bit inputs, ``head_dim`` 64 or 128,
``G = Hq / Hkv`` a power of two up to 16, ``P % 128 == 0``, suffix capacity ``S % 64 == 0``.

Layouts: ``q_hmd [Hkv, M, D]`` rows ``b * G + j`` (query head ``h * G + j`` of sequence ``b``;
``M`` a multiple of 128 covering ``B * G``, padding rows zero), prefix ``k/v [P, Hkv, D]``
with ``p_len`` valid keys (``[1]`` or scalar int32, dynamic), suffix ``k/v [B, S, Hkv, D]``
with ``s_len [B]`` int32 valid keys (dynamic).  The suffix pass reads the queries from a copy
in which sequence ``b``'s ``G`` rows start row ``b * COLS`` (zero rows between; TMA offsets
that are multiples of the shared-memory tiling).  Outputs: ``o_pre [splits, Hkv, M, D]`` (q's
dtype, normalised) and ``lse_pre [splits, Hkv, M]`` as
:func:`pallas_kernels.prefix_attention_mgpu.prefix_partials_mgpu`; ``o_suf [Hkv, B', D, 16]``
(q's dtype, normalised, *transposed*: column ``j < G`` is query head ``h * G + j`` of sequence
``b``) and ``lse_suf [Hkv, B', 16]`` float32 for the suffix keys, ``B' >= M / G`` (rows of
padding sequences are written, from zero queries and no keys).  ``lse = -inf`` and ``o = 0``
where a part saw no key.  The caller merges the partial states
(:func:`suffix_rows` puts the suffix's in the row layout).

Kernel: grid ``(Hkv, M / 128, splits)``, four warpgroups:

* 0, 1 -- compute: 64 query rows each against the split's 128-key prefix tiles (QK^T, online
  softmax in base 2, PV; the two take turns on the tensor cores: FlashAttention-3's ping-pong,
  :mod:`pallas_kernels.prefix_attention_mgpu`'s pieces);
* 2 -- memory: TMA loads of the prefix K/V tiles into ``steps`` stages;
* 3 -- suffix: the sequences of the CTA's 128 rows (``128 / G`` of them), divided among the
  ``splits`` CTAs of the row block; for each, its suffix tiles of 64 keys, loaded by TMA one
  step ahead (one ``K`` buffer, reloaded as soon as ``S^T`` is read; one ``V`` buffer,
  reloaded after ``P V``; one query buffer, reloaded after a sequence's last ``S^T``), then
  ``O^T``/``lse`` written.  The suffix steps are a static ``sequences x S / 64`` grid; steps
  past a sequence's length load its last valid tile again (an L2 hit) and skip the math, so
  the barrier phases never depend on the lengths.  ``V`` rows past a length are zeroed in shared memory before ``P V`` (NaN in
  the cache there never reaches the output).

Registers: ``setmaxnreg`` gives the compute warpgroups ``compute_registers`` each, the memory
warpgroup ``MEMORY_REGISTERS``, the suffix warpgroup the rest of the 512 per thread-slot.
Shared memory at D = 128, bf16: 32 KiB of queries and 128 KiB of prefix stages (2) as in the
prefix kernel, plus 16 + 16 + 4 KiB of suffix K, V, query buffers and 2 + 4 KiB of ``P^T`` and
``O^T`` staging: about 202 KiB of Hopper's 227 (the prefix LSE is stored from registers, as
in the one-pass kernel).

Status (session 19): EXPERIMENTAL, NOT DISPATCHED -- exact on an H200 but measured slower
than the default shared path at every point tried, so nothing in the package calls it.
* Lowering: the session-18 draft failed Mosaic GPU's layout inference because each sequence's
  suffix queries were loaded by TMA from row ``b * G`` (a multiple of G = 4, not of the 8-row
  smem tiling: an unsatisfiable divisibility constraint on the query buffer, printed by
  ``bench/results/logs/session18_layout_diag.py``).  The caller's queries are now copied to
  their own ``COLS``-row blocks (``qs_in``, a small XLA pad), and the kernel lowers in 2 s on
  the CPU (``tests/test_decoupled_decode_mgpu.py``).
* Exactness (GPU, ``bench/results/logs/session19_decoupled_probe_a_h200.jsonl`` and the gpu
  tests): relative error 2.7e-3 (bf16) against float64 NumPy at three shapes, with random
  suffix lengths (0 and the capacity included) and NaN in the cache past them.  The CPU
  interpreter path (``interpret=True, _cpu_check=True``) is not tested: in session 19, with
  jax 0.10.2, it gave no result in 15 minutes at B = 40 and made no progress at B = 3 (about
  10 s of CPU in 4-10 minutes, this version and the session-18 draft alike), although session
  18 had reported the draft exact there; not investigated further.
* Speed (H200, same file and ``..._probe_b_h200.jsonl``, interleaved with the default path):
  1.05-2.0x the default's time at the 3 probe points and 9 grid points that miss 1.5x the
  floor (Hq=32 B=256 P=4K S=128: 0.142 against 0.073 ms).  The cause is the register split:
  with four warpgroups the two compute warpgroups get 200 registers instead of the prefix
  kernel's 232 (its pipeline keeps 40 for the memory warpgroup), and the prefix part alone
  (``_parts="prefix"``, merge included) took 0.064 ms at that point where the whole default
  path takes 0.073 (0.045-0.148 against 0.050-0.196 at the four points of run b).  Giving
  the compute warpgroups 208 left the suffix warpgroup 64 registers and made the kernel
  1.15-1.26x slower still; 184 (the suffix warpgroup 112) made it faster (0.111 ms at that
  point) but still 1.03-1.52x the default.  Probe d (``..._probe_d_h200.jsonl``, three of
  those points): without the zeroing of ``V`` rows past a length (timing only: inexact with
  NaN there) the kernel took 1.11-1.50x the default at 200 registers and 1.05-1.45x at 184;
  168 (the suffix warpgroup 144) with the zeroing 1.07-1.44x.  A fourth warpgroup cannot get
  the registers the suffix needs without taking them from the prefix, and even the prefix
  part alone is within 0.75-0.86x of the whole default path, which bounds any gain.
* Kept as a tested base for a design that moves the suffix into warpgroups that have
  registers to spare (e.g. swapped products inside the compute warpgroups between prefix
  tiles).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels.prefix_attention_mgpu import plgpu

__all__ = ["decoupled_supported", "decoupled_decode_mgpu", "suffix_rows", "COLS", "BLOCK_S"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
COLS = 16        # suffix wgmma N: query rows per suffix product (a sequence's G, padded)
BLOCK_S = 64     # suffix keys per tile (the swapped product's M)
BLOCK_KV = 128   # prefix keys per tile
MEMORY_REGISTERS = 32
COMPUTE_REGISTERS = 200


def decoupled_supported(*, batch: int, heads_q: int, heads_kv: int, prefix_len: int,
                        suffix_cap: int, head_dim: int, dtype) -> str | None:
    """``None`` when :func:`decoupled_decode_mgpu` handles these static shapes, else the reason."""
    if heads_kv < 1 or heads_q % heads_kv:
        return f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}"
    g = heads_q // heads_kv
    if g & (g - 1) or g > COLS:
        return f"query heads per kv head must be a power of two up to {COLS}, got {g}"
    rows = -(-batch * g // 128) * 128
    why = pm.mgpu_supported(rows=rows, prefix_len=prefix_len, head_dim=head_dim, dtype=dtype,
                            block_kv=BLOCK_KV)
    if why is not None:
        return why
    if suffix_cap % BLOCK_S or suffix_cap == 0:
        return f"suffix capacity {suffix_cap} must be a positive multiple of {BLOCK_S}"
    return None


def suffix_rows(o_suf, lse_suf, *, batch: int, group: int):
    """The suffix states in the prefix partials' row layout: ``(o [1, Hkv, B * G, D],
    lse [1, Hkv, B * G])`` from ``o_suf [Hkv, B', D, 16]`` / ``lse_suf [Hkv, B', 16]``."""
    hkv, _, d, _ = o_suf.shape
    o = jnp.swapaxes(o_suf[:, :batch, :, :group], 2, 3).reshape(1, hkv, batch * group, d)
    lse = lse_suf[:, :batch, :group].reshape(1, hkv, batch * group)
    return o, lse


def _divmod(u, n: int):
    """``(u // n, u % n)`` for a non-negative step index: Python ints stay Python ints (a 0-d
    constant defeats Mosaic GPU's layout inference), traced ones use truncating division (no
    floor-division selects, which defeat it too)."""
    if isinstance(u, int):
        return u // n, u % n
    return lax.div(u, n), lax.rem(u, n)


def _zero_rows_past(v_smem, key0, n, *, transposed: bool):
    """Zero the keys ``>= n`` of a suffix ``V`` tile in shared memory (``[keys, D]``, or
    ``[D, keys]`` when ``transposed``), so that NaN or Inf in the cache there never reaches
    ``P V``; only on the tile that holds the length (a uniform branch)."""
    @pl.when(key0 + BLOCK_S > n)
    def _():
        shape = v_smem.shape
        keys = pm.wgmma_iota(shape, 1 if transposed else 0, hint=not transposed)
        v_smem[...] = jnp.where(key0 + keys < n, v_smem[...], jnp.zeros_like(v_smem[...]))
        plgpu.commit_smem()


def decoupled_decode_mgpu(q_hmd, pk_phd, pv_phd, p_len, sk_bshd, sv_bshd, s_len, *, scale: float,
                          group: int, num_splits: int | None = None, steps: int = 2,
                          schedule_barrier: bool = True,
                          compute_registers: int = COMPUTE_REGISTERS,
                          interpret: bool = False, _cpu_check: bool = False,
                          _parts: str = "both"):
    """Prefix partials and suffix states of every row in one launch; see the module docstring
    for layouts, scope and outputs.

    Returns ``(o_pre [splits, Hkv, M, D], lse_pre [splits, Hkv, M], o_suf [Hkv, B', D, 16],
    lse_suf [Hkv, B', 16])`` with ``B' >= M / G`` (sequences past ``B`` are padding).
    ``num_splits``: prefix splits (None:
    :func:`prefix_attention_mgpu.choose_splits` over the ``Hkv * M / 128`` CTAs); the suffix
    sequences of a row block are divided among its splits.  ``steps``: prefix pipeline stages.
    ``compute_registers``: per thread of each compute warpgroup (a multiple of 8; the suffix
    warpgroup gets ``512 - 2 * compute_registers - MEMORY_REGISTERS``).  ``interpret`` runs
    Mosaic GPU's CPU interpreter and needs ``_cpu_check`` (operand forms it supports:
    transposed operands pre-transposed in memory, ``P`` staged through shared memory; tests
    only).  ``_parts="prefix"`` (timing probes only) skips the suffix warpgroup's work and
    leaves the suffix states unwritten.

    Raises ``ValueError`` for shapes outside the scope, splits that do not divide the prefix
    tiles, or a register split outside 56-256 per thread for the suffix warpgroup.
    """
    hkv, m, d = q_hmd.shape
    p = pk_phd.shape[0]
    b, s_cap = sk_bshd.shape[:2]
    dtype = q_hmd.dtype
    g = int(group)
    pm.check_decode_operands(q_hmd, pk_phd, pv_phd, sk_bshd, sv_bshd, g)
    why = decoupled_supported(batch=b, heads_q=hkv * g, heads_kv=hkv, prefix_len=p,
                              suffix_cap=s_cap, head_dim=d, dtype=dtype)
    if why is not None:
        raise ValueError(f"decoupled_decode_mgpu cannot run these shapes: {why}")
    suffix_registers = 512 - 2 * int(compute_registers) - MEMORY_REGISTERS
    if compute_registers % 8 or not 56 <= suffix_registers <= 256 or compute_registers > 256:
        raise ValueError(f"compute_registers={compute_registers} must be a multiple of 8 up to 256 "
                         f"leaving the suffix warpgroup 56 to 256 (it would get {suffix_registers})")
    pk_phd, pv_phd, sk_bshd, sv_bshd = (x.astype(dtype) for x in (pk_phd, pv_phd, sk_bshd, sv_bshd))
    m_blocks = m // 128
    n_tiles = p // BLOCK_KV
    splits = pm.choose_splits(n_tiles, hkv * m_blocks) if num_splits is None else int(num_splits)
    if splits < 1 or n_tiles % splits:
        raise ValueError(f"num_splits={splits} must divide the {n_tiles} prefix tiles")
    t_pre = n_tiles // splits                     # prefix tiles per split
    stages = max(1, min(int(steps), t_pre))
    seqs = 128 // g                               # sequences per 128-row block
    n_seq = -(-seqs // splits)                    # of them per split (CTA)
    s_tiles = s_cap // BLOCK_S
    n_suf = n_seq * s_tiles                       # suffix steps per CTA (static)
    # suffix states written: every (row block, split) slot, padding sequences included (no
    # index is clamped: a clamp there defeats Mosaic GPU's layout inference)
    b_out = (m_blocks - 1) * seqs + n_seq * splits
    scale_log2 = float(scale) * _LOG2E
    # suffix queries: each sequence's G rows at the top of its own COLS-row block (TMA offsets
    # that are multiples of the smem tiling; rows past G are zero)
    qs_in = jnp.pad(q_hmd[:, :b * g].reshape(hkv, b, g, d),
                    ((0, 0), (0, b_out - b), (0, COLS - g), (0, 0))).reshape(hkv, b_out * COLS, d)
    if _cpu_check:  # CPU-interpreter check only: its wgmma cannot read a transposed ref
        pk_in = jnp.transpose(pk_phd, (1, 2, 0))         # [Hkv, D, P]
        sv_in = jnp.transpose(sv_bshd, (0, 2, 3, 1))     # [B, Hkv, D, S]
        qt_in = jnp.transpose(qs_in, (0, 2, 1))          # [Hkv, D, B' * COLS]
    else:
        pk_in, sv_in, qt_in = pk_phd, sv_bshd, None
    s_len = jnp.asarray(s_len, jnp.int32).reshape(b)
    p_len = jnp.asarray(p_len, jnp.int32).reshape(1)

    def kernel(plen_ref, slen_ref, q_ref, qs_ref, pk_ref, pv_ref, sk_ref, sv_ref, *rest):
        if _cpu_check:
            qt_ref, *rest = rest
        (o_ref, lse_ref, os_ref, ls_ref, q_smem2, k_smem, v_smem, q_bars, k_bars, v_bars,
         k_free, v_free, sched, sk_smem, sv_smem, sq_smem, sp_smem, so_smem, sk_bar, sv_bar,
         sq_bar, *maybe_p) = rest
        h, mb, sp = lax.axis_index("h"), lax.axis_index("m"), lax.axis_index("s")
        wg = lax.axis_index("wg")
        first_tile = sp * t_pre
        limit_regs = not interpret

        # ------------------------------------------------------------------ memory warpgroup
        @pl.when(wg == 2)
        def _memory():
            if limit_regs:
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            @pl.loop(0, t_pre)
            def _(t):
                slot = lax.rem(t, stages)
                tile = first_tile + t

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                k_src = (pk_ref.at[h, :, pl.ds(tile * BLOCK_KV, BLOCK_KV)] if _cpu_check
                         else pk_ref.at[pl.ds(tile * BLOCK_KV, BLOCK_KV), h, :])
                plgpu.copy_gmem_to_smem(k_src, k_smem.at[slot], k_bars.at[slot])

                @pl.when(t >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(pv_ref.at[pl.ds(tile * BLOCK_KV, BLOCK_KV), h, :],
                                        v_smem.at[slot], v_bars.at[slot])

        # ------------------------------------------------------------------ compute warpgroups
        @pl.when(wg < 2)
        def _compute():
            if limit_regs:
                plgpu.set_max_registers(compute_registers, action="increase")
            n_keys = plen_ref[0]
            r0 = mb * 128 + wg * 64
            turn = functools.partial(pm.take_turn, sched, schedule_barrier)
            p_smem = maybe_p[0].at[wg] if _cpu_check else None

            def run(carry):
                def body(t, carry):
                    slot = lax.rem(t, stages)
                    plgpu.barrier_wait(k_bars.at[slot])
                    return pm.prefix_tile_step(
                        carry, q_smem=q_smem2.at[wg], k_smem=k_smem.at[slot],
                        v_smem=v_smem.at[slot], p_smem=p_smem, k_consumed=k_free.at[slot],
                        v_consumed=v_free.at[slot], v_ready=v_bars.at[slot],
                        first_key=lambda: (first_tile + t) * BLOCK_KV, n_keys=n_keys, turn=turn,
                        schedule_barrier=schedule_barrier, scale_log2=scale_log2,
                        cpu_check=_cpu_check)
                return lax.fori_loop(0, t_pre, body, carry)

            # warpgroup 1 starts one phase behind (one extra turn before its first tile,
            # warpgroup 0 one after its last): their tensor-core and softmax phases alternate
            pm.wg_compute_context(
                q_src=q_ref.at[h, pl.ds(r0, 64)], q_smem=q_smem2.at[wg],
                q_barrier=q_bars.at[wg], lse_smem=None, o_dst=o_ref.at[sp, h, pl.ds(r0, 64)],
                lse_dst=lse_ref.at[sp, h, pl.ds(r0, 64)], block_q=64, d=d, dtype=dtype,
                before=lambda: pl.when(wg == 1)(turn),
                after=lambda: pl.when(wg == 0)(turn))(run)

        # ------------------------------------------------------------------ suffix warpgroup
        @pl.when(wg == 3)
        def _suffix():
            if limit_regs and suffix_registers != 128:   # 128: what each thread starts with
                # (a "decrease" above the starting 128 is an illegal instruction on the GPU)
                plgpu.set_max_registers(suffix_registers,
                                        action="decrease" if suffix_registers < 128 else "increase")
            if _parts == "prefix":   # (timing probes only: the suffix states are left unwritten)
                return

            def seq_index(i):
                """Sequence of local index ``i`` (past ``B`` for padding sequences)."""
                return mb * seqs + sp * n_seq + i

            def seq_of(i):
                """(sequence of local index ``i``, clamped to a real one, its valid keys).  (Only
                where all three are used: an unused gmem load defeats layout inference.)"""
                g_seq = seq_index(i)
                real = (sp * n_seq + i < seqs) & (g_seq < b)
                bc = jnp.minimum(g_seq, b - 1)
                return g_seq, bc, jnp.where(real, slen_ref[bc], 0)

            def tile_of(u):
                """(local sequence, clamped sequence, its valid keys, tile to load, key0) of
                step ``u``: tiles past the length load the last valid tile again."""
                i, t = _divmod(u, s_tiles)
                _, bc, n = seq_of(i)
                last = jnp.maximum(lax.div(n + BLOCK_S - 1, BLOCK_S) - 1, 0)
                return i, bc, n, jnp.minimum(t, last), t * BLOCK_S

            def load_q(i):
                row = seq_index(i) * COLS
                src = (qt_ref.at[h, :, pl.ds(row, COLS)] if _cpu_check
                       else qs_ref.at[h, pl.ds(row, COLS)])
                plgpu.copy_gmem_to_smem(src, sq_smem, sq_bar.at[0])

            def load_k(u):
                _, bc, _, tile, _ = tile_of(u)
                plgpu.copy_gmem_to_smem(sk_ref.at[bc, pl.ds(tile * BLOCK_S, BLOCK_S), h, :],
                                        sk_smem, sk_bar.at[0])

            def load_v(u):
                _, bc, _, tile, _ = tile_of(u)
                src = (sv_ref.at[bc, h, :, pl.ds(tile * BLOCK_S, BLOCK_S)] if _cpu_check
                       else sv_ref.at[bc, pl.ds(tile * BLOCK_S, BLOCK_S), h, :])
                plgpu.copy_gmem_to_smem(src, sv_smem, sv_bar.at[0])

            load_q(0)
            load_k(0)
            load_v(0)

            def step(u, carry):
                i, _, n, _, key0 = tile_of(u)
                t = _divmod(u, s_tiles)[1]
                acc, m_i, l_i = carry

                @pl.when(t == 0)
                def _():
                    plgpu.barrier_wait(sq_bar.at[0])
                plgpu.barrier_wait(sk_bar.at[0])

                def scores(s_ref):   # S^T = K Q^T: [keys, COLS]
                    plgpu.wgmma(s_ref, sk_smem,
                                sq_smem if _cpu_check else sq_smem.transpose((1, 0)))
                    return s_ref[...]
                s = pl.run_scoped(scores, plgpu.ACC((BLOCK_S, COLS), jnp.float32))
                has_next = u + 1 < n_suf

                @pl.when(has_next)          # the K buffer is free: the next step's K
                def _():
                    load_k(u + 1)

                @pl.when(u + 1 < n_suf)   # the queries too, after a sequence's last S^T
                def _():
                    pl.when(t == s_tiles - 1)(lambda: load_q(i + 1))

                plgpu.barrier_wait(sv_bar.at[0])
                v_tile = sv_smem

                def attend(acc, m_i, l_i):
                    _zero_rows_past(v_tile, key0, n, transposed=_cpu_check)
                    keys = key0 + pm.wgmma_iota((BLOCK_S, COLS), 0, hint=not _cpu_check)
                    sv = jnp.where(keys < n, s, -jnp.inf)
                    m_new = jnp.maximum(m_i, sv.max(axis=0) * scale_log2)
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    alpha = jnp.exp2(m_i - m_use)
                    prob = jnp.exp2(sv * scale_log2 - lax.broadcast_in_dim(m_use, sv.shape, [1]))
                    l_new = l_i * alpha + prob.sum(axis=0)
                    sp_smem[...] = prob.astype(dtype)
                    plgpu.commit_smem()
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
                    acc = pm.wg_accumulate(   # O^T += V^T P^T
                        acc, lambda: (v_tile if _cpu_check else v_tile.transpose((1, 0)), sp_smem),
                        cpu_check=_cpu_check)
                    return acc, m_new, l_new
                acc, m_i, l_i = lax.cond(key0 < n, attend, lambda *c: c, acc, m_i, l_i)

                @pl.when(has_next)          # the V buffer is free: the next step's V
                def _():
                    load_v(u + 1)

                @pl.when(t == s_tiles - 1)     # the sequence's state: normalise and write
                def _():
                    g_seq = seq_index(i)
                    has = l_i > 0.0
                    l_safe = jnp.where(has, l_i, 1.0)
                    plgpu.wait_smem_to_gmem(0)     # the staging buffer's previous store
                    so_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(dtype)
                    ls_ref.at[h, g_seq][...] = jnp.where(
                        has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(so_smem, os_ref.at[h, g_seq])
                return lax.cond(t == s_tiles - 1, fresh, lambda *c: c, acc, m_i, l_i)

            def fresh(*_):
                return (jnp.zeros((d, COLS), jnp.float32), jnp.full((COLS,), -jnp.inf, jnp.float32),
                        jnp.zeros((COLS,), jnp.float32))
            lax.fori_loop(0, n_suf, step, fresh())
            plgpu.wait_smem_to_gmem(0)

    smem_k = (stages, d, BLOCK_KV) if _cpu_check else (stages, BLOCK_KV, d)
    sv_shape = (d, BLOCK_S) if _cpu_check else (BLOCK_S, d)
    sq_shape = (d, COLS) if _cpu_check else (COLS, d)
    scratch = (plgpu.SMEM((2, 64, d), dtype),                    # compute queries
               plgpu.SMEM(smem_k, dtype), plgpu.SMEM((stages, BLOCK_KV, d), dtype),
               plgpu.Barrier(num_barriers=2),                    # queries loaded
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_arrivals=2, num_barriers=stages),   # K slot consumed
               plgpu.Barrier(num_arrivals=2, num_barriers=stages),   # V slot consumed
               plgpu.Barrier(num_arrivals=2),                    # ping-pong turns
               plgpu.SMEM((BLOCK_S, d), dtype), plgpu.SMEM(sv_shape, dtype),
               plgpu.SMEM(sq_shape, dtype), plgpu.SMEM((BLOCK_S, COLS), dtype),
               plgpu.SMEM((d, COLS), dtype),
               plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=1),
               plgpu.Barrier(num_barriers=1))
    if _cpu_check:
        scratch += (plgpu.SMEM((2, 64, BLOCK_KV), dtype),)
    args = (p_len, s_len, q_hmd, qs_in, pk_in, pv_phd, sk_bshd, sv_in) + ((qt_in,) if _cpu_check else ())
    return plgpu.kernel(
        kernel,
        grid=(hkv, m_blocks, splits),
        grid_names=("h", "m", "s"),
        num_threads=4,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((splits, hkv, m, d), dtype),
                  jax.ShapeDtypeStruct((splits, hkv, m), jnp.float32),
                  jax.ShapeDtypeStruct((hkv, b_out, d, COLS), dtype),
                  jax.ShapeDtypeStruct((hkv, b_out, COLS), jnp.float32)),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": pm._gpu_interpret_params()} if interpret else {}),
    )(*args)
