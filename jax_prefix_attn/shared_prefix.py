"""Shared-prefix attention (Hydragen / RelayAttention): public entry point and dispatch.

Many sequences share a prompt (or one of ``G`` prompts).  Attention of each sequence over
``[its prefix[:prefix_len]; its suffix[:suffix_len]]`` is split into attention over the
prefix and attention over the suffix, merged exactly through the log-sum-exp (Hydragen
section 3.1, RelayAttention section 3.3).  The prefix part is computed for all sequences
that share a prefix as one matrix-matrix product per kv head (inter-sequence batching), so
the prefix's keys and values are read about once per batch instead of once per sequence.

Key visibility, derived from the project's causal convention on the concatenation
(length ``L = pl + sl``, query ``i`` of ``Tq`` sees ``j < L`` and ``j <= i + L - Tq``),
is a *per-row key limit* in both parts:

* prefix keys ``j < lim_p[b, i] = clip(pl + sl - Tq + i + 1, 0, pl)``;
* suffix keys ``j < lim_s[b, i] = clip(sl - Tq + i + 1, 0, sl)``.

Every implementation below computes exactly these masks; ``suffix_lengths < Tq`` (queries
that fall inside the prefix) is therefore handled too.

``impl``:

* ``"reference"``: pure JAX (prefix part + suffix part + :func:`merge_attention_states`);
* ``"shared"``: two Pallas launches on the GPU: the inter-sequence batched prefix kernel,
  then the suffix decode kernel that merges the prefix partials in its epilogue (when decoding
  with one prefix on Hopper: the Mosaic GPU prefix kernel and the suffix kernel as two
  independent launches, or, where ``pallas_kernels.prefix_attention.one_launch_plan`` says it
  was measured to pay, one Mosaic GPU launch computing both
  (``pallas_kernels.shared_decode_mgpu``), merged by one small XLA fusion; or, where
  ``pallas_kernels.prefix_attention.joint_plan`` says so (prefix 1K-4K, short suffixes), one
  Mosaic GPU pass that streams each CTA's suffix tiles through the prefix pipeline into one
  softmax state, ``pallas_kernels.joint_decode_mgpu``);
* ``"flat"``: one ragged split-KV decode launch (plus a small reduction when the keys are
  split) that reads the prefix through a per-sequence index for every sequence, without
  copying it (the PagedAttention-style baseline);
* ``"pallas_interpret"``: the shared path's kernels in Pallas interpret mode (CPU tests);
  ``"flat_interpret"`` the flat path's;
* ``"auto"``: on the GPU, the cheaper of ``"shared"`` and ``"flat"`` by the cost model in
  :mod:`jax_prefix_attn.cost_model`; elsewhere ``"reference"``.

Gradients: the Pallas paths have a ``custom_vjp`` whose backward runs flash backward kernels
(``BACKWARD = "kernels"``, the default): with the merged ``out`` and ``lse`` saved by the
forward, each part's gradient is a flash-attention backward evaluated with those merged
statistics, so the merge needs no backward of its own.  The prefix part's kernels
(:mod:`pallas_kernels.prefix_attention_bwd`) batch the rows of every sequence that shares a
prefix, as the forward does: ``dK``/``dV`` of a prefix are summed over its sequences inside
the kernel.  The suffix part is :func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`:
one pass over each sequence's keys with its ``Tq * Hq / Hkv`` query rows as one tile (up to
128 rows), else the flash backward (causal, aligned to each suffix length).  Nothing of size
``[B, Tq, Hq, P]`` is materialised.  ``BACKWARD = "reference"`` instead differentiates the
pure-JAX reference decomposition (which materialises the probabilities; kept for comparison).
Second-order derivatives (grad of grad) work either way: differentiating the kernel backward
goes through the reference's autodiff.  Both paths (``"shared"`` and ``"flat"``) share the
backward: it depends only on the inputs, ``out`` and ``lse``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn._validation import (is_concrete, check_array, check_gqa, check_impl,
                                         check_lengths, check_sm_scale)
from jax_prefix_attn.merge import merge_attention_states
from pallas_kernels.decode_attention import MAX_ROWS_PER_TILE

__all__ = ["shared_prefix_attention", "IMPLS", "row_limits", "reference_shared_prefix",
           "CONCURRENT_COMPILER_OPTIONS"]

IMPLS = ("auto", "shared", "flat", "reference", "pallas_interpret", "flat_interpret")

# XLA options for the user's ``jax.jit`` of a decode step (``jax.jit(step,
# compiler_options=CONCURRENT_COMPILER_OPTIONS)``): XLA's CUDA graphs then run independent
# launches at the same time (scheduling "CONCURRENT", graphs of any size).  On Hopper the
# decode path's prefix launch (tensor-core bound) and suffix launch (memory bound) are
# independent (``pallas_kernels.prefix_attention.MGPU_MERGE``); measured on an H200 this made
# the attention call 1-6% faster (``bench/results/logs/session6_probe_concurrent_h200.json``).
# Opt-in: it can raise peak memory, as buffers of concurrent ops cannot share space.
CONCURRENT_COMPILER_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
                               "xla_gpu_graph_min_graph_size": 1}


# ----------------------------------------------------------------------------- validation

def _validate(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lengths, prefix_lengths,
              seq_to_prefix, sm_scale, return_lse, impl):
    """Validate and canonicalise; returns ``(prefix_k, prefix_v [G, P, Hkv, D], seq_to_prefix [B],
    prefix_lengths [G])``."""
    check_impl(impl, IMPLS)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_array("prefix_k", prefix_k, (3, 4), layout="[P, heads_kv, head_dim] or [G, P, heads_kv, head_dim]")
    check_array("prefix_v", prefix_v, (3, 4), layout="[P, heads_kv, head_dim] or [G, P, heads_kv, head_dim]")
    check_array("suffix_k", suffix_k, 4, layout="[batch, S_max, heads_kv, head_dim]")
    check_array("suffix_v", suffix_v, 4, layout="[batch, S_max, heads_kv, head_dim]")
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k and prefix_v must have the same shape, got prefix_k "
                         f"{tuple(prefix_k.shape)} and prefix_v {tuple(prefix_v.shape)}")
    if suffix_k.shape != suffix_v.shape:
        raise ValueError(f"suffix_k and suffix_v must have the same shape, got suffix_k "
                         f"{tuple(suffix_k.shape)} and suffix_v {tuple(suffix_v.shape)}")
    for name, x in (("prefix_k", prefix_k), ("prefix_v", prefix_v), ("suffix_k", suffix_k),
                    ("suffix_v", suffix_v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    b, tq, hq, d = q.shape
    single = prefix_k.ndim == 3
    if single:
        prefix_k, prefix_v = prefix_k[None], prefix_v[None]
    g, p, hkv, dp = prefix_k.shape
    if suffix_k.shape[0] != b:
        raise ValueError(f"suffix_k must have q's batch size {b} on axis 0, got shape {tuple(suffix_k.shape)}")
    if suffix_k.shape[2] != hkv:
        raise ValueError(f"suffix_k must have the prefix's heads_kv={hkv} on axis 2, got shape "
                         f"{tuple(suffix_k.shape)}")
    if dp != d or suffix_k.shape[3] != d:
        raise ValueError(f"prefix_k and suffix_k must have q's head_dim {d}, got prefix_k "
                         f"{tuple(prefix_k.shape)} and suffix_k {tuple(suffix_k.shape)}")
    if g < 1:
        raise ValueError(f"prefix_k must hold at least one prefix group, got shape {tuple(prefix_k.shape)}")
    check_gqa(hq, hkv)
    check_sm_scale(sm_scale)
    check_lengths("suffix_lengths", suffix_lengths, b, suffix_k.shape[1])
    if prefix_lengths is None:
        prefix_lengths = jnp.full((g,), p, jnp.int32)
    else:
        check_lengths("prefix_lengths", prefix_lengths, g, p)
    if seq_to_prefix is None:
        if g != 1:
            raise ValueError(f"seq_to_prefix [batch={b}] is required when there are G={g} prefix "
                             f"groups (prefix_k shape {tuple(prefix_k.shape)})")
        seq_to_prefix = jnp.zeros((b,), jnp.int32)
    else:
        if not hasattr(seq_to_prefix, "shape"):
            raise TypeError(f"seq_to_prefix must be an integer array of shape [{b}], got "
                            f"{type(seq_to_prefix).__name__}")
        check_array("seq_to_prefix", seq_to_prefix, 1, floating=False, layout=f"[batch={b}]")
        if seq_to_prefix.shape[0] != b:
            raise ValueError(f"seq_to_prefix must have shape [{b}], got {tuple(seq_to_prefix.shape)}")
        if is_concrete(seq_to_prefix):
            vals = np.asarray(seq_to_prefix)
            if vals.size and (vals.min() < 0 or vals.max() >= g):
                raise ValueError(f"seq_to_prefix values must be in [0, {g}) (the number of prefix "
                                 f"groups), got range [{int(vals.min())}, {int(vals.max())}]")
    return (prefix_k, prefix_v, jnp.asarray(seq_to_prefix, jnp.int32),
            jnp.asarray(prefix_lengths, jnp.int32), jnp.asarray(suffix_lengths, jnp.int32))


# ----------------------------------------------------------------------------- masks

def row_limits(tq: int, prefix_len_b: jax.Array, suffix_len_b: jax.Array):
    """Per-row key limits ``(lim_prefix [B, Tq], lim_suffix [B, Tq])`` (int32).

    Query ``i`` of sequence ``b`` sees prefix keys ``j < lim_prefix[b, i]`` and suffix keys
    ``j < lim_suffix[b, i]`` (see the module docstring).
    """
    pl_ = prefix_len_b.astype(jnp.int32)[:, None]
    sl_ = suffix_len_b.astype(jnp.int32)[:, None]
    i = jnp.arange(tq, dtype=jnp.int32)[None, :]
    lim_p = jnp.clip(pl_ + sl_ - tq + i + 1, 0, pl_)
    lim_s = jnp.clip(sl_ - tq + i + 1, 0, sl_)
    return lim_p, lim_s


# ----------------------------------------------------------------------------- reference

def _part_attention(q_bthd, k_nshd, v_nshd, kv_index_b, limit_bt, scale):
    """Attention of each sequence's queries over keys ``k_nshd[kv_index_b[b], :limit_bt[b, i]]``.

    Returns ``(out [B, Tq, Hq, D] float32, lse [B, Tq, Hq] float32)``; rows with no visible key
    give ``out = 0``, ``lse = -inf`` with finite gradients (as :mod:`reference`).
    """
    b, tq, hq, d = q_bthd.shape
    n, s, hkv, _ = k_nshd.shape
    grp = hq // hkv
    if s == 0 or b * tq == 0:  # an empty key axis (nothing to see), or no query at all
        return jnp.zeros((b, tq, hq, d), jnp.float32), jnp.full((b, tq, hq), -jnp.inf, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    q = q_bthd.astype(jnp.float32).reshape(b, tq, hkv, grp, d)
    k = k_nshd.astype(jnp.float32)
    v = v_nshd.astype(jnp.float32)
    # Keys no row sees may hold anything (NaN too): zeroed, so that 0 * NaN reaches neither
    # ``p @ v`` nor, in the backward, ``ds @ k``.  (The last query of a sequence sees the most.)
    j = jnp.arange(s, dtype=jnp.int32)
    if n == 1:  # one pool entry for everyone: no per-sequence copy
        live = (j < jnp.max(limit_bt[:, -1]))[None, :, None, None]
        k, v = jnp.where(live, k, 0.0), jnp.where(live, v, 0.0)
        sc = jnp.einsum("bqhgd,khd->bhgqk", q, k[0], precision=hi)
    else:
        live = (j[None, :] < limit_bt[:, -1:])[:, :, None, None]
        k, v = jnp.where(live, k[kv_index_b], 0.0), jnp.where(live, v[kv_index_b], 0.0)
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=hi)
    sc = sc * scale
    mask = (j[None, None, :] < limit_bt[:, :, None])[:, None, None]
    sc = jnp.where(mask, sc, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(sc, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    pr = jnp.where(mask, jnp.exp(sc - m), 0.0)
    l = jnp.sum(pr, axis=-1, keepdims=True)
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    if n == 1:
        o = jnp.einsum("bhgqk,khd->bqhgd", pr / l_safe, v[0], precision=hi)
    else:
        o = jnp.einsum("bhgqk,bkhd->bqhgd", pr / l_safe, v, precision=hi)
    lse = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # [B, Hkv, G, Tq]
    return o.reshape(b, tq, hq, d), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, tq, hq)


def reference_shared_prefix(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                            prefix_lengths, suffix_lengths, scale):
    """Pure-JAX decomposition on canonical inputs (``prefix_k [G, P, Hkv, D]``).

    Returns ``(out [B, Tq, Hq, D]`` in q's dtype, ``lse [B, Tq, Hq]`` float32).
    """
    b, tq = q.shape[:2]
    lim_p, lim_s = row_limits(tq, prefix_lengths[seq_to_prefix], suffix_lengths)
    o_p, l_p = _part_attention(q, prefix_k, prefix_v, seq_to_prefix, lim_p, scale)
    o_s, l_s = _part_attention(q, suffix_k, suffix_v, jnp.arange(b, dtype=jnp.int32), lim_s, scale)
    out, lse = merge_attention_states([o_p, o_s], [l_p, l_s])
    return out.astype(q.dtype), lse


_reference_jit = jax.jit(reference_shared_prefix, static_argnames=("scale",))


# ----------------------------------------------------------------------------- kernels + vjp

# The kernels put one sequence's ``Tq * Hq / Hkv`` query rows in one row tile (and reject more:
# ``MAX_ROWS_PER_TILE``); beyond that (long suffix prefills) the queries are processed in
# chunks of consecutive positions.


def query_chunks(tq: int, group: int, max_rows: int | None = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` over ``Tq`` so that each chunk has at most ``max_rows`` rows
    (default :data:`MAX_ROWS_PER_TILE`; ``chunk * group`` rows, at least one position per chunk).
    Static: one kernel call per chunk, bounded by ``Tq``."""
    step = max(1, (MAX_ROWS_PER_TILE if max_rows is None else max_rows) // group)
    return [(c, min(c + step, tq)) for c in range(0, tq, step)]


# Backward of the Pallas paths: "kernels" (flash backward kernels, default) or "reference"
# (autodiff of the pure-JAX decomposition); see the module docstring.
BACKWARD = "kernels"


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                 suffix_lengths, scale, path, interpret):
    if q.shape[1] == 1:
        # Decoding: ``row_limits`` is then the identity on valid (non-negative) lengths; using
        # the lengths themselves leaves XLA no clamp / broadcast kernel to launch before the
        # Pallas calls (the suffix lengths are passed as they are, a bitcast).
        lim_p, lim_s = prefix_lengths[seq_to_prefix][:, None], suffix_lengths[:, None]
    else:
        lim_p, lim_s = row_limits(q.shape[1], prefix_lengths[seq_to_prefix], suffix_lengths)
    if path == "shared":
        from pallas_kernels.prefix_attention import shared_prefix_forward as fwd  # noqa: PLC0415
    else:
        from pallas_kernels.decode_attention import flat_forward as fwd  # noqa: PLC0415
    parts = [fwd(q[:, a:b], prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p[:, a:b],
                 lim_s[:, a:b], scale=scale, interpret=interpret, prefix_len_g=prefix_lengths)
             for a, b in query_chunks(q.shape[1], q.shape[2] // prefix_k.shape[2])]
    if len(parts) == 1:
        return parts[0]
    return (jnp.concatenate([o for o, _ in parts], axis=1),
            jnp.concatenate([l for _, l in parts], axis=1))


def _kernel_path_fwd(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                     suffix_lengths, scale, path, interpret):
    out, lse = _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                            prefix_lengths, suffix_lengths, scale, path, interpret)
    res = (q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
           suffix_lengths, out, lse)
    return (out, lse), res


def _kernel_path_bwd(scale, path, interpret, res, cts):
    q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths, suffix_lengths, \
        out, lse = res
    if BACKWARD == "reference":
        dq, dpk, dpv, dsk, dsv = _reference_grads(q, prefix_k, prefix_v, suffix_k, suffix_v,
                                                  seq_to_prefix, prefix_lengths, suffix_lengths,
                                                  cts[0], cts[1], scale)
    elif BACKWARD == "kernels":
        dq, dpk, dpv, dsk, dsv = _grads_via_kernels(
            q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
            suffix_lengths, out, lse, cts[0], cts[1], scale, interpret)
    else:
        raise ValueError(f"BACKWARD must be 'kernels' or 'reference', got {BACKWARD!r}")
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return dq, dpk, dpv, dsk, dsv, f0(seq_to_prefix), f0(prefix_lengths), f0(suffix_lengths)


def _kernel_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                  suffix_lengths, out, lse, cts, *, scale, interpret):
    """Gradients through the flash backward kernels: each part (prefix, suffix) is a flash
    backward evaluated with the merged ``out``/``lse`` (see
    :mod:`pallas_kernels.prefix_attention_bwd`); ``dq`` is the sum of the two parts'."""
    from pallas_kernels.prefix_attention_bwd import prefix_grads  # noqa: PLC0415
    from pallas_kernels.suffix_attention_bwd import suffix_part_grads  # noqa: PLC0415
    d_out, d_lse = cts
    delta = (jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
             - d_lse.astype(jnp.float32))                                       # [B, Tq, Hq]
    lim_p, _ = row_limits(q.shape[1], prefix_lengths[seq_to_prefix], suffix_lengths)
    dq_p, dpk, dpv = prefix_grads(q, d_out, lse, delta, prefix_k, prefix_v, seq_to_prefix, lim_p,
                                  prefix_lengths, scale=scale, interpret=interpret)
    dq_s, dsk, dsv = suffix_part_grads(q, d_out, lse, delta, suffix_k, suffix_v, suffix_lengths,
                                       scale=scale, interpret=interpret)
    dq = (dq_p.astype(jnp.float32) + dq_s.astype(jnp.float32)).astype(q.dtype)
    return dq, dpk, dpv, dsk, dsv


def _reference_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                     suffix_lengths, d_out, d_lse, scale):
    """The same gradients by autodiff of the reference decomposition (differentiable again)."""
    _, vjp = jax.vjp(lambda q_, pk, pv, sk, sv: reference_shared_prefix(
        q_, pk, pv, sk, sv, seq_to_prefix, prefix_lengths, suffix_lengths, scale),
        q, prefix_k, prefix_v, suffix_k, suffix_v)
    return vjp((d_out, d_lse))


