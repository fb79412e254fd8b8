"""Backward pass of inter-sequence batched prefix attention (Pallas, Triton lowering): the
gradients of the *prefix part* of shared-prefix attention, given the statistics of the whole
attention (prefix and suffix merged).

Why it exists: with ``out = merge(prefix part, suffix part)`` and the merged ``lse``, the
gradient of each part is a flash-attention backward evaluated with the *merged* statistics
(FlashAttention-2's ``p_ij = exp(s_ij - lse_i)``, ``ds_ij = p_ij (dp_ij - delta_i)``,
``delta_i = rowsum(dO_i * O_i) - dlse_i``): the parts need no state of their own, and the
merge has no backward pass of its own.  The suffix part is an ordinary causal flash backward
(:func:`pallas_kernels.flash_attention.flash_attention_bwd`).  The prefix part differs in the
way its forward does: every sequence that shares a prefix reads the same keys, so

* ``dK``/``dV`` of a prefix are sums over the rows of *all* its sequences: one program per
  (key block, group, kv head) loops over the rows of that group (rows sorted by group, so a
  group's rows are one contiguous range) and over the ``Hq / Hkv`` query heads of the kv head;
  when those programs are too few to fill the GPU the rows are split across programs too
  (``row_splits``; float32 partials summed by one XLA reduction);
* ``dQ``: one program per (row block, query head) loops over the key blocks of the group(s)
  its rows belong to (split across programs too when those are few, ``key_splits``: at a
  decode step the rows are one or two blocks).

Rows are ``(sequence, query position)`` pairs, ``R = B * Tq``, with a per-row key limit
``lim [B, Tq]`` (query ``i`` of sequence ``b`` sees prefix keys ``j < lim[b, i]``: bottom-right
causal masking on the concatenation, see :mod:`jax_prefix_attn.shared_prefix`), so ``Tq > 1``
(suffix prefill, draft verification) and queries that fall inside the prefix are handled by the
same mask.  Keys at or past the limit never contribute, whatever they hold.

Shapes (public entry :func:`prefix_grads`): ``q, d_out [B, Tq, Hq, D]``, ``lse, delta
[B, Tq, Hq]`` float32 (``lse = -inf`` on rows that saw no key: they get zero gradient),
``prefix_k/v [G, P, Hkv, D]``, ``seq_to_prefix [B]`` int32 (dynamic), ``lim [B, Tq]`` int32
(dynamic), ``prefix_lengths [G]`` int32 (dynamic; key blocks past a group's length are
skipped).  Returns ``dq [B, Tq, Hq, D]`` (q's dtype), ``dk, dv [G, P, Hkv, D]`` (the prefix's
dtype).  Static: the shapes, ``scale``, the block sizes, ``row_splits`` and ``key_splits``;
recompilation is bounded by the shapes alone.

``interpret=True`` runs the kernels on the CPU; :func:`prefix_grads_reference` is the dense
pure-JAX computation of the same gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2E as _LOG2E
from pallas_kernels.flash_attention import load_row_block

__all__ = ["prefix_grads", "prefix_grads_reference", "prefix_grad_grid"]



def _cdiv(a, b):
    return lax.div(a + b - 1, b)


def _dot(a, b, fp32: bool, trans_b: bool = False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    prec = lax.Precision.HIGHEST if fp32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- dq

def _dq_kernel(grp_ref, lim_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale: float, bk: int, key_splits: int, fp32: bool):
    """One (row block, query head, key split): ``q/do [bq, D]``, ``lse/delta [bq]``, rows'
    group and key limit ``[bq]``; ``k/v [G, Pp, D]`` (this head's kv head).  Rows are sorted by
    group, so the block's groups are ``[grp[0], grp[-1]]`` (usually one).  Key split ``part``
    of ``key_splits`` takes its share of each group's key tiles."""
    part = pl.program_id(2)
    scale2 = scale * _LOG2E
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...] * _LOG2E          # +inf on rows without keys: p = 0
    delta = delta_ref[...]
    grp = grp_ref[...]
    lim = lim_ref[...]
    g_lo = jnp.min(grp)
    g_hi = jnp.max(grp)

    def group_body(g, dq):
        in_g = grp == g
        lim_g = jnp.where(in_g, lim, 0)
        n_end = _cdiv(jnp.max(lim_g), bk)
        # every row of the block in group g and past the tile: no mask needed
        n_full = jnp.where(jnp.min(in_g.astype(jnp.int32)) == 1, jnp.min(lim_g) // bk, 0)
        n_full = jnp.minimum(n_full, n_end)
        chunk = _cdiv(n_end, key_splits)
        lo = jnp.minimum(part * chunk, n_end)
        hi = jnp.minimum(lo + chunk, n_end)

        def body(kb, dq, masked: bool):
            start = pl.multiple_of(kb * bk, bk)
            k = k_ref[g, pl.ds(start, bk), :]
            v = v_ref[g, pl.ds(start, bk), :]
            s = _dot(q, k, fp32, trans_b=True)
            p = jnp.exp2(s * scale2 - lse2[:, None])
            dp = _dot(do, v, fp32, trans_b=True)
            ds = p * (dp - delta[:, None])
            if masked:  # (selects, not -inf scores: keys and values past every row's limit
                # may hold anything, NaN included, and must not reach dq)
                cols = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
                ds = jnp.where(cols < lim_g[:, None], ds, 0.0)
                keys = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
                k = jnp.where(keys < jnp.max(lim_g), k, jnp.zeros_like(k))
            return dq + _dot(ds.astype(k.dtype), k, fp32)

        mid = jnp.clip(n_full, lo, hi)
        dq = lax.fori_loop(lo, mid, functools.partial(body, masked=False), dq)
        return lax.fori_loop(mid, hi, functools.partial(body, masked=True), dq)

    dq = lax.fori_loop(g_lo, g_hi + 1, group_body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)  # (float32 partials when split)


# ----------------------------------------------------------------------------- dk / dv

def _dkv_kernel(start_ref, end_ref, plen_ref, grp_ref, lim_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, scale: float, bq: int, bk: int,
                group: int, row_splits: int, fp32: bool):
    """One (key block, group x row split, kv head): ``k/v [bk, D]``; ``q/do [Rp, Gq, D]``,
    ``lse/delta [Gq, Rp]``, ``grp/lim [Rp]`` (all rows; this program reads rows
    ``[start, end)`` of its group, or its share of them)."""
    kb = pl.program_id(0)
    a = pl.program_id(1)
    g = a // row_splits
    part = a % row_splits
    scale2 = scale * _LOG2E
    j0 = kb * bk
    k = k_ref[...]
    v = v_ref[...]
    cols = j0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    r_lo = start_ref[()]
    r_hi = end_ref[()]
    rb_lo = r_lo // bq
    rb_hi = jnp.where(j0 < plen_ref[()], _cdiv(r_hi, bq), rb_lo)  # no key of the group here
    chunk = _cdiv(jnp.maximum(rb_hi - rb_lo, 0), row_splits)
    lo = jnp.minimum(rb_lo + part * chunk, rb_hi)
    hi = jnp.minimum(lo + chunk, rb_hi)

    def body(rb, carry, gg):
        dk, dv = carry
        start = pl.multiple_of(rb * bq, bq)
        q, do, lse2, delta = load_row_block(q_ref, do_ref, lse_ref, delta_ref, start, bq, gg)
        lim_r = jnp.where(grp_ref[pl.ds(start, bq)] == g, lim_ref[pl.ds(start, bq)], 0)
        vis = cols < lim_r[None, :]
        s_t = _dot(k, q, fp32, trans_b=True)                  # [bk, bq]
        p_t = jnp.where(vis, jnp.exp2(s_t * scale2 - lse2[None, :]), 0.0)
        dv = dv + _dot(p_t.astype(do.dtype), do, fp32)
        dp_t = _dot(v, do, fp32, trans_b=True)
        ds_t = jnp.where(vis, p_t * (dp_t - delta[None, :]), 0.0)
        dk = dk + _dot(ds_t.astype(q.dtype), q, fp32)
        return dk, dv

    def head_body(gg, carry):
        return lax.fori_loop(lo, hi, functools.partial(body, gg=gg), carry)

    d = k_ref.shape[-1]
    carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    dk, dv = head_body(0, carry) if group == 1 else lax.fori_loop(0, group, head_body, carry)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- entry

def _pow2_block(block: int, n: int) -> int:
    return max(16, min(int(block), 1 << max(0, int(n) - 1).bit_length()))


def prefix_grad_grid(rows: int, prefix_len: int, *, block_q: int = 64, block_k: int = 64,
                     dkv_block_q: int = 64, dkv_block_k: int = 64) -> tuple[int, int, int, int]:
    """Static grid of :func:`prefix_grads` for ``rows = B * Tq`` rows and a prefix of
    ``prefix_len`` keys: ``(dq_row_blocks, dq_key_tiles, dkv_key_blocks, dkv_row_blocks)`` (the
    dQ kernel runs ``dq_row_blocks * Hq`` programs per key split over ``dq_key_tiles`` tiles;
    the dK/dV kernel ``dkv_key_blocks * G * Hkv`` per row split over ``dkv_row_blocks``)."""
    bq, bqk = _pow2_block(block_q, rows), _pow2_block(dkv_block_q, rows)
    bk, bkk = _pow2_block(block_k, prefix_len), _pow2_block(dkv_block_k, prefix_len)
    rp = -(-rows // max(bq, bqk)) * max(bq, bqk)
    pp = -(-prefix_len // max(bk, bkk)) * max(bk, bkk)
    return rp // bq, pp // bk, pp // bkk, rp // bqk


def prefix_grads(q, d_out, lse, delta, prefix_k, prefix_v, seq_to_prefix, lim, prefix_lengths,
                 *, scale: float, interpret: bool = False, block_q: int = 64, block_k: int = 64,
                 dkv_block_q: int = 64, dkv_block_k: int = 64, row_splits: int = 1,
                 key_splits: int = 1, num_warps: int = 4, num_stages: int = 2,
                 dkv_num_warps: int | None = None, dkv_num_stages: int | None = None):
    """Gradients of the prefix part of shared-prefix attention (see the module docstring).

    ``q, d_out [B, Tq, Hq, D]``, ``lse, delta [B, Tq, Hq]`` float32 (merged statistics),
    ``prefix_k/v [G, P, Hkv, D]``, ``seq_to_prefix [B]``, ``lim [B, Tq]``,
    ``prefix_lengths [G]`` (int32).  Returns ``(dq, dk, dv)``.  ``row_splits``: splits of each
    group's rows across dK/dV programs; ``key_splits``: splits of the key tiles across dQ
    programs (float32 partials, summed by XLA); :func:`prefix_grad_grid` gives the program
    counts they multiply.
    """
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    if hq % hkv:
        raise ValueError(f"heads_q={hq} must be a multiple of heads_kv={hkv}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    group = hq // hkv
    fp32 = q.dtype == jnp.float32
    dtype = prefix_k.dtype
    r = b * tq

    # Rows sorted by group (stable), so each group's rows form one range.
    s2p = jnp.asarray(seq_to_prefix, jnp.int32)
    if g == 1:
        order = inv = None
    else:
        order = jnp.argsort(s2p, stable=True).astype(jnp.int32)
        inv = jnp.argsort(order).astype(jnp.int32)

    def rows(x):                                           # [B, Tq, ...] -> [R, ...] sorted
        return (x if order is None else x[order]).reshape((r,) + x.shape[2:])

    bq = _pow2_block(block_q, r)
    bqk = _pow2_block(dkv_block_q, r)
    bk = _pow2_block(block_k, p)
    bkk = _pow2_block(dkv_block_k, p)
    rp = -(-r // max(bq, bqk)) * max(bq, bqk)
    pp = -(-p // max(bk, bkk)) * max(bk, bkk)
    pad_r = rp - r

    q_r = jnp.pad(rows(q.astype(dtype)), ((0, pad_r), (0, 0), (0, 0)))
    do_r = jnp.pad(rows(d_out.astype(dtype)), ((0, pad_r), (0, 0), (0, 0)))
    lse_b = jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(jnp.float32))  # empty rows: p = 0
    lse_r = jnp.pad(rows(lse_b), ((0, pad_r), (0, 0)), constant_values=jnp.inf).T   # [Hq, Rp]
    delta_r = jnp.pad(rows(delta.astype(jnp.float32)), ((0, pad_r), (0, 0))).T       # [Hq, Rp]
    grp_b = jnp.broadcast_to(s2p[:, None], (b, tq))
    grp_r = jnp.pad(rows(grp_b), (0, pad_r), mode="edge")   # (padding rows: limit 0)
    lim_r = jnp.pad(rows(jnp.asarray(lim, jnp.int32)), (0, pad_r))
    pk = jnp.pad(prefix_k, ((0, 0), (0, pp - p), (0, 0), (0, 0)))
    pv = jnp.pad(prefix_v, ((0, 0), (0, pp - p), (0, 0), (0, 0)))
    counts = jnp.zeros((g,), jnp.int32).at[s2p].add(tq)
    ends = jnp.cumsum(counts).astype(jnp.int32)
    starts = ends - counts
    plen = jnp.asarray(prefix_lengths, jnp.int32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    nq = rp // bq
    ks = int(key_splits)
    if ks < 1:
        raise ValueError(f"key_splits must be >= 1, got {ks}")
    row = lambda i, h, c: (i,)  # noqa: E731
    qrow = lambda i, h, c: (i, h, 0)  # noqa: E731
    stat = lambda i, h, c: (h, i)  # noqa: E731
    kv_all = pl.BlockSpec((g, pp, None, d), lambda i, h, c: (0, 0, h // group, 0))
    if ks == 1:
        dq_spec = pl.BlockSpec((bq, None, d), qrow)
        dq_shape = jax.ShapeDtypeStruct((rp, hq, d), dtype)
    else:
        dq_spec = pl.BlockSpec((None, bq, None, d), lambda i, h, c: (c, i, h, 0))
        dq_shape = jax.ShapeDtypeStruct((ks, rp, hq, d), jnp.float32)
    dq_r = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bk=bk, key_splits=ks, fp32=fp32),
        grid=(nq, hq, ks),
        in_specs=[pl.BlockSpec((bq,), row), pl.BlockSpec((bq,), row),
                  pl.BlockSpec((bq, None, d), qrow), kv_all, kv_all,
                  pl.BlockSpec((bq, None, d), qrow),
                  pl.BlockSpec((None, bq), stat), pl.BlockSpec((None, bq), stat)],
        out_specs=dq_spec,
        out_shape=dq_shape,
        compiler_params=params, interpret=interpret, name="prefix_bwd_dq",
    )(grp_r, lim_r, q_r, pk, pv, do_r, lse_r, delta_r)
    if ks > 1:
        dq_r = dq_r.sum(axis=0)

    nk = pp // bkk
    n_rb = rp // bqk
    rs = int(row_splits)
    if rs < 1:
        raise ValueError(f"row_splits must be >= 1, got {rs}")
    q5 = q_r.reshape(rp, hkv, group, d)
    do5 = do_r.reshape(rp, hkv, group, d)
    lse4 = lse_r.reshape(hkv, group, rp)
    delta4 = delta_r.reshape(hkv, group, rp)
    qspec = pl.BlockSpec((rp, None, group, d), lambda j, a, h: (0, h, 0, 0))
    rspec = pl.BlockSpec((None, group, rp), lambda j, a, h: (h, 0, 0))
    vec = pl.BlockSpec((rp,), lambda j, a, h: (0,))
    per_g = pl.BlockSpec((None,), lambda j, a, h: (a // rs,))
    kspec = pl.BlockSpec((None, bkk, None, d), lambda j, a, h: (a // rs, j, h, 0))
    if rs == 1:
        ospec = kspec
        oshape = jax.ShapeDtypeStruct(pk.shape, dtype)
    else:
        ospec = pl.BlockSpec((None, None, bkk, None, d), lambda j, a, h: (a % rs, a // rs, j, h, 0))
        oshape = jax.ShapeDtypeStruct((rs,) + pk.shape, jnp.float32)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, bq=bqk, bk=bkk, group=group, row_splits=rs,
                          fp32=fp32),
        grid=(nk, g * rs, hkv),
        in_specs=[per_g, per_g, per_g, vec, vec, qspec, kspec, kspec, qspec, rspec, rspec],
        out_specs=[ospec, ospec],
        out_shape=[oshape, oshape],
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps if dkv_num_warps is None else dkv_num_warps,
            num_stages=num_stages if dkv_num_stages is None else dkv_num_stages),
        interpret=interpret, name="prefix_bwd_dkv",
    )(starts, ends, plen, grp_r, lim_r, q5, pk, pv, do5, lse4, delta4)
    if rs > 1:
        dk, dv = dk.sum(axis=0).astype(dtype), dv.sum(axis=0).astype(dtype)

    dq = dq_r[:r].reshape(b, tq, hq, d)
    if inv is not None:
        dq = dq[inv]
    return dq.astype(q.dtype), dk[:, :p], dv[:, :p]


def prefix_grads_reference(q, d_out, lse, delta, prefix_k, prefix_v, seq_to_prefix, lim,
                           prefix_lengths=None, *, scale: float):
    """Dense pure-JAX :func:`prefix_grads` (float32, ``precision=HIGHEST``; materialises the
    ``[B, Tq, Hq, P]`` probabilities).  ``prefix_lengths`` is unused: ``lim`` already stops
    at each group's length."""
    del prefix_lengths
    b, tq, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    grp = hq // hkv
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    s2p = jnp.asarray(seq_to_prefix, jnp.int32)
    k = jnp.repeat(prefix_k.astype(f32)[s2p], grp, axis=2)       # [B, P, Hq, D]
    v = jnp.repeat(prefix_v.astype(f32)[s2p], grp, axis=2)
    qf, dof = q.astype(f32), d_out.astype(f32)
    s = jnp.einsum("bqhd,bkhd->bqhk", qf, k, precision=hi) * scale
    vis = jnp.arange(p)[None, None, None, :] < jnp.asarray(lim)[:, :, None, None]
    lse_f = jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(f32))
    pr = jnp.where(vis, jnp.exp(s - lse_f[..., None]), 0.0)
    dp = jnp.einsum("bqhd,bkhd->bqhk", dof, v, precision=hi)
    ds = pr * (dp - delta.astype(f32)[..., None])
    dq = jnp.einsum("bqhk,bkhd->bqhd", ds, k, precision=hi) * scale
    dk_b = jnp.einsum("bqhk,bqhd->bkhd", ds, qf, precision=hi) * scale    # [B, P, Hq, D]
    dv_b = jnp.einsum("bqhk,bqhd->bkhd", pr, dof, precision=hi)

    def to_groups(x):                                           # sum GQA heads, then sequences
        x = x.reshape(b, p, hkv, grp, d).sum(axis=3)
        return jax.ops.segment_sum(x, s2p, num_segments=g)
    return (dq.astype(q.dtype), to_groups(dk_b).astype(prefix_k.dtype),
            to_groups(dv_b).astype(prefix_v.dtype))
