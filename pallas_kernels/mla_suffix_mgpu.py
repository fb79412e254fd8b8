"""The suffix part of absorbed multi-head latent attention (MLA, DeepSeek-V2/V3) decoding through
Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation): the query rows of every head of each
sequence against that sequence's own latent suffix.

As in :mod:`pallas_kernels.mla_prefix_mgpu`, every head reads the same cache, one latent
``c [R]`` and one RoPE key ``k_rope [Dr]`` per token, so sequence ``b``'s ``M = Tq * H`` query
rows (row ``t * H + h``: query position ``t``, head ``h``) are one matrix over its suffix:

    s = sm_scale * (q_nope . c + q_rope . k_rope),   o = sum_j softmax(s)_j c_j   ([R] per row)

Layouts: ``q_nope [B, M, R]``, ``q_rope [B, M, Dr]``, ``c [B, S, R]``, ``k_rope [B, S, Dr]``
(16-bit, one dtype), ``lengths [B]`` (traced; clamped to ``[0, S]``).  Query position ``t`` of
``Tq`` (``seq_q``) sees the keys ``j < clip(n - Tq + t + 1, 0, n)`` of its sequence's ``n``
(the causal mask bottom-right aligned on the valid suffix, as
:func:`jax_prefix_attn.reference.row_limits`); in decoding (``Tq = 1``) every row sees ``[0, n)``.
:func:`mla_suffix_partials` returns the partial states of ``num_splits`` key splits,
``o [splits, B, M, R]`` (``out_dtype``, float32 by default, normalised) and
``lse [splits, B, M]`` float32 natural log (``-inf`` and ``o = 0`` where a row sees no key of the
split), to be merged with each other and with the prefix part (``merge_attention_states``);
:func:`mla_suffix_attention` merges the splits.

Design: the prefix kernel's CTA, one per (64-row block, key split, sequence), the row blocks of
one sequence adjacent in the grid (consecutive CTAs read the same suffix: the second read of a
tile is an L2 hit when ``M > 64``).  Two compute warpgroups own the same 64 rows and split the
value columns (``64 x R/2`` float32 each), both compute the scores and take ping-pong turns on
the tensor cores (``schedule_barrier``); a memory warpgroup streams the sequence's tiles
``c_lo, c_hi [block_kv, R/2]`` and ``k_rope [block_kv, Dr]`` through ``num_stages`` buffers, only
the tiles that hold a key ``< n`` (the step count is read from ``lengths`` in the kernel: a short
sequence costs only its own tiles).  Shared memory as the prefix kernel
(:func:`pallas_kernels.mla_prefix_mgpu.smem_bytes`).

The suffix is memory-bound (each sequence's cache is read once for all its rows), so it is not
zeroed past the lengths by a pass over the cache: the tile that holds a sequence's length is read
whole, and each compute warpgroup zeroes its value half's rows at and past the length in shared
memory before ``P c`` (``0 * NaN`` would otherwise leak a NaN stored there).  The other
warpgroup may read those rows at the same time for its scores; they are masked keys, so what it
reads never reaches a result.  ``NaN`` in ``k_rope`` past the length is masked out of the scores.
A NaN in a key that only later query positions see also makes the earlier rows NaN (their
weight 0 times the NaN), as in :func:`jax_prefix_attn.mla_reference.latent_part`.

Padding: rows to a multiple of 64 per sequence and ``S`` to a multiple of ``block_kv`` (a copy of
the cache: give ``S`` a multiple of ``block_kv`` to avoid it).

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter with the operand forms it
has: the keys pre-transposed in memory for ``Q K^T`` and ``P`` staged through shared memory.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import LN2, LOG2E, cdiv, merge_partials, pad_axis
from pallas_kernels.mgpu_compat import gpu_interpret_params, plgpu, store_gmem
from pallas_kernels.mla_prefix_mgpu import (SMEM_LIMIT, SUPPORTED_DTYPES,
                                            check_operand_types, dup_step, smem_bytes)
from pallas_kernels.prefix_attention_mgpu import (masked_softmax_step, take_turn, wg_pipeline,
                                                  wgmma_iota)

__all__ = ["mla_suffix_partials", "mla_suffix_attention", "supported"]

BLOCK_Q = 64   # query rows per CTA (one wgmma row block per compute warpgroup)


def supported(*, rank: int, rope_dim: int, suffix_cap: int, dtype, block_kv: int = 64,
              num_stages: int = 2, interpret: bool = False) -> str | None:
    """``None`` when the kernel runs these static shapes and tiles, else the reason it cannot."""
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not available"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if rank % 128 or not 128 <= rank <= 512:
        return f"kv_lora_rank R must be a multiple of 128 in [128, 512], got {rank}"
    if rope_dim not in (64, 128):
        return f"rope_dim Dr must be 64 or 128, got {rope_dim}"
    if block_kv % 64 or not 64 <= block_kv <= 256:
        return f"block_kv must be a multiple of 64 in [64, 256], got {block_kv}"
    if num_stages < 2:
        return f"num_stages must be at least 2, got {num_stages}"
    if suffix_cap < 1:
        return f"suffix capacity S must be positive, got {suffix_cap}"
    need = smem_bytes(rank, rope_dim, dtype, block_q=BLOCK_Q, block_kv=block_kv,
                      num_stages=num_stages, interpret=interpret)
    if need > SMEM_LIMIT:
        return (f"block_kv={block_kv}, num_stages={num_stages} at R={rank}, Dr={rope_dim} need "
                f"{need} bytes of shared memory, more than the {SMEM_LIMIT} of a Hopper SM")
    return None


def _check_operands(q_nope, q_rope, c, k_rope, lengths, seq_q, out_dtype):
    check_operand_types((("q_nope", q_nope, "[B, M, R]"), ("q_rope", q_rope, "[B, M, Dr]"),
                         ("c", c, "[B, S, R]"), ("k_rope", k_rope, "[B, S, Dr]")), rank=3)
    b, m, r = q_nope.shape
    s, dr = c.shape[1], q_rope.shape[2]
    if q_rope.shape[:2] != (b, m):
        raise ValueError(f"q_rope must have q_nope's [B, M] = {(b, m)}, got shape "
                         f"{tuple(q_rope.shape)}")
    if b < 1 or m < 1:
        raise ValueError(f"q_nope must have at least one sequence and row, got shape "
                         f"{tuple(q_nope.shape)}")
    if c.shape[0] != b or c.shape[2] != r:
        raise ValueError(f"c must have shape (B, S, R) with q_nope's B={b} and kv_lora_rank "
                         f"R={r}, got {tuple(c.shape)}")
    if k_rope.shape != (b, s, dr):
        raise ValueError(f"k_rope must have shape (B, S, Dr) = {(b, s, dr)} (c's batch and "
                         f"suffix capacity, q_rope's width), got {tuple(k_rope.shape)}")
    if isinstance(seq_q, bool) or not isinstance(seq_q, int) or seq_q < 1 or m % seq_q:
        raise ValueError(f"seq_q must be a positive int dividing the {m} rows per sequence "
                         f"(M = seq_q * heads), got {seq_q!r}")
    if getattr(lengths, "shape", None) != (b,):
        raise ValueError(f"lengths must have shape ({b},), got "
                         f"{getattr(lengths, 'shape', type(lengths).__name__)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be integers, got {lengths.dtype}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32),) + SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")


def _softmax(s, carry, *, key0, n_keys, row0, seq_q, heads, dtype, scale_log2, cpu_check):
    """The online-softmax step of the tile whose first key is ``key0``.  Row ``row0 + i`` is
    query position ``t = (row0 + i) // heads``, which sees the keys ``j < n - seq_q + t + 1``
    and ``j < n``; ``t >= j - n + seq_q`` is ``row >= (j - n + seq_q) * heads`` (no division).
    The mask is built only on a tile that holds a masked key."""
    rows, block_kv = s.shape

    def valid():
        keys = key0 + wgmma_iota((rows, block_kv), 1, hint=not cpu_check)
        ok = keys < n_keys
        if seq_q > 1:
            row = row0 + wgmma_iota((rows, block_kv), 0, hint=not cpu_check)
            ok = ok & (row >= (keys - n_keys + seq_q) * heads)
        return ok
    return masked_softmax_step(s, valid, key0 + block_kv > n_keys - (seq_q - 1), carry,
                               scale_log2=scale_log2, dtype=dtype)


_ZERO_COLS = 64   # columns zeroed at a time: 16 registers per thread next to the accumulator


def _zero_past_length(c_half, key0, n_keys, cpu_check):
    """Zero the rows of the latent tile ``c_half [block_kv, R/2]`` (first key ``key0``) at and
    past ``n_keys``, on the tile that holds the length, ``_ZERO_COLS`` columns at a time."""
    @pl.when(key0 + c_half.shape[0] > n_keys)
    def _():
        shape = (c_half.shape[0], _ZERO_COLS)
        keep = key0 + wgmma_iota(shape, 0, hint=not cpu_check) < n_keys
        for j in range(c_half.shape[1] // _ZERO_COLS):
            part = c_half.at[:, pl.ds(j * _ZERO_COLS, _ZERO_COLS)]
            part[...] = jnp.where(keep, part[...], jnp.zeros((), c_half.dtype))
        plgpu.commit_smem()


def _kernel(len_ref, qn_ref, qr_ref, c_ref, kr_ref, *refs, n_tiles, tiles_per_split, n_blk,
            seq_q, heads, block_kv, stages, scale_log2, sched, cpu_check, **scratch):
    ct_ref, krt_ref, o_ref, lse_ref = refs if cpu_check else (None, None, *refs)
    qn_smem, qr_smem, x_smem = scratch["qn"], scratch["qr"], scratch["x"]
    mb, sp, b = lax.axis_index("m"), lax.axis_index("s"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    half = qn_smem.shape[-1]
    rows = pl.ds((b * n_blk + mb) * BLOCK_Q, BLOCK_Q)
    first_tile = sp * tiles_per_split
    tile0 = b * n_tiles + first_tile      # the split's first tile in the flattened cache
    n_keys = len_ref[b]
    n_steps = jnp.clip(lax.div(n_keys + block_kv - 1, block_kv) - first_tile, 0, tiles_per_split)
    turn = functools.partial(take_turn, scratch.get("turns"), sched)
    softmax = functools.partial(_softmax, n_keys=n_keys, row0=mb * BLOCK_Q, seq_q=seq_q,
                                heads=heads, dtype=qn_smem.dtype, scale_log2=scale_log2,
                                cpu_check=cpu_check)

    def compute_context(run_pipeline):
        @pl.when(wg == 0)
        def _load_queries():
            for j in range(2):
                plgpu.copy_gmem_to_smem(qn_ref.at[rows, pl.ds(j * half, half)], qn_smem.at[j],
                                        scratch["q_barrier"])
            plgpu.copy_gmem_to_smem(qr_ref.at[rows], qr_smem, scratch["q_barrier"])
        plgpu.barrier_wait(scratch["q_barrier"])
        carry = (jnp.zeros((BLOCK_Q, half), jnp.float32),
                 jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK_Q,), jnp.float32))
        # Warpgroup 1 starts one phase behind (one extra turn before its first tile, warpgroup
        # 0 one after its last): their tensor-core and softmax phases alternate.
        pl.when(wg == 1)(turn)
        acc, m_i, l_i = run_pipeline(carry)
        pl.when(wg == 0)(turn)
        empty = l_i == 0.0   # (a NaN score leaves l NaN: the row's lse is NaN, not -inf)
        l_safe = jnp.where(empty, 1.0, l_i)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        store_gmem(o_ref.at[sp, rows, pl.ds(wg * half, half)], out.astype(o_ref.dtype))

        @pl.when(wg == 0)
        def _store_lse():
            x_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, lse_ref.at[sp, rows])
            plgpu.wait_smem_to_gmem(0)

    def tile_body(indices, *refs):
        n_in = len(refs) // 2
        tiles, consumed, carry = refs[:n_in], refs[n_in:2 * n_in], refs[-1]
        c_lo, c_hi, kr = tiles[:3]
        k_ops = tiles[3:] if cpu_check else tuple(x.transpose((1, 0)) for x in (c_lo, c_hi, kr))
        key0 = (first_tile + indices[0]) * block_kv
        return dup_step(tuple(carry), q_ops=(qn_smem.at[0], qn_smem.at[1], qr_smem), k_ops=k_ops,
                        c_lo=c_lo, c_hi=c_hi, consumed=consumed,
                        p_smem=scratch["p2"].at[wg] if cpu_check else None, turn=turn,
                        sched=sched, softmax=functools.partial(softmax, key0=key0),
                        cpu_check=cpu_check,
                        before_pv=functools.partial(_zero_past_length, key0=key0, n_keys=n_keys,
                                                    cpu_check=cpu_check))

    dr = qr_ref.shape[-1]
    specs = [plgpu.BlockSpec(block_shape=(block_kv, half), index_map=lambda t: (tile0 + t, 0)),
             plgpu.BlockSpec(block_shape=(block_kv, half), index_map=lambda t: (tile0 + t, 1)),
             plgpu.BlockSpec(block_shape=(block_kv, dr), index_map=lambda t: (tile0 + t, 0))]
    operands = [c_ref, c_ref, kr_ref]
    if cpu_check:
        specs += [plgpu.BlockSpec(block_shape=(half, block_kv),
                                  index_map=lambda t, j=j: (j, tile0 + t)) for j in range(2)]
        specs.append(plgpu.BlockSpec(block_shape=(dr, block_kv),
                                     index_map=lambda t: (0, tile0 + t)))
        operands += [ct_ref, ct_ref, krt_ref]
    pipeline = wg_pipeline(tile_body, n_steps=n_steps, steps=stages,
                           compute_context=compute_context, in_specs=specs)
    pipeline(*operands)


def mla_suffix_partials(q_nope: jax.Array, q_rope: jax.Array, c: jax.Array, k_rope: jax.Array,
                        lengths, *, sm_scale: float, seq_q: int = 1, num_splits: int = 1,
                        block_kv: int = 64, num_stages: int = 2, schedule_barrier: bool = True,
                        out_dtype=jnp.float32, interpret: bool = False):
    """Partial states of each sequence's query rows over its own suffix keys, split along them.

    Args:
      q_nope: ``[B, M, R]`` absorbed queries (16-bit), ``R`` a multiple of 128 up to 512; row
        ``t * H + h`` of sequence ``b`` is query position ``t`` of head ``h`` (``M = seq_q * H``;
        padded to a multiple of 64 here).
      q_rope: ``[B, M, Dr]`` RoPE queries, ``Dr`` 64 or 128.
      c: ``[B, S, R]`` each sequence's suffix latents (also the values); ``k_rope``:
        ``[B, S, Dr]`` (zero-padded here to a multiple of ``block_kv`` keys when ``S`` is not
        one).
      lengths: int ``[B]`` (traced) valid suffix lengths, clamped to ``[0, S]``.
      sm_scale: score scale (a Python float).
      seq_q: query positions per sequence ``Tq``, causal among themselves (bottom-right
        aligned on each sequence's length).
      num_splits: key splits, one CTA per (64-row block, split, sequence), each of
        ``ceil(S / block_kv / num_splits)`` tiles (every split must get at least one).
      block_kv: keys per tile (multiple of 64); num_stages: tiles in flight (>= 2).
      schedule_barrier: the ping-pong turns of the two compute warpgroups.
      out_dtype: dtype of ``o`` (float32, or the inputs' 16-bit dtype).
      interpret: run Mosaic GPU's CPU interpreter.

    Returns ``(o [splits, B, M, R] out_dtype, lse [splits, B, M] float32)``.  Raises
    ``TypeError`` for non-arrays or dtypes and ``ValueError`` for shapes, splits or tiles it
    cannot run.
    """
    lengths = jnp.asarray(lengths) if hasattr(lengths, "shape") else lengths
    _check_operands(q_nope, q_rope, c, k_rope, lengths, seq_q, out_dtype)
    for name, val in (("num_splits", num_splits), ("block_kv", block_kv),
                      ("num_stages", num_stages)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {val!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float, got {sm_scale!r}")
    b, m, r = q_nope.shape
    s, dr = k_rope.shape[1:]
    why = supported(rank=r, rope_dim=dr, suffix_cap=s, dtype=q_nope.dtype, block_kv=block_kv,
                    num_stages=num_stages, interpret=interpret)
    if why is not None:
        raise ValueError(f"mla_suffix_partials cannot run these shapes: {why}")
    n_tiles = cdiv(s, block_kv)
    tiles_per_split = cdiv(n_tiles, max(num_splits, 1))
    if not 1 <= num_splits <= n_tiles or (num_splits - 1) * tiles_per_split >= n_tiles:
        raise ValueError(f"num_splits={num_splits} must leave every split some of the {n_tiles} "
                         f"key tiles (each takes {tiles_per_split})")
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)
    s_pad, n_blk = n_tiles * block_kv, cdiv(m, BLOCK_Q)
    m_pad = n_blk * BLOCK_Q
    c = pad_axis(c, 1, s_pad).reshape(b * s_pad, r)
    k_rope = pad_axis(k_rope, 1, s_pad).reshape(b * s_pad, dr)
    q_nope = pad_axis(q_nope, 1, m_pad).reshape(b * m_pad, r)
    q_rope = pad_axis(q_rope, 1, m_pad).reshape(b * m_pad, dr)
    operands = [lengths, q_nope, q_rope, c, k_rope]
    if interpret:   # the interpreter's wgmma reads K^T from memory
        operands += [c.T, k_rope.T]
    kernel = functools.partial(
        _kernel, n_tiles=n_tiles, tiles_per_split=tiles_per_split, n_blk=n_blk, seq_q=seq_q,
        heads=m // seq_q, block_kv=block_kv, stages=num_stages,
        scale_log2=float(sm_scale) * LOG2E, sched=bool(schedule_barrier),
        cpu_check=bool(interpret))
    dtype = q_nope.dtype
    scratch = {"qn": plgpu.SMEM((2, BLOCK_Q, r // 2), dtype),
               "qr": plgpu.SMEM((BLOCK_Q, dr), dtype), "x": plgpu.SMEM((BLOCK_Q,), jnp.float32),
               "q_barrier": plgpu.Barrier(num_arrivals=3), "turns": plgpu.Barrier(num_arrivals=2)}
    if interpret:
        scratch["p2"] = plgpu.SMEM((2, BLOCK_Q, block_kv), dtype)
    o, lse = plgpu.kernel(
        kernel,
        grid=(n_blk, num_splits, b),
        grid_names=("m", "s", "b"),
        num_threads=3,
        thread_name="wg",
        out_type=(jax.ShapeDtypeStruct((num_splits, b * m_pad, r), jnp.dtype(out_dtype)),
                  jax.ShapeDtypeStruct((num_splits, b * m_pad), jnp.float32)),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )(*operands)
    o = o.reshape(num_splits, b, m_pad, r)[:, :, :m]
    return o, lse.reshape(num_splits, b, m_pad)[:, :, :m]


def mla_suffix_attention(q_nope, q_rope, c, k_rope, lengths, *, sm_scale: float, **kwargs):
    """:func:`mla_suffix_partials` with its splits merged: ``(o [B, M, R] float32, lse [B, M]
    float32)``, the suffix part's state to merge with the prefix part through the LSE."""
    o, lse = mla_suffix_partials(q_nope, q_rope, c, k_rope, lengths, sm_scale=sm_scale, **kwargs)
    return merge_partials(o.astype(jnp.float32), lse)