# First-order gradients through the kernels; differentiating them again (grad of grad,
# Hessian-vector products) goes through the reference's autodiff, which the Pallas kernels
# have no rule for: correct, at the reference's memory cost.
@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13))
def _grads_via_kernels(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                       suffix_lengths, out, lse, d_out, d_lse, scale, interpret):
    return _kernel_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                         suffix_lengths, out, lse, (d_out, d_lse), scale=scale,
                         interpret=interpret)


def _grads_via_kernels_fwd(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                           prefix_lengths, suffix_lengths, out, lse, d_out, d_lse, scale,
                           interpret):
    grads = _grads_via_kernels(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                               prefix_lengths, suffix_lengths, out, lse, d_out, d_lse, scale,
                               interpret)
    return grads, (q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                   suffix_lengths, out, lse, d_out, d_lse)


def _grads_via_kernels_bwd(scale, interpret, res, cts):
    q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths, suffix_lengths, \
        out, lse, d_out, d_lse = res
    # (out and lse are functions of the inputs: the reference recomputes them, so their own
    # cotangents are zero and the inputs' carry the whole second-order term)
    _, vjp = jax.vjp(lambda q_, pk, pv, sk, sv, do, dl: _reference_grads(
        q_, pk, pv, sk, sv, seq_to_prefix, prefix_lengths, suffix_lengths, do, dl, scale),
        q, prefix_k, prefix_v, suffix_k, suffix_v, d_out, d_lse)
    dq, dpk, dpv, dsk, dsv, dd_out, dd_lse = vjp(tuple(cts))
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return (dq, dpk, dpv, dsk, dsv, f0(seq_to_prefix), f0(prefix_lengths), f0(suffix_lengths),
            jnp.zeros_like(out), jnp.zeros_like(lse), dd_out, dd_lse)


