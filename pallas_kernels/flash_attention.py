"""Flash attention (forward and backward) in Pallas, returning ``(out, lse)``.

Public entry: :func:`flash_attention`; :func:`supported` says whether it runs given shapes
(``None``) or why not.  Differentiable through both outputs with
``jax.custom_vjp``: a cotangent on ``lse`` enters the backward pass through
``delta_i = rowsum(dO_i * O_i) - dlse_i`` (since ``d lse_i / d s_ij = p_ij``).

Conventions (project-wide, see README):

* layout ``[batch, seq, heads, head_dim]``; ``lse`` natural log, float32, ``[B, Tq, Hq]``;
* GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (chosen in the BlockSpec index
  map, K/V are never repeated);
* causal mask bottom-right aligned to each sequence's valid length ``L_b``: query ``i``
  sees keys ``j < L_b`` with ``j <= i + L_b - Tq``;
* rows that see no key: ``lse = -inf``, ``out = 0``, zero gradients; a row that sees a NaN
  (its query, a key or a value) gets NaN in ``out`` (and in ``lse`` where a score is NaN; the
  public entry points flag the LSE of rows whose NaN came from a value).

Kernels (Triton lowering, selected by ``plgpu.CompilerParams``; ``interpret=True`` runs
them on the CPU):

* forward: grid ``(q blocks, B, Hq)``, online softmax in the base-2 domain (FlashAttention-2
  form: unnormalised float32 accumulator, one division at the end); the key loop stops at
  ``kv_lengths[b]`` and at the causal diagonal, and is split into a mask-free part and a
  masked boundary part;
* backward: ``dq`` kernel with grid ``(q blocks, B, Hq)`` looping over key blocks, and a
  ``dk/dv`` kernel with grid ``(k blocks, B, Hkv)`` looping over the ``G`` query heads of
  the group and over query blocks, so GQA gradients are summed in-kernel.  In masked tiles the
  score gradients are selected to 0 and keys past the length zeroed, so a NaN there (a stale
  cache) never reaches a gradient.  :func:`flash_attention_bwd` runs these two kernels with
  given row statistics (one part of a merged attention).

Shapes are padded in the wrapper to block multiples (head_dim to 64/128/256) when needed;
padded keys are masked by the length test, padded query rows are sliced off.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LN2, LOG2E, next_pow2, pad_axis

__all__ = ["flash_attention", "flash_attention_bwd", "FlashConfig", "KernelTiles", "SUPPORTED_HEAD_DIMS",
           "SUPPORTED_DTYPES", "default_config", "supported", "load_row_block"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_MIN_BLOCK = 16  # Triton dot operands need >= 16 rows / cols.


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Tiling of one kernel: a ``block_q x block_k`` tile per step (powers of two >= 16, clamped
    to the padded sequence lengths at call time) and its Triton launch parameters."""
    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tilings of the three kernels: ``fwd`` (forward), ``dq`` (the dQ kernel) and ``dkv`` (the
    dK/dV kernel)."""
    fwd: KernelTiles = KernelTiles(128, 64)
    dq: KernelTiles = KernelTiles(128, 32)
    dkv: KernelTiles = KernelTiles(32, 128)

    def kernels(self) -> dict:
        """``{"fwd": ..., "dq": ..., "dkv": ...}``."""
        return {"fwd": self.fwd, "dq": self.dq, "dkv": self.dkv}


def _tiles(table: tuple) -> FlashConfig:
    return FlashConfig(*(KernelTiles(*row) for row in table))


# Per-(head_dim, dtype itemsize) defaults; 16-bit ones tuned on an H200 with
# `bench/flash_attention_sweep.py` (causal, B=4, T=4096, H*D=4096).
_DEFAULTS = types.MappingProxyType({
    (64, 2): _tiles(((128, 64, 4, 3), (128, 64, 8, 3), (32, 128, 4, 3))),
    (128, 2): _tiles(((128, 128, 8, 3), (128, 64, 8, 3), (32, 64, 4, 3))),
    (256, 2): _tiles(((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2))),
    (64, 4): _tiles(((64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2))),
    (128, 4): _tiles(((64, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2))),
    (256, 4): _tiles(((32, 32, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2))),
})


def default_config(head_dim: int, dtype) -> FlashConfig:
    """Default :class:`FlashConfig` for a (padded) head_dim in ``SUPPORTED_HEAD_DIMS``."""
    return _DEFAULTS[(int(head_dim), jnp.dtype(dtype).itemsize)]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static a kernel needs (hashable: used as a custom_vjp nondiff arg)."""
    causal: bool
    scale: float
    tq: int          # true (unpadded) number of queries: the causal diagonal offset uses it
    group: int       # Hq // Hkv
    cfg: FlashConfig
    interpret: bool
    fp32: bool       # use exact (IEEE) fp32 dots


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _dot(a, b, st: _Static, trans_b: bool = False):
    """``a @ b`` (or ``a @ b.T``) with float32 accumulation."""
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    prec = lax.Precision.HIGHEST if st.fp32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _params(st: _Static, warps: int, stages: int):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _cdiv(a, b):
    """Ceiling division of traced non-negative int32 scalars (one truncating division)."""
    return lax.div(a + b - 1, b)


