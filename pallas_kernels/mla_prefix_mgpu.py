"""The prefix part of absorbed multi-head latent attention (MLA, DeepSeek-V2/V3) decoding through
Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation): every query row of every head of
every sequence against one shared latent prefix.

In absorbed MLA every head reads the same cache: one latent ``c [R]`` (``R`` = kv_lora_rank) and
one RoPE key ``k_rope [Dr]`` per token, so the ``M = B * Tq * H`` query rows are one matrix:

    s = sm_scale * (q_nope . c + q_rope . k_rope),   o = sum_j softmax(s)_j c_j   ([R] per row)

Layouts: ``q_nope [M, R]``, ``q_rope [M, Dr]``, ``c [P, R]``, ``k_rope [P, Dr]`` (16-bit, one
dtype), ``length`` a scalar (traced or static; keys ``>= length`` are masked and never reach the
result, clamped to ``[0, P]``).  :func:`mla_prefix_partials` returns the partial states of
``num_splits`` key splits, ``o [splits, M, R]`` (``out_dtype``, float32 by default, normalised)
and ``lse [splits, M]`` float32 natural log (``-inf`` and ``o = 0`` where a split sees no key),
to be merged with each other and with the suffix part (``merge_attention_states``);
:func:`mla_prefix_attention` merges the splits (``o [M, R]`` float32, ``lse [M]``).

Design (one CTA = ``block_q`` = 64 rows of one key split; three warpgroups):

* The output accumulator is the problem: ``64 x 512`` float32 is 128 KiB, the whole register
  file of a warpgroup.  The value dimension is split between the two compute warpgroups: both
  own the same 64 rows, warpgroup ``w`` accumulates the output columns ``[w R/2, (w+1) R/2)``
  (``64 x 256`` float32, 128 registers per thread at ``R = 512``).  Two ways to give both the
  probabilities ``P``:
  - default: both compute the same scores ``S [64, block_kv]`` and the same online softmax
    (identical instructions on identical data: their row maxima and sums agree bit for bit)
    and take ping-pong turns on the tensor cores.  The price is the duplicated ``Q K^T``: per
    key ``2 * 576 + 512`` multiply-add columns instead of ``576 + 512`` (1.53x the minimum).
  - ``share_p=True``: warpgroup 0 alone computes ``S`` and the softmax and hands ``P`` and the
    new row maxima to warpgroup 1 through shared memory (two one-arrival barriers per tile:
    ``P`` ready, ``P`` read), both then run ``P c_w`` from shared memory: the minimum tensor
    work, with warpgroup 0's softmax not overlapped by a second ``Q K^T``.  The RoPE queries
    live in warpgroup 0's registers (loaded through ``P``'s buffer; ``Dr == block_kv``): the
    8 KiB of ``P`` do not fit next to the rest otherwise.
* The latent tile is loaded once per step for both products: by TMA as two halves
  ``c_lo, c_hi [block_kv, R/2]`` (columns ``[0, R/2)`` and ``[R/2, R)`` of the same rows), with
  ``k_rope [block_kv, Dr]``.  ``S`` is three wgmma accumulations into one float32 accumulator,
  ``Qn_lo c_lo^T + Qn_hi c_hi^T + Qr k_rope^T`` (the ``R + Dr`` contraction); then warpgroup
  ``w`` runs ``O_w += P c_w`` with ``c_w`` the half it owns (a uniform branch on ``w``).
* A memory warpgroup streams the split's tiles through a ring of ``num_stages`` buffers
  (``emit_pipeline_warp_specialized``); the compute warpgroups release each buffer when done.
  Only tiles that hold a key ``< length`` are loaded (the step count is dynamic).  The online
  softmax runs in base 2 with the scale folded in (``p = exp2(s * scale * log2(e) - m)``), the
  mask built only on the tile that holds the length.  ``schedule_barrier``: the ping-pong turns
  (one warpgroup issues its products while the other runs its softmax; FlashAttention-3).
* Shared memory at the defaults (``R = 512``, ``Dr = 64``, ``block_kv = 64``, 2 stages):
  ``Q`` 72 KiB (once per CTA: both warpgroups read it), 2 x 72 KiB of ``c``/``k_rope`` tiles,
  the LSE row: ~219 KiB of the 227 KiB of a Hopper SM (:func:`smem_bytes`); a third stage or
  128-key tiles do not fit at ``R = 512``.  Registers per compute thread: 128 (output) + 32
  (scores) + 16 (``P``).
* The output leaves from registers (each warpgroup its half), the LSE by TMA.

The last loaded tile is read whole: ``0 * NaN`` in ``P c`` would leak a NaN stored past the
length, so the wrapper zeroes ``c`` at and past ``length`` first (``zero_tail``; one XLA pass over
``c``; pass False when the cache holds finite values there).  ``NaN`` in ``k_rope`` past the
length is masked out of the scores.

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter with the operand forms it
has: the keys pre-transposed in memory (``c^T``, ``k_rope^T``, loaded in addition to ``c``) for
``Q K^T``, and ``P`` staged through shared memory with ``P c`` into a fresh accumulator.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, cdiv, merge_partials, pad_axis
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu, store_gmem
from pallas_kernels.prefix_attention_mgpu import (masked_softmax_step, take_turn,
                                                  wg_accumulate, wg_accumulate_pv, wg_pipeline,
                                                  wgmma_iota)

__all__ = ["mla_prefix_partials", "mla_prefix_attention", "supported", "smem_bytes", "dup_step",
           "check_operand_types", "SMEM_LIMIT", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Shared memory one CTA may use on a Hopper SM (sm_90: 227 KiB of the 228).
SMEM_LIMIT = 227 * 1024
# Buffers start on 1 KiB boundaries (128-byte swizzle); barriers and scopes take ~2 KiB more.
_SMEM_ALIGN = 1024
_SMEM_SLACK = 2304


def smem_bytes(rank: int, rope_dim: int, dtype, *, block_q: int = 64, block_kv: int = 64,
               num_stages: int = 2, share_p: bool = False, interpret: bool = False) -> int:
    """Bytes of shared memory of one CTA (an upper estimate): the queries ``[block_q, R + Dr]``
    (with ``share_p`` on the GPU, ``[block_q, R]`` and ``P``'s buffer, which carries the RoPE
    part into registers first), the LSE row, ``num_stages`` latent and RoPE key tiles
    ``[block_kv, R + Dr]`` (in interpret mode also their transposes and the staged ``P``
    tiles), each aligned, and the barriers."""
    item = jnp.dtype(dtype).itemsize
    half = rank // 2
    p_tile = block_q * block_kv * item
    buffers = [2 * block_q * half * item, block_q * 4]
    buffers.append(p_tile if share_p and not interpret else block_q * rope_dim * item)
    tiles = [block_kv * half * item] * 2 + [block_kv * rope_dim * item]
    if interpret:
        tiles = tiles * 2
        buffers.append(p_tile if share_p else 2 * p_tile)
    buffers += [num_stages * t for t in tiles]
    return sum(cdiv(x, _SMEM_ALIGN) * _SMEM_ALIGN for x in buffers) + _SMEM_SLACK


def supported(*, rank: int, rope_dim: int, prefix_len: int, dtype, block_q: int = 64,
              block_kv: int = 64, num_stages: int = 2, share_p: bool = False,
              interpret: bool = False) -> str | None:
    """``None`` when the kernel runs these static shapes and tiles, else the reason it cannot."""
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not available"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if rank % 128 or not 128 <= rank <= 512:
        return f"kv_lora_rank R must be a multiple of 128 in [128, 512], got {rank}"
    if rope_dim not in (64, 128):
        return f"rope_dim Dr must be 64 or 128, got {rope_dim}"
    if block_q != 64:
        return f"block_q must be 64 (one wgmma row block per warpgroup), got {block_q}"
    if block_kv % 64 or not 64 <= block_kv <= 256:
        return f"block_kv must be a multiple of 64 in [64, 256], got {block_kv}"
    if num_stages < 2:
        return f"num_stages must be at least 2, got {num_stages}"
    if prefix_len < 1:
        return f"prefix length P must be positive, got {prefix_len}"
    if share_p and rope_dim != block_kv:
        return (f"share_p needs rope_dim == block_kv (the RoPE queries pass through P's "
                f"[{block_q}, block_kv] buffer), got {rope_dim} and {block_kv}")
    need = smem_bytes(rank, rope_dim, dtype, block_q=block_q, block_kv=block_kv,
                      num_stages=num_stages, share_p=share_p, interpret=interpret)
    if need > SMEM_LIMIT:
        return (f"block_kv={block_kv}, num_stages={num_stages} at R={rank}, Dr={rope_dim} need "
                f"{need} bytes of shared memory, more than the {SMEM_LIMIT} of a Hopper SM")
    return None


def check_operand_types(operands, rank: int) -> None:
    """``operands``: ``(name, array, layout)`` of ``q_nope``, ``q_rope``, ``c``, ``k_rope`` (in
    that order): arrays of rank ``rank``, ``q_nope`` 16-bit and the others of its dtype
    (``TypeError``/``ValueError`` naming the argument and its layout)."""
    for name, x, layout in operands:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")
    q_nope = operands[0][1]
    if jnp.dtype(q_nope.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"q_nope must be bfloat16 or float16 (Hopper wgmma on 16-bit operands), "
                        f"got {q_nope.dtype}")
    for name, x, _ in operands[1:]:
        if x.dtype != q_nope.dtype:
            raise TypeError(f"{name} must have q_nope's dtype {q_nope.dtype}, got {x.dtype}")


def _check_operands(q_nope, q_rope, c, k_rope, out_dtype):
    check_operand_types((("q_nope", q_nope, "[M, R]"), ("q_rope", q_rope, "[M, Dr]"),
                         ("c", c, "[P, R]"), ("k_rope", k_rope, "[P, Dr]")), rank=2)
    m, r = q_nope.shape
    p, dr = c.shape[0], q_rope.shape[1]
    if q_rope.shape[0] != m:
        raise ValueError(f"q_rope must have q_nope's {m} rows, got shape {tuple(q_rope.shape)}")
    if m < 1:
        raise ValueError(f"q_nope must have at least one row, got shape {tuple(q_nope.shape)}")
    if c.shape[1] != r:
        raise ValueError(f"c must have q_nope's kv_lora_rank R={r} on axis 1, got shape "
                         f"{tuple(c.shape)}")
    if k_rope.shape != (p, dr):
        raise ValueError(f"k_rope must have shape (P, Dr) = {(p, dr)} (c's prefix length, "
                         f"q_rope's width), got {tuple(k_rope.shape)}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32),) + SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")


def _scores(q_ops, k_ops, *, block_kv, cpu_check, after_issue=None):
    """``S = sum_i q_ops[i] @ k_ops[i]`` float32 ``[rows, block_kv]`` on the tensor cores (the
    ``R + Dr`` contraction as accumulations into one accumulator; in interpret mode one
    accumulator per product, summed: the interpreter's wgmma does not accumulate), with
    ``after_issue`` between issuing the products and reading them."""
    def product(s_ref, pairs, last):
        for a, b in pairs:
            plgpu.wgmma(s_ref, a, b)
        if last and after_issue is not None:
            after_issue()
        return s_ref[...]
    pairs = list(zip(q_ops, k_ops))
    acc_type = plgpu.ACC((q_ops[0].shape[0], block_kv), jnp.float32)
    if cpu_check:
        return sum(pl.run_scoped(functools.partial(product, pairs=[pair],
                                                   last=i == len(pairs) - 1), acc_type)
                   for i, pair in enumerate(pairs))
    return pl.run_scoped(functools.partial(product, pairs=pairs, last=True), acc_type)


def _softmax(s, carry, *, key0, n_keys, dtype, scale_log2, cpu_check):
    """The online-softmax step of the tile whose first key is ``key0`` (keys ``>= n_keys``
    masked, the mask built only on the tile that holds the length)."""
    rows, block_kv = s.shape
    return masked_softmax_step(
        s, lambda: key0 + wgmma_iota((rows, block_kv), 1, hint=not cpu_check) < n_keys,
        key0 + block_kv > n_keys, carry, scale_log2=scale_log2, dtype=dtype)


def _arrive(barriers):
    for barrier in barriers:
        plgpu.barrier_arrive(barrier)


def dup_step(carry, *, q_ops, k_ops, c_lo, c_hi, consumed, p_smem, turn, sched, softmax,
             cpu_check, before_pv=None):
    """One key tile for one compute warpgroup when both compute the scores: ``S`` (``turn``
    between issuing and reading it), the key-only tiles released, the online softmax, the
    ping-pong turn, ``O += P c_w`` with ``c_w`` the warpgroup's half (``before_pv(c_w)`` first,
    where given: e.g. the suffix kernel zeroes the value rows past a length), the latent tiles
    released."""
    s = _scores(q_ops, k_ops, block_kv=c_lo.shape[0], cpu_check=cpu_check, after_issue=turn)
    _arrive(consumed[2:])
    acc, m_new, l_new, p16 = softmax(s, carry)
    if sched:  # softmax done: wait for the tensor cores' turn
        acc, m_new, l_new, p16 = lax.optimization_barrier((acc, m_new, l_new, p16))
        turn()
    def pv(c_half):
        def accumulate(a):
            if before_pv is not None:
                before_pv(c_half)
            return wg_accumulate_pv(a, p16, c_half, p_smem, cpu_check=cpu_check)
        return accumulate
    acc = lax.cond(lax.axis_index("wg") == 0, pv(c_lo), pv(c_hi), acc)
    _arrive(consumed[:2])
    return acc, m_new, l_new


def _shared_p_step(carry, *, q_ops, k_ops, c_lo, c_hi, consumed, p_smem, x_smem, p_ready,
                   p_free, softmax, cpu_check):
    """One key tile when warpgroup 0 alone computes the scores: it runs ``S`` and the online
    softmax, waits until warpgroup 1 has read the previous ``P`` (``p_free``), writes ``P`` to
    ``p_smem`` and the new row maxima to ``x_smem`` (``p_ready``); each warpgroup then runs
    ``O += P c_w`` from shared memory (warpgroup 1 first rescales by ``exp2(m - m_new)``)."""
    def pv(acc, c_half):
        return wg_accumulate(acc, lambda: (p_smem, c_half), cpu_check=cpu_check)

    def scorer(carry):
        s = _scores(q_ops, k_ops, block_kv=c_lo.shape[0], cpu_check=cpu_check)
        _arrive(consumed[2:])
        acc, m_new, l_new, p16 = softmax(s, carry)
        plgpu.barrier_wait(p_free)
        p_smem[...] = p16
        x_smem[...] = m_new
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        return pv(acc, c_lo), m_new, l_new

    def follower(carry):
        acc, m_i, l_i = carry
        _arrive(consumed[2:])
        plgpu.barrier_wait(p_ready)
        m_new = x_smem[...]
        alpha = jnp.exp2(m_i - jnp.where(m_new == -jnp.inf, 0.0, m_new))
        acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), c_hi)
        plgpu.barrier_arrive(p_free)
        return acc, m_new, l_i

    acc, m_new, l_new = lax.cond(lax.axis_index("wg") == 0, scorer, follower, carry)
    _arrive(consumed[:2])
    return acc, m_new, l_new


def _kernel(len_ref, qn_ref, qr_ref, c_ref, kr_ref, *refs, n_tiles, tiles_per_split, block_q,
            block_kv, stages, scale_log2, sched, share_p, cpu_check, **scratch):
    ct_ref, krt_ref, o_ref, lse_ref = refs if cpu_check else (None, None, *refs)
    qn_smem, x_smem, q_barrier = scratch["qn"], scratch["x"], scratch["q_barrier"]
    # With share_p on the GPU the queries' RoPE part goes through P's buffer into registers.
    rope_in_regs = share_p and not cpu_check
    qr_smem = scratch["p"] if rope_in_regs else scratch["qr"]
    mb, sp, wg = lax.axis_index("m"), lax.axis_index("s"), lax.axis_index("wg")
    half = qn_smem.shape[-1]
    rows = pl.ds(mb * block_q, block_q)
    first_tile = sp * tiles_per_split
    n_keys = jnp.clip(len_ref[0], 0, n_tiles * block_kv)
    n_steps = jnp.clip(lax.div(n_keys + block_kv - 1, block_kv) - first_tile, 0, tiles_per_split)
    turn = functools.partial(take_turn, scratch.get("turns"), sched and not share_p)
    softmax = functools.partial(_softmax, n_keys=n_keys, dtype=qn_smem.dtype,
                                scale_log2=scale_log2, cpu_check=cpu_check)

    def compute_context(run_pipeline):
        @pl.when(wg == 0)
        def _load_queries():
            for j in range(2):
                plgpu.copy_gmem_to_smem(qn_ref.at[rows, pl.ds(j * half, half)], qn_smem.at[j],
                                        q_barrier)
            plgpu.copy_gmem_to_smem(qr_ref.at[rows], qr_smem, q_barrier)
        plgpu.barrier_wait(q_barrier)
        carry = (jnp.zeros((block_q, half), jnp.float32),
                 jnp.full((block_q,), -jnp.inf, jnp.float32),
                 jnp.zeros((block_q,), jnp.float32), qr_smem[...] if rope_in_regs else None)
        if share_p:   # (after the read above: warpgroup 0 waits on it to overwrite P's buffer)
            pl.when(wg == 1)(functools.partial(plgpu.barrier_arrive, scratch["p_free"]))
        # Warpgroup 1 starts one phase behind (one extra turn before its first tile, warpgroup
        # 0 one after its last): their tensor-core and softmax phases alternate.
        pl.when(wg == 1)(turn)
        acc, m_i, l_i, _ = run_pipeline(carry)
        pl.when(wg == 0)(turn)
        if share_p:   # the row sums are warpgroup 0's: through x_smem to warpgroup 1
            @pl.when(wg == 0)
            def _send_sums():
                plgpu.barrier_wait(scratch["p_free"])
                x_smem[...] = l_i
                plgpu.commit_smem()
                plgpu.barrier_arrive(scratch["p_ready"])

            def receive_sums():
                plgpu.barrier_wait(scratch["p_ready"])
                return x_smem[...]
            l_i = lax.cond(wg == 1, receive_sums, lambda: l_i)
        empty = l_i == 0.0   # (a NaN score leaves l NaN: the row's lse is NaN, not -inf)
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        store_gmem(o_ref.at[sp, rows, pl.ds(wg * half, half)], out.astype(o_ref.dtype))
        lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)

        @pl.when(wg == (1 if share_p else 0))   # (the last reader of x_smem)
        def _store_lse():
            x_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, lse_ref.at[sp, rows])
            plgpu.wait_smem_to_gmem(0)

    def tile_body(indices, *refs):
        n_in = len(refs) // 2
        tiles, consumed, (*carry, q_rope) = refs[:n_in], refs[n_in:2 * n_in], refs[-1]
        c_lo, c_hi, kr = tiles[:3]
        k_ops = tiles[3:] if cpu_check else tuple(x.transpose((1, 0)) for x in (c_lo, c_hi, kr))
        step = functools.partial(
            _shared_p_step if share_p else dup_step, tuple(carry),
            q_ops=(qn_smem.at[0], qn_smem.at[1], q_rope if rope_in_regs else qr_smem),
            k_ops=k_ops, c_lo=c_lo, c_hi=c_hi, consumed=consumed, cpu_check=cpu_check,
            softmax=functools.partial(softmax, key0=(first_tile + indices[0]) * block_kv))
        if share_p:
            new = step(p_smem=scratch["p"], x_smem=x_smem, p_ready=scratch["p_ready"],
                       p_free=scratch["p_free"])
        else:
            new = step(p_smem=scratch["p2"].at[wg] if cpu_check else None, turn=turn,
                       sched=sched)
        return (*new, q_rope)

    dr = qr_ref.shape[-1]
    specs = [plgpu.BlockSpec(block_shape=(block_kv, half), index_map=lambda t: (first_tile + t, 0)),
             plgpu.BlockSpec(block_shape=(block_kv, half), index_map=lambda t: (first_tile + t, 1)),
             plgpu.BlockSpec(block_shape=(block_kv, dr), index_map=lambda t: (first_tile + t, 0))]
    operands = [c_ref, c_ref, kr_ref]
    if cpu_check:
        specs += [plgpu.BlockSpec(block_shape=(half, block_kv), index_map=lambda t, j=j: (j, first_tile + t))
                  for j in range(2)]
        specs.append(plgpu.BlockSpec(block_shape=(dr, block_kv), index_map=lambda t: (0, first_tile + t)))
        operands += [ct_ref, ct_ref, krt_ref]
    pipeline = wg_pipeline(tile_body, n_steps=n_steps, steps=stages,
                           compute_context=compute_context, in_specs=specs)
    pipeline(*operands)


def mla_prefix_partials(q_nope: jax.Array, q_rope: jax.Array, c: jax.Array, k_rope: jax.Array,
                        length, *, sm_scale: float, num_splits: int = 1, block_kv: int = 64,
                        num_stages: int = 2, schedule_barrier: bool = True,
                        share_p: bool = False, out_dtype=jnp.float32, zero_tail: bool = True,
                        interpret: bool = False):
    """Partial states of every query row over the prefix keys ``[0, length)``, split along them.

    Args:
      q_nope: ``[M, R]`` absorbed queries (16-bit), ``R`` a multiple of 128 up to 512; rows of
        every head of every sequence (padded to a multiple of 64 here).
      q_rope: ``[M, Dr]`` RoPE queries, ``Dr`` 64 or 128.
      c: ``[P, R]`` the shared prefix's latents (also the values); ``k_rope``: ``[P, Dr]``
        (zero-padded here to a multiple of ``block_kv`` keys when ``P`` is not one).
      length: int scalar (traced or static) valid prefix length, clamped to ``[0, P]``.
      sm_scale: score scale (a Python float).
      num_splits: key splits, one CTA per (64-row block, split), each of
        ``ceil(P / block_kv / num_splits)`` tiles (every split must get at least one).
      block_kv: keys per tile (multiple of 64); num_stages: tiles in flight (>= 2).
      schedule_barrier: the ping-pong turns of the two compute warpgroups (not with
        ``share_p``).
      share_p: warpgroup 0 alone computes the scores and hands ``P`` to warpgroup 1 through
        shared memory (no duplicated ``Q K^T``; needs ``Dr == block_kv``); see the module
        docstring.
      out_dtype: dtype of ``o`` (float32, or the inputs' 16-bit dtype).
      zero_tail: zero ``c`` at and past ``length`` first (see the module docstring).
      interpret: run Mosaic GPU's CPU interpreter.

    Returns ``(o [splits, M, R] out_dtype, lse [splits, M] float32)``.  Raises ``TypeError`` for
    non-arrays or dtypes and ``ValueError`` for shapes, splits or tiles it cannot run.
    """
    _check_operands(q_nope, q_rope, c, k_rope, out_dtype)
    for name, val in (("num_splits", num_splits), ("block_kv", block_kv),
                      ("num_stages", num_stages)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {val!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float, got {sm_scale!r}")
    m, r = q_nope.shape
    p, dr = k_rope.shape
    why = supported(rank=r, rope_dim=dr, prefix_len=p, dtype=q_nope.dtype, block_kv=block_kv,
                    num_stages=num_stages, share_p=bool(share_p), interpret=interpret)
    if why is not None:
        raise ValueError(f"mla_prefix_partials cannot run these shapes: {why}")
    n_tiles = cdiv(p, block_kv)
    tiles_per_split = cdiv(n_tiles, max(num_splits, 1))
    if not 1 <= num_splits <= n_tiles or (num_splits - 1) * tiles_per_split >= n_tiles:
        raise ValueError(f"num_splits={num_splits} must leave every split some of the {n_tiles} "
                         f"key tiles (each takes {tiles_per_split})")
    if getattr(length, "shape", ()) not in ((), (1,)):
        raise ValueError(f"length must be a scalar, got shape {tuple(length.shape)}")
    if not jnp.issubdtype(jnp.asarray(length).dtype, jnp.integer):
        raise TypeError(f"length must be an integer, got {jnp.asarray(length).dtype}")
    length = jnp.clip(jnp.asarray(length, jnp.int32).reshape(1), 0, p)
    c, k_rope = pad_axis(c, 0, n_tiles * block_kv), pad_axis(k_rope, 0, n_tiles * block_kv)
    if zero_tail:
        c = jnp.where((jnp.arange(n_tiles * block_kv, dtype=jnp.int32) < length[0])[:, None], c,
                      jnp.zeros((), c.dtype))
    block_q = 64
    m_pad = cdiv(m, block_q) * block_q
    q_nope, q_rope = pad_axis(q_nope, 0, m_pad), pad_axis(q_rope, 0, m_pad)
    operands = [length, q_nope, q_rope, c, k_rope]
    if interpret:   # the interpreter's wgmma reads K^T from memory
        operands += [c.T, k_rope.T]
    kernel = functools.partial(
        _kernel, n_tiles=n_tiles, tiles_per_split=tiles_per_split, block_q=block_q,
        block_kv=block_kv, stages=num_stages, scale_log2=float(sm_scale) * LOG2E,
        sched=bool(schedule_barrier), share_p=bool(share_p), cpu_check=bool(interpret))
    dtype = q_nope.dtype
    scratch = {"qn": plgpu.SMEM((2, block_q, r // 2), dtype),
               "x": plgpu.SMEM((block_q,), jnp.float32), "q_barrier": plgpu.Barrier(num_arrivals=3)}
    if not share_p or interpret:
        scratch["qr"] = plgpu.SMEM((block_q, dr), dtype)
    if share_p:
        scratch.update(p=plgpu.SMEM((block_q, block_kv), dtype),
                       p_ready=plgpu.Barrier(num_arrivals=1), p_free=plgpu.Barrier(num_arrivals=1))
    else:
        scratch["turns"] = plgpu.Barrier(num_arrivals=2)
        if interpret:
            scratch["p2"] = plgpu.SMEM((2, block_q, block_kv), dtype)
    o, lse = plgpu.kernel(
        kernel,
        grid=(m_pad // block_q, num_splits),
        grid_names=("m", "s"),
        num_threads=3,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((num_splits, m_pad, r), jnp.dtype(out_dtype)),
                  jax.ShapeDtypeStruct((num_splits, m_pad), jnp.float32)),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(*operands)
    return o[:, :m], lse[:, :m]


def mla_prefix_attention(q_nope, q_rope, c, k_rope, length, *, sm_scale: float, **kwargs):
    """:func:`mla_prefix_partials` with its splits merged: ``(o [M, R] float32, lse [M]
    float32)``, the prefix part's state to merge with the suffix part through the LSE."""
    o, lse = mla_prefix_partials(q_nope, q_rope, c, k_rope, length, sm_scale=sm_scale, **kwargs)
    return merge_partials(o.astype(jnp.float32), lse)
