"""Suffix decode with the fused merge, in the queries' own layout (Pallas, Triton lowering).

Launch 2 of the shared path when decoding (``Tq == 1``) with one program per (kv head,
sequence): the program attends its sequence's suffix keys, merges the prefix partial states
computed by launch 1 in its epilogue, and writes the final output and LSE.  With a pool span
(the prefix) and key splits (grid ``(Hkv, B, splits)``, float32 partial states per split) it is
also the flat path's own-layout decode kernel and the suffix pass beside the Mosaic GPU prefix
kernel.

Unlike the general row-layout kernel (:func:`pallas_kernels.decode_attention.ragged_attention`),
which takes queries as ``[Hkv, M, D]`` rows padded to 16 per sequence and writes outputs in
that layout, this kernel reads ``q`` and writes ``out``/``lse`` where they live,
``[B * Hq, D]`` (row ``b * Hq + h * G + j`` is query head ``h * G + j`` of sequence ``b``,
``G = Hq / Hkv``): the 16-row tile of a program starts at its group's first head, rows ``>= G``
of the tile are masked on load and store.  The padded layout costs two extra XLA passes (a pad
of ``q`` to 16 rows per sequence and a transpose of the output) and ``16 / G`` times the query
and output traffic inside the kernel (4x at ``G = 4``); their times:
``docs/performance.md``, "Kernel design measurements".

Masked rows past the last sequence are never touched on the GPU; in interpret mode (where a
slice that runs past an array is clamped, not masked) ``q`` and the outputs carry ``R - G``
padding rows at the end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_attention import supported as _da_supported
from pallas_kernels._common import (LOG2E, attend_pool, finish_state, merge_tile_states,
                                    next_pow2, online_update, split_chunk)

__all__ = ["suffix_decode_merge", "suffix_rows", "supported"]


def supported(*, head_dim: int, dtype) -> str | None:
    """``None`` when :func:`suffix_decode_merge` takes ``head_dim`` and ``dtype``, else the reason
    (the conditions of :func:`pallas_kernels.decode_attention.supported`)."""
    return _da_supported(head_dim=head_dim, dtype=dtype)



def suffix_rows(hq: int, hkv: int) -> int:
    """Rows of one program's tile: the ``G = Hq / Hkv`` query heads of a kv head, padded to a
    power of two of at least 16 (the dot's minimum)."""
    return max(16, next_pow2(hq // hkv))


def _attend_span(q, kp_ref, vp_ref, h, start, n, carry, *, block_k, scale_log2, precision):
    """Online-softmax accumulation of rows ``q [R, D]`` over the pool keys
    ``kp_ref[start + j, h]``, ``j < n`` (any ``start``: tiles need not be aligned; loads past
    ``n`` are masked).  ``carry = (acc, m (log2 units), l)`` float32."""
    cols = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    keys = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

    def body(t, c):
        j0 = t * block_k
        ks = pl.ds(start + j0, block_k)
        ok = (j0 + keys) < n
        k = plgpu.load(kp_ref.at[ks, h, :], mask=ok, other=0.0)
        v = plgpu.load(vp_ref.at[ks, h, :], mask=ok, other=0.0)
        return online_update(q, k, v, c, scale_log2=scale_log2, precision=precision,
                             col_ok=(j0 + cols) < n)

    return lax.fori_loop(0, (n + block_k - 1) // block_k, body, carry)


def _kernel(*refs, hq, grp, rows, strides, has_pos, has_span, block_k, seq_len, scale_log2,
            precision, out_dtype, splits, span_chunk, span_max, suffix_chunk):
    it = iter(refs)
    q_ref, len_ref = next(it), next(it)
    if has_span:
        st_ref, sn_ref, kp_ref, vp_ref = next(it), next(it), next(it), next(it)
    k_ref, v_ref = next(it), next(it)
    inc = []
    for hp in has_pos:
        o_in_ref, lse_in_ref = next(it), next(it)
        inc.append((o_in_ref, lse_in_ref, next(it) if hp else None))
    o_ref, lse_ref = next(it), next(it)
    h = pl.program_id(0)
    b = pl.program_id(1)
    sp = pl.program_id(2)  # key split: chunk ``sp`` of the span and of the suffix
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    ok = r < grp
    q_rows = pl.ds(b * hq + h * grp, rows)
    q = plgpu.load(q_ref.at[q_rows, :], mask=ok[:, None], other=0.0)
    d = q.shape[-1]
    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if has_span:  # the pool span first (the softmax state does not care about key order)
        s0 = sp * span_chunk
        n_span = jnp.clip(jnp.minimum(jnp.max(sn_ref[...]), span_max) - s0, 0, span_chunk)
        # (the start is always read from memory: with a start known to the compiler, e.g. 0,
        # Triton builds a slower loop; docs/performance.md, "Kernel design measurements")
        carry = _attend_span(q, kp_ref, vp_ref, h, jnp.max(st_ref[...]) + s0, n_span,
                             carry, block_k=block_k, scale_log2=scale_log2, precision=precision)
    n = jnp.max(len_ref[...])  # keys of this sequence's suffix
    acc, m_i, l_i = attend_pool(q, jnp.broadcast_to(b, (rows,)), jnp.broadcast_to(n, (rows,)),
                                k_ref, v_ref, h, sp * suffix_chunk, carry, chunk=suffix_chunk,
                                block_k=block_k, seq_len=seq_len, scale_log2=scale_log2,
                                precision=precision)
    o_own, lse_own = finish_state(acc, m_i, l_i)
    if splits > 1:  # float32 partial state of this split (merged by the caller)
        plgpu.store(o_ref.at[q_rows, :], o_own, mask=ok[:, None])
        plgpu.store(lse_ref.at[q_rows], lse_own, mask=ok)
        return
    if inc:
        o_parts, l_parts = [o_own], [lse_own]
        for (o_in_ref, lse_in_ref, pos_ref), stride in zip(inc, strides):
            pos = b if pos_ref is None else jnp.max(pos_ref[...])
            p_rows = pl.ds(pos * stride, rows)
            for i in range(o_in_ref.shape[0]):  # only the G real rows are read
                i = jnp.int32(i)  # (an array index: interpret mode's masked load needs a shape)
                o_parts.append(plgpu.load(o_in_ref.at[i, p_rows, :], mask=ok[:, None],
                                          other=0.0))
                l_parts.append(plgpu.load(lse_in_ref.at[i, p_rows], mask=ok, other=-jnp.inf))
        o_own, lse_own = merge_tile_states(o_parts, l_parts)
    plgpu.store(o_ref.at[q_rows, :], o_own.astype(out_dtype), mask=ok[:, None])
    plgpu.store(lse_ref.at[q_rows], lse_own, mask=ok)


def suffix_decode_merge(q_bhd, suffix_k, suffix_v, lengths_b, incoming=None, *, in_stride=0,
                        position_b=None, span=None, span_max=None, num_splits=1, scale,
                        block_k=32, num_warps=2, num_stages=3, interpret=False):
    """Decode attention of each sequence over its suffix (and optionally a span of a shared KV
    pool), merged with incoming partial states.

    Args:
      q_bhd: ``[B, Hq, D]`` one query per sequence (16-bit or float32).
      suffix_k, suffix_v: ``[B, S, Hkv, D]``; sequence ``b`` sees keys ``[0, lengths_b[b])``
        (``S`` may be 0).
      lengths_b: ``[B]`` int32 (dynamic).
      incoming: optional partial states merged in the epilogue: either one pair
        ``(o [n_in, Hkv, M_in, D], lse [n_in, Hkv, M_in])`` laid out by ``in_stride`` and
        ``position_b``, or a list of ``(o, lse, stride, position_b or None)`` (several sources
        in different layouts).  ``o`` normalised, any float dtype; ``lse`` float32, natural
        log, ``-inf`` for none.  Query head ``h * G + j`` of sequence ``b`` is row
        ``position_b[b] * stride + j`` (``position_b`` default: ``b``); a program reads
        ``suffix_rows(Hq, Hkv)`` rows from there, so ``M_in >= (B - 1) * stride + R``.
      span: optional ``(k_pool, v_pool [N, Hkv, D], start_b [B], len_b [B])`` (int32,
        dynamic): sequence ``b`` also attends the pool keys ``[start_b[b], start_b[b] +
        len_b[b])`` (e.g. a tree node only it reads), read where they live.  ``start_b`` and
        ``len_b`` may each have shape ``[1]`` (the same for every sequence, e.g. one shared
        prefix): then no per-sequence array has to be built for the call (on the GPU each would
        be one more XLA launch before this one).
      span_max: static bound on ``len_b`` (default: the pool size ``N``); it sets the span's
        chunk per key split, and longer spans are cut to it.
      num_splits: static; the span's and the suffix's keys are each cut into ``num_splits``
        chunks (multiples of ``block_k``), one per program (grid ``(Hkv, B, num_splits)``:
        flash-decoding when ``B * Hkv`` programs cannot fill the GPU; chunks past a sequence's
        lengths run no iterations).  With more than one split the kernel returns float32
        partial states ``(o [num_splits, B, Hq, D], lse [num_splits, B, Hq])`` for the caller
        to merge (``incoming`` must then be None).
      scale: score scale.  ``block_k``: key tile (power of two >= 16).

    Returns ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32)``; a row with no visible key
    (empty suffix and span, no incoming state) gets ``out = 0``, ``lse = -inf``.
    """
    b, hq, d = q_bhd.shape
    _, s_len, hkv, _ = suffix_k.shape
    if s_len == 0:  # no suffix axis: one key nobody sees (the kernel needs a non-empty axis)
        suffix_k = suffix_v = jnp.zeros((b, 1, hkv, d), suffix_k.dtype)
        lengths_b = jnp.zeros((b,), jnp.int32)
        s_len = 1
    grp = hq // hkv
    rows = suffix_rows(hq, hkv)
    if incoming is None:
        sources = []
    elif isinstance(incoming, tuple) and len(incoming) == 2:
        sources = [(incoming[0], incoming[1], in_stride, position_b)]
    else:
        sources = [tuple(x) for x in incoming]
    for o_in, lse_in, stride, _ in sources:
        need = (b - 1) * stride + rows
        assert o_in.ndim == 4 and lse_in.ndim == 3 and o_in.shape[2] >= need, (o_in.shape, need)
    splits = int(num_splits)
    assert splits >= 1 and (splits == 1 or not sources), (splits, len(sources))
    suffix_chunk = split_chunk(s_len, splits, block_k)
    span_chunk = n_max = 0
    if span is not None:
        n_max = int(span[0].shape[0] if span_max is None else span_max)
        span_chunk = split_chunk(n_max, splits, block_k)
    pad = rows - grp if interpret else 0  # see the module docstring
    q2 = q_bhd.reshape(b * hq, d)
    if pad:
        q2 = jnp.pad(q2, ((0, pad), (0, 0)))
    precision = lax.Precision.HIGHEST if q_bhd.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _kernel, hq=hq, grp=grp, rows=rows, strides=tuple(int(s[2]) for s in sources),
        has_pos=tuple(s[3] is not None for s in sources), has_span=span is not None,
        block_k=block_k, seq_len=s_len, scale_log2=float(scale) * LOG2E, precision=precision,
        out_dtype=q_bhd.dtype, splits=splits, span_chunk=span_chunk, span_max=n_max,
        suffix_chunk=suffix_chunk)
    whole = lambda x: pl.BlockSpec(x.shape, lambda h, i, s, n=x.ndim: (0,) * n)  # noqa: E731
    one = pl.BlockSpec((1,), lambda h, i, s: (i,))
    args = [q2, lengths_b.astype(jnp.int32).reshape(b)]
    in_specs = [whole(q2), one]
    if span is not None:
        kp, vp, st, sn = span
        assert kp.shape == vp.shape and kp.ndim == 3 and kp.shape[1:] == (hkv, d), kp.shape
        if interpret:  # the CPU interpreter clamps a slice that runs past the pool (see above)
            kp = jnp.pad(kp, ((0, block_k), (0, 0), (0, 0)))
            vp = jnp.pad(vp, ((0, block_k), (0, 0), (0, 0)))
        for x in (st, sn):  # [B], or [1]: the same for every sequence
            n_x = 1 if x.shape == (1,) else b
            args.append(x.astype(jnp.int32).reshape(n_x))
            in_specs.append(one if n_x == b else pl.BlockSpec((1,), lambda h, i, s: (0,)))
        args += [kp, vp]
        in_specs += [whole(kp), whole(vp)]
    args += [suffix_k, suffix_v]
    in_specs += [whole(suffix_k), whole(suffix_v)]
    for o_in, lse_in, _, pos in sources:
        n_in, _, m_in, _ = o_in.shape
        in_specs += [pl.BlockSpec((n_in, None, m_in, d), lambda h, i, s: (0, h, 0, 0)),
                     pl.BlockSpec((n_in, None, m_in), lambda h, i, s: (0, h, 0))]
        args += [o_in, lse_in]
        if pos is not None:
            in_specs.append(one)
            args.append(pos.astype(jnp.int32).reshape(b))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b * hq + pad, d), q_bhd.dtype),
                     jax.ShapeDtypeStruct((b * hq + pad,), jnp.float32)]
        out_specs = [whole(out_shape[0]), whole(out_shape[1])]
    else:  # split s writes its own [B * Hq(, D)] slab of the partials
        out_shape = [jax.ShapeDtypeStruct((splits, b * hq + pad, d), jnp.float32),
                     jax.ShapeDtypeStruct((splits, b * hq + pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, b * hq + pad, d), lambda h, i, s: (s, 0, 0)),
                     pl.BlockSpec((None, b * hq + pad), lambda h, i, s: (s, 0))]
    out, lse = pl.pallas_call(
        kernel, grid=(hkv, b, splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="suffix_decode_merge" if splits == 1 else "split_decode_partials",
    )(*args)
    if splits > 1:
        return (out[:, :b * hq].reshape(splits, b, hq, d),
                lse[:, :b * hq].reshape(splits, b, hq))
    if pad:
        out, lse = out[:b * hq], lse[:b * hq]
    return out.reshape(b, hq, d), lse.reshape(b, hq)