def _visible_keys(rows, start, bk: int, length, diag, causal: bool):
    """``[bq, bk]`` mask of the keys ``start + [0, bk)`` that query rows ``rows [bq, 1]`` see:
    below the valid ``length`` and, when causal, at most ``row + diag``."""
    cols = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    vis = cols < length
    if causal:
        vis = vis & (cols <= rows + diag)
    return vis


def _key_block_range(qi, bq: int, bk: int, length, diag, causal: bool):
    """Key blocks of query block ``qi``: ``[0, n_full)`` are seen whole by every row (no mask),
    ``[n_full, n_end)`` need the mask, blocks from ``n_end`` are seen by no row."""
    if causal:
        first_row = qi * bq
        full_end = jnp.minimum(length, first_row + diag + 1)          # keys seen by every row
        any_end = jnp.minimum(length, first_row + bq - 1 + diag + 1)  # keys seen by some row
    else:
        full_end = length
        any_end = length
    n_end = _cdiv(jnp.maximum(any_end, 0), bk)
    n_full = jnp.minimum(jnp.maximum(full_end, 0) // bk, n_end)
    return n_full, n_end


# --------------------------------------------------------------------------- forward


def _fwd_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static, nq: int,
                bq: int, bk: int):
    """One (query block, batch, q head): ``q_ref [bq, D]``, ``k_ref/v_ref [Tk_pad, D]``."""
    qi = pl.program_id(0)
    if st.causal:  # heavy (late) query blocks first
        qi = nq - 1 - qi
    length = len_ref[()]
    scale2 = st.scale * LOG2E
    q = q_ref[...]
    rows = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    diag = length - st.tq  # query i sees keys j <= i + diag

    def body(kb, carry, masked: bool):
        acc, m, l = carry
        start = pl.multiple_of(kb * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        # Scaled once into log2 units: in this loop one multiply of the [bq, bk] tile is
        # cheaper than the backward kernels' FMA form exp2(s * scale2 - m), which measured
        # slower in the forward (docs/performance.md, "Kernel design measurements").
        s = _dot(q, k, st, trans_b=True) * scale2  # [bq, bk]
        if masked:
            vis = _visible_keys(rows, start, bk, length, diag, st.causal)
            s = jnp.where(vis, s, -jnp.inf)
            # keys past the length may hold anything (NaN too): 0 * NaN in p @ v would reach
            # the row, so their values are zeroed (the scores are already masked above)
            kv_ok = (start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)) < length
            v = jnp.where(kv_ok, v, jnp.zeros_like(v))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        if masked:  # a row may still have seen nothing: keep exp2 arguments NaN-free
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_use = m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, st)
        return acc, m_new, l

    n_full, n_end = _key_block_range(qi, bq, bk, length, diag, st.causal)

    d = q_ref.shape[-1]
    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)
    empty = l == 0.0  # (a NaN score leaves l NaN: the row's lse is NaN, not -inf)
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(l_safe))