_grads_via_kernels.defvjp(_grads_via_kernels_fwd, _grads_via_kernels_bwd)
_kernel_path.defvjp(_kernel_path_fwd, _kernel_path_bwd)


# ----------------------------------------------------------------------------- public

def _kernel_supported(q, prefix_k, suffix_k) -> str | None:
    """``None`` when the Pallas kernels handle these (canonical) shapes, else the reason."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head_dim must be a power of two >= 16, got {d}"
    if prefix_k.shape[1] == 0 or suffix_k.shape[1] == 0:
        return (f"prefix and suffix axes must be non-empty, got P={prefix_k.shape[1]} and "
                f"S_max={suffix_k.shape[1]}")
    if q.shape[0] == 0 or q.shape[1] == 0:
        return f"q must hold at least one sequence and one query, got shape {tuple(q.shape)}"
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype must be float32, bfloat16 or float16, got {q.dtype}"
    return None



def shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, *, suffix_lengths,
                            prefix_lengths=None, seq_to_prefix=None, sm_scale=None,
                            return_lse: bool = False, impl: str = "auto"):
    """Attention of each sequence over its (shared) prefix followed by its own suffix.

    Args:
      q: ``[B, Tq, Hq, D]``: the queries of the newest ``Tq`` tokens of each sequence
        (``Tq == 1`` is decoding), causal among themselves.
      prefix_k, prefix_v: one shared prefix ``[P, Hkv, D]``, or ``G`` prefix groups
        ``[G, P, Hkv, D]`` (ragged prefixes padded to ``P``).
      suffix_k, suffix_v: ``[B, S_max, Hkv, D]`` per-sequence keys/values after the prefix.
      suffix_lengths: int ``[B]`` valid suffix lengths (dynamic: no recompilation).
      prefix_lengths: int ``[G]`` valid prefix lengths (default ``P``).
      seq_to_prefix: int ``[B]`` prefix group of each sequence (required when ``G > 1``).
      sm_scale: score scale, default ``1/sqrt(D)``.
      return_lse: also return the log-sum-exp.
      impl: ``"auto"``, ``"shared"``, ``"flat"``, ``"reference"``, ``"pallas_interpret"``
        (shared path's kernels in interpret mode), ``"flat_interpret"``.

    Returns:
      ``out [B, Tq, Hq, D]`` in q's dtype, exactly :func:`jax_prefix_attn.reference.attention`
      over ``[prefix[:prefix_len]; suffix[:suffix_len]]`` with bottom-right causal masking;
      with ``return_lse`` also ``lse [B, Tq, Hq]`` float32.
    """
    prefix_k, prefix_v, seq_to_prefix, prefix_lengths, suffix_lengths = _validate(
        q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lengths, prefix_lengths,
        seq_to_prefix, sm_scale, return_lse, impl)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    kernel_ok = _kernel_supported(q, prefix_k, suffix_k)
    if impl == "auto":
        if jax.default_backend() == "gpu" and kernel_ok is None:
            from jax_prefix_attn.cost_model import choose_path  # noqa: PLC0415
            impl = choose_path(batch=q.shape[0], tq=q.shape[1], heads_q=q.shape[2],
                               heads_kv=prefix_k.shape[2], head_dim=q.shape[3],
                               groups=prefix_k.shape[0], prefix_len=prefix_k.shape[1],
                               suffix_len=suffix_k.shape[1], itemsize=q.dtype.itemsize)
        else:
            impl = "reference"
    if impl != "reference" and kernel_ok is not None:
        raise ValueError(f"impl={impl!r} (Pallas kernels) cannot run these shapes: {kernel_ok}; "
                         f"use impl='reference'")
    if impl == "reference":
        out, lse = _reference_jit(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                                  prefix_lengths, suffix_lengths, scale=scale)
    else:
        path = "flat" if impl in ("flat", "flat_interpret") else "shared"
        interpret = impl in ("pallas_interpret", "flat_interpret")
        out, lse = _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                                prefix_lengths, suffix_lengths, scale, path, interpret)
    return (out, lse) if return_lse else out