def _fwd_call(q, k, v, lengths, st: _Static):
    """Aligned shapes: ``q [B, Tqp, Hq, D]``, ``k/v [B, Tkp, Hkv, D]`` -> ``out, lse [B, Hq, Tqp]``."""
    b, tqp, hq, d = q.shape
    tkp = k.shape[1]
    bq, bk = st.cfg.fwd.block_q, st.cfg.fwd.block_k
    nq = tqp // bq
    g = st.group
    if st.causal:
        qmap = lambda i, bb, h: (bb, nq - 1 - i, h, 0)  # noqa: E731
        lmap = lambda i, bb, h: (bb, h, nq - 1 - i)  # noqa: E731
    else:
        qmap = lambda i, bb, h: (bb, i, h, 0)  # noqa: E731
        lmap = lambda i, bb, h: (bb, h, i)  # noqa: E731
    kernel = functools.partial(_fwd_kernel, st=st, nq=nq, bq=bq, bk=bk)
    return pl.pallas_call(
        kernel,
        grid=(nq, b, hq),
        in_specs=[
            pl.BlockSpec((None,), lambda i, bb, h: (bb,)),
            pl.BlockSpec((None, bq, None, d), qmap),
            pl.BlockSpec((None, tkp, None, d), lambda i, bb, h: (bb, 0, h // g, 0)),
            pl.BlockSpec((None, tkp, None, d), lambda i, bb, h: (bb, 0, h // g, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, d), qmap),
            pl.BlockSpec((None, None, bq), lmap),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, tqp), jnp.float32)],
        compiler_params=_params(st, st.cfg.fwd.num_warps, st.cfg.fwd.num_stages),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(lengths, q, k, v)


# --------------------------------------------------------------------------- backward


def _dq_kernel(len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               st: _Static, nq: int, bq: int, bk: int):
    """One (query block, batch, q head): loops over key blocks, writes ``dq [bq, D]``."""
    qi = pl.program_id(0)
    if st.causal:
        qi = nq - 1 - qi
    length = len_ref[()]
    scale2 = st.scale * LOG2E
    q = q_ref[...]
    do = do_ref[...]
    lse2 = lse_ref[...] * LOG2E  # +inf on rows without keys -> p = 0
    delta = delta_ref[...]
    rows = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    diag = length - st.tq

    def body(kb, dq, masked: bool):
        start = pl.multiple_of(kb * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = _dot(q, k, st, trans_b=True)
        if masked:
            vis = _visible_keys(rows, start, bk, length, diag, st.causal)
            s = jnp.where(vis, s, -jnp.inf)
        p = jnp.exp2(s * scale2 - lse2[:, None])
        dp = _dot(do, v, st, trans_b=True)
        ds = p * (dp - delta[:, None])
        if masked:  # keys past the length may hold anything (NaN too): keep them out of dq
            ds = jnp.where(vis, ds, 0.0)
            keys = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            k = jnp.where(keys < length, k, jnp.zeros_like(k))
        return dq + _dot(ds.astype(k.dtype), k, st)

    n_full, n_end = _key_block_range(qi, bq, bk, length, diag, st.causal)
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def load_row_block(q_ref, do_ref, lse_ref, delta_ref, start, bq: int, head):
    """Rows ``[start, start + bq)`` of query head ``head`` as a dK/dV kernel reads them from
    ``q_ref/do_ref [rows, heads, D]`` and ``lse_ref/delta_ref [heads, rows]``: ``(q, do [bq, D],
    lse2 [bq]`` (the log-sum-exp in base 2, for ``exp2``), ``delta [bq])``."""
    q = q_ref[pl.ds(start, bq), head, :]
    do = do_ref[pl.ds(start, bq), head, :]
    lse2 = lse_ref[head, pl.ds(start, bq)] * LOG2E
    delta = delta_ref[head, pl.ds(start, bq)]
    return q, do, lse2, delta


def _dkv_kernel(len_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                st: _Static, nq: int, bq: int, bk: int):
    """One (key block, batch, kv head): loops over the group's q heads and query blocks.

    ``q_ref/do_ref [Tqp, G, D]``, ``k_ref/v_ref [bk, D]``, ``lse_ref/delta_ref [G, Tqp]``.
    """
    kb = pl.program_id(0)
    length = len_ref[()]
    scale2 = st.scale * LOG2E
    k = k_ref[...]
    v = v_ref[...]
    j0 = kb * bk
    cols = j0 + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    diag = length - st.tq

    def body(qb, carry, g, masked: bool):
        dk, dv = carry
        start = pl.multiple_of(qb * bq, bq)
        q, do, lse2, delta = load_row_block(q_ref, do_ref, lse_ref, delta_ref, start, bq, g)
        s_t = _dot(k, q, st, trans_b=True)  # [bk, bq] unscaled
        if masked:
            rows = start + lax.broadcasted_iota(jnp.int32, (1, bq), 1)
            vis = cols < length
            if st.causal:
                vis = vis & (cols <= rows + diag)
            s_t = jnp.where(vis, s_t, -jnp.inf)
        p_t = jnp.exp2(s_t * scale2 - lse2[None, :])
        dv = dv + _dot(p_t.astype(do.dtype), do, st)
        dp_t = _dot(v, do, st, trans_b=True)
        ds_t = p_t * (dp_t - delta[None, :])
        if masked:  # (a NaN value past the length: its dk row stays 0)
            ds_t = jnp.where(vis, ds_t, 0.0)
        dk = dk + _dot(ds_t.astype(q.dtype), q, st)
        return dk, dv

    # Query blocks [lo, mid) need the mask, [mid, nq) see the whole key block.
    if st.causal:
        lo = jnp.maximum(j0 + st.tq - length, 0) // bq
        full_from = _cdiv(jnp.maximum(j0 + bk - 1 + st.tq - length, 0), bq)
    else:
        lo = jnp.int32(0)
        full_from = jnp.int32(0)
    lo = jnp.where(j0 >= length, nq, lo)                 # block beyond the valid keys
    full_from = jnp.where(j0 + bk > length, nq, full_from)  # block straddles the length
    mid = jnp.minimum(jnp.maximum(full_from, lo), nq)

    def group_body(g, carry):
        carry = lax.fori_loop(lo, mid, functools.partial(body, g=g, masked=True), carry)
        return lax.fori_loop(mid, nq, functools.partial(body, g=g, masked=False), carry)

    d = k_ref.shape[-1]
    carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    if st.group == 1:
        dk, dv = group_body(0, carry)
    else:
        dk, dv = lax.fori_loop(0, st.group, group_body, carry)
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_call(q, k, v, lengths, do, lse_bhq, delta_bhq, st: _Static):
    """Aligned shapes; ``lse_bhq/delta_bhq [B, Hq, Tqp]`` float32 -> ``dq, dk, dv``."""
    b, tqp, hq, d = q.shape
    tkp, hkv = k.shape[1], k.shape[2]
    g = st.group
    cfg = st.cfg
    lse_bwd = jnp.where(jnp.isneginf(lse_bhq), jnp.inf, lse_bhq)  # empty rows: p = 0

    bq, bk = cfg.dq.block_q, cfg.dq.block_k
    nq = tqp // bq
    qmap = ((lambda i, bb, h: (bb, nq - 1 - i, h, 0)) if st.causal
            else (lambda i, bb, h: (bb, i, h, 0)))
    rmap = ((lambda i, bb, h: (bb, h, nq - 1 - i)) if st.causal
            else (lambda i, bb, h: (bb, h, i)))
    kvmap = lambda i, bb, h: (bb, 0, h // g, 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, nq=nq, bq=bq, bk=bk),
        grid=(nq, b, hq),
        in_specs=[
            pl.BlockSpec((None,), lambda i, bb, h: (bb,)),
            pl.BlockSpec((None, bq, None, d), qmap),
            pl.BlockSpec((None, tkp, None, d), kvmap),
            pl.BlockSpec((None, tkp, None, d), kvmap),
            pl.BlockSpec((None, bq, None, d), qmap),
            pl.BlockSpec((None, None, bq), rmap),
            pl.BlockSpec((None, None, bq), rmap),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), qmap),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(st, cfg.dq.num_warps, cfg.dq.num_stages),
        interpret=st.interpret,
        name="flash_attention_bwd_dq",
    )(lengths, q, k, v, do, lse_bwd, delta_bhq)

    bq, bk = cfg.dkv.block_q, cfg.dkv.block_k
    nq, nk = tqp // bq, tkp // bk
    q5 = q.reshape(b, tqp, hkv, g, d)
    do5 = do.reshape(b, tqp, hkv, g, d)
    lse4 = lse_bwd.reshape(b, hkv, g, tqp)
    delta4 = delta_bhq.reshape(b, hkv, g, tqp)
    qspec = pl.BlockSpec((None, tqp, None, g, d), lambda j, bb, h: (bb, 0, h, 0, 0))
    rspec = pl.BlockSpec((None, None, g, tqp), lambda j, bb, h: (bb, h, 0, 0))
    kspec = pl.BlockSpec((None, bk, None, d), lambda j, bb, h: (bb, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, nq=nq, bq=bq, bk=bk),
        grid=(nk, b, hkv),
        in_specs=[pl.BlockSpec((None,), lambda j, bb, h: (bb,)), qspec, kspec, kspec, qspec,
                  rspec, rspec],
        out_specs=[kspec, kspec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(st, cfg.dkv.num_warps, cfg.dkv.num_stages),
        interpret=st.interpret,
        name="flash_attention_bwd_dkv",
    )(lengths, q5, k, v, do5, lse4, delta4)
    return dq, dk, dv


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_core(q, k, v, lengths, st: _Static):
    return _fwd_call(q, k, v, lengths, st)


def _flash_core_fwd(q, k, v, lengths, st: _Static):
    out, lse = _fwd_call(q, k, v, lengths, st)
    return (out, lse), (q, k, v, lengths, out, lse)


def _flash_core_bwd(st: _Static, res, cts):
    q, k, v, lengths, out, lse = res
    d_out, d_lse = cts
    # delta_i = rowsum(dO_i * O_i) - dlse_i   (float32, [B, Hq, Tqp])
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.transpose(delta, (0, 2, 1)) - d_lse.astype(jnp.float32)
    dq, dk, dv = _bwd_call(q, k, v, lengths, d_out.astype(q.dtype), lse, delta, st)
    return dq, dk, dv, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


# --------------------------------------------------------------------------- public entry


def supported(q_shape, k_shape, dtype) -> str | None:
    """``None`` when :func:`flash_attention` runs ``q [B, Tq, Hq, D]`` against ``k/v
    [B, Tk, Hkv, D]`` of ``dtype``, else the reason it cannot: a head_dim above the largest
    supported one (smaller ones are zero-padded), a dtype other than float16/bfloat16/float32,
    an empty query or key axis (a grid without blocks), ``Hq`` not a multiple of ``Hkv``."""
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) != 4 or len(k_shape) != 4:
        return f"q and k must have rank 4, got shapes {q_shape} and {k_shape}"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype must be float16, bfloat16 or float32, got {jnp.dtype(dtype)}"
    if q_shape[3] > SUPPORTED_HEAD_DIMS[-1]:
        return f"head_dim must be at most {SUPPORTED_HEAD_DIMS[-1]}, got {q_shape[3]}"
    if 0 in (q_shape[1], k_shape[1]):
        return (f"needs at least one query and one key, got q seq_q={q_shape[1]} and "
                f"k seq_k={k_shape[1]}")
    if k_shape[2] < 1 or q_shape[2] % k_shape[2]:
        return f"heads_q must be a multiple of heads_kv, got {q_shape[2]} and {k_shape[2]}"
    return None


def _check_inputs(q, k, v, kv_lengths, head_dim_supported):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], "
                             f"got shape {tuple(x.shape)}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"flash_attention supports dtypes float16, bfloat16, float32; "
                            f"{name} has dtype {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"heads_q must be a multiple of heads_kv, got {q.shape[2]} and {k.shape[2]}")
    if not head_dim_supported:
        raise ValueError(f"flash_attention supports head_dim {SUPPORTED_HEAD_DIMS} (smaller values "
                         f"are zero-padded to the next one), got head_dim {q.shape[3]}")
    if kv_lengths is not None:
        if not hasattr(kv_lengths, "shape") or kv_lengths.shape != (q.shape[0],) or \
                not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise ValueError(f"kv_lengths must be an integer array of shape [{q.shape[0]}], got "
                             f"{getattr(kv_lengths, 'shape', type(kv_lengths).__name__)}")


def _clamp_block(block: int, n: int) -> int:
    return max(_MIN_BLOCK, min(int(block), next_pow2(max(n, 1))))


def _prepare(q, k, v, *, causal, kv_lengths, sm_scale, interpret, block_q=None, block_k=None,
             config=None):
    """Validate, pick the (clamped) tiles and pad to them: ``(st, lengths, qp, kp, vp, d)``."""
    d_in = q.shape[3] if hasattr(q, "shape") and getattr(q, "ndim", 0) == 4 else None
    d_pad = next((s for s in SUPPORTED_HEAD_DIMS if d_in is not None and d_in <= s), None)
    _check_inputs(q, k, v, kv_lengths, d_pad is not None)
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
        v = v.astype(q.dtype)

    cfg = config if config is not None else default_config(d_pad, q.dtype)
    if block_q is not None or block_k is not None:
        cfg = dataclasses.replace(cfg, fwd=dataclasses.replace(
            cfg.fwd, block_q=block_q or cfg.fwd.block_q, block_k=block_k or cfg.fwd.block_k))
    for part, tiles in cfg.kernels().items():
        for name in ("block_q", "block_k"):
            val = getattr(tiles, name)
            if val < _MIN_BLOCK or val & (val - 1):
                raise ValueError(f"config.{part}.{name} must be a power of two >= {_MIN_BLOCK}, "
                                 f"got {val}")
    cfg = FlashConfig(**{part: dataclasses.replace(tiles, block_q=_clamp_block(tiles.block_q, tq),
                                                   block_k=_clamp_block(tiles.block_k, tk))
                         for part, tiles in cfg.kernels().items()})
    tqp = _round_up(tq, max(t.block_q for t in cfg.kernels().values()))
    tkp = _round_up(tk, max(t.block_k for t in cfg.kernels().values()))

    if kv_lengths is None:
        lengths = jnp.full((b,), tk, jnp.int32)
    else:
        lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, tk)
    st = _Static(causal=bool(causal), scale=scale, tq=tq, group=hq // hkv, cfg=cfg,
                 interpret=bool(interpret), fp32=q.dtype == jnp.float32)

    qp = pad_axis(pad_axis(q, 3, d_pad), 1, tqp)
    kp = pad_axis(pad_axis(k, 3, d_pad), 1, tkp)
    vp = pad_axis(pad_axis(v, 3, d_pad), 1, tkp)
    return st, lengths, qp, kp, vp, d


def flash_attention(q, k, v, *, causal: bool = False, kv_lengths=None, sm_scale=None,
                    interpret: bool = False, block_q: int | None = None,
                    block_k: int | None = None, config: FlashConfig | None = None):
    """Flash attention returning ``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)``.

    Args:
      q: ``[B, Tq, Hq, D]`` float16/bfloat16/float32.
      k, v: ``[B, Tk, Hkv, D]`` (cast to ``q``'s dtype), ``Hq % Hkv == 0``.
      causal: bottom-right causal mask aligned to each sequence's valid length.
      kv_lengths: optional int ``[B]``; keys ``>= kv_lengths[b]`` are masked.  Read inside the
        kernel: changing the values does not recompile.
      sm_scale: score scale, default ``1/sqrt(D)``.
      interpret: run the Pallas kernels in interpret mode (CPU).
      block_q, block_k: override the forward tile sizes (powers of two >= 16).
      config: full :class:`FlashConfig` override (forward and backward tiles, warps, stages).

    Differentiable w.r.t. ``q, k, v`` through both ``out`` and ``lse``.
    """
    st, lengths, qp, kp, vp, d = _prepare(q, k, v, causal=causal, kv_lengths=kv_lengths,
                                          sm_scale=sm_scale, interpret=interpret,
                                          block_q=block_q, block_k=block_k, config=config)
    tq = q.shape[1]
    out, lse_bhq = _flash_core(qp, kp, vp, lengths, st)
    out = out[:, :tq, :, :d]
    lse = jnp.transpose(lse_bhq[:, :, :tq], (0, 2, 1))
    return out, lse


def flash_attention_bwd(q, k, v, d_out, lse, delta, *, causal: bool = False, kv_lengths=None,
                        sm_scale=None, interpret: bool = False,
                        config: FlashConfig | None = None):
    """``(dq, dk, dv)`` of attention over ``k, v`` evaluated with *given* row statistics: the
    backward kernels of :func:`flash_attention` with ``p_ij = exp(s_ij - lse_i)`` and
    ``ds_ij = p_ij (dp_ij - delta_i)``.

    With ``lse`` and ``delta = rowsum(dO * O) - dlse`` of a larger attention whose keys include
    these (``O``, ``lse`` after an exact merge of several parts), this is that attention's
    gradient restricted to this part of the keys: how shared-prefix attention differentiates its
    suffix part (:mod:`jax_prefix_attn.shared_prefix`).

    ``q, d_out [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]``, ``lse, delta [B, Tq, Hq]`` float32
    (``lse = -inf``: the row gets no gradient); masking as :func:`flash_attention`.  Returns
    gradients in the inputs' dtypes.
    """
    st, lengths, qp, kp, vp, d = _prepare(q, k, v, causal=causal, kv_lengths=kv_lengths,
                                          sm_scale=sm_scale, interpret=interpret, config=config)
    tq, tk = q.shape[1], k.shape[1]
    tqp = qp.shape[1]
    for name, x, want in (("d_out", d_out, q.shape), ("lse", lse, q.shape[:3]),
                          ("delta", delta, q.shape[:3])):
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(x.shape)}")
    dop = pad_axis(pad_axis(d_out.astype(q.dtype), 3, qp.shape[3]), 1, tqp)
    lse_bhq = jnp.pad(jnp.transpose(lse.astype(jnp.float32), (0, 2, 1)),
                      ((0, 0), (0, 0), (0, tqp - tq)), constant_values=-jnp.inf)
    delta_bhq = pad_axis(jnp.transpose(delta.astype(jnp.float32), (0, 2, 1)), 2, tqp)
    dq, dk, dv = _bwd_call(qp, kp, vp, lengths, dop, lse_bhq, delta_bhq, st)
    return (dq[:, :tq, :, :d], dk[:, :tk, :, :d].astype(k.dtype),
            dv[:, :tk, :, :d].astype(v.dtype))
