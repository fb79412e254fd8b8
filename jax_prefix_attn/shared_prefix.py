"""Shared-prefix attention (Hydragen / RelayAttention): the public entry point.

Many sequences share a prompt (or one of ``G`` prompts).  Attention of each sequence over
``[its prefix[:prefix_len]; its suffix[:suffix_len]]`` is split into attention over the
prefix and attention over the suffix, merged exactly through the log-sum-exp (Hydragen
section 3.1, RelayAttention section 3.3).  The prefix part is computed for all sequences
that share a prefix as one matrix-matrix product per kv head (inter-sequence batching), so
the prefix's keys and values are read about once per batch instead of once per sequence.

Key visibility, derived from the project's causal convention on the concatenation
(length ``L = pl + sl``, query ``i`` of ``Tq`` sees ``j < L`` and ``j <= i + L - Tq``),
is a *per-row key limit* in both parts (:func:`jax_prefix_attn.reference.row_limits`):

* prefix keys ``j < lim_p[b, i] = clip(pl + sl - Tq + i + 1, 0, pl)``;
* suffix keys ``j < lim_s[b, i] = clip(sl - Tq + i + 1, 0, sl)``.

Every implementation computes exactly these masks; ``suffix_lengths < Tq`` (queries that fall
inside the prefix) is therefore handled too.  Traced lengths and groups out of range follow one
clamp rule in every implementation (:func:`jax_prefix_attn.reference.clamp_shared_inputs`):
lengths to ``[0, capacity]``, ``seq_to_prefix`` to ``[0, G - 1]``; when decoding the kernels
clamp the lengths they read themselves (no XLA op before the launch), elsewhere the executor
clamps them with the rest of its metadata arithmetic.

:func:`shared_prefix_attention` validates its inputs, plans the call
(:func:`jax_prefix_attn.planner.plan_shared_prefix`, or takes ``plan=``), and runs the plan
(:mod:`jax_prefix_attn.executor`).  ``impl`` names an algorithm:

* ``"reference"``: pure JAX (prefix part + suffix part + :func:`merge_attention_states`);
* ``"shared"``: the prefix pass batched over the sequences that share a prefix, the suffix pass
  per sequence, and their merge (the best leaf of that family for the shapes and device);
* ``"flat"``: one ragged split-KV decode launch that reads the prefix through a per-sequence
  index for every sequence, without copying it (the PagedAttention-style baseline);
* ``"auto"``: on the GPU, the cheaper of ``"shared"`` and ``"flat"`` by the planner's cost
  model; elsewhere ``"reference"``.

``interpret=True`` runs the chosen kernels in interpret mode (CPU).

Gradients: the kernel paths have a ``custom_vjp`` whose backward runs flash backward kernels
(the plan's ``backward="kernels"``): with the merged ``out`` and ``lse`` saved by
the forward, each part's gradient is a flash-attention backward evaluated with those merged
statistics, so the merge needs no backward of its own.  The prefix part's kernels
(:mod:`pallas_kernels.prefix_attention_bwd`) batch the rows of every sequence that shares a
prefix, as the forward does: ``dK``/``dV`` of a prefix are summed over its sequences inside
the kernel.  The suffix part is :func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`.
Nothing of size ``[B, Tq, Hq, P]`` is materialised.  ``backward="mgpu"`` runs both parts on the
Mosaic GPU flash backward kernels instead (:mod:`jax_prefix_attn.mgpu_grads`); the default
``backward="auto"`` takes it on Hopper from the device profile's ``mgpu_backward_min_tq`` query
rows per sequence (faster there), the Triton kernels below.  ``backward="reference"`` differentiates
the pure-JAX reference decomposition instead (it materialises the probabilities).
Second-order derivatives (grad of grad) work either way: differentiating the kernel backward
goes through the reference's autodiff.  Both families share the backward: it depends only on
the inputs, ``out`` and ``lse``.
"""
from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn._validation import (check_array, check_bool, check_gqa, check_impl, check_kv,
                                         check_prefix_groups, check_sm_scale)
from jax_prefix_attn.executor import run_plan
from jax_prefix_attn.mgpu_grads import mgpu_grads
from jax_prefix_attn.planner import IMPLS, plan_shared_prefix, shared_prefix_supported
from jax_prefix_attn.plans import SharedPrefixPlan, Shapes
from jax_prefix_attn.reference import clamp_shared_inputs, reference_shared_prefix, row_limits
from pallas_kernels._common import flag_nonfinite, kernel_head_dim, pad_axis
from pallas_kernels.prefix_attention_bwd import prefix_grads
from pallas_kernels.suffix_attention_bwd import suffix_part_grads

__all__ = ["shared_prefix_attention", "shared_prefix_supported", "concurrent_compiler_options"]

# XLA options for the user's ``jax.jit`` of a decode step: XLA's CUDA graphs then run
# independent launches at the same time (scheduling "CONCURRENT", graphs of any size).  The
# Mosaic GPU two-launch leaf's prefix launch (tensor-core bound) and suffix launch (memory
# bound) are independent, so they can overlap (measured: docs/performance.md, "Kernel design
# measurements").  Opt-in: it can raise peak memory, as buffers of concurrent ops cannot share
# space.
_CONCURRENT = types.MappingProxyType({"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
                                      "xla_gpu_graph_min_graph_size": 1})


def concurrent_compiler_options() -> dict:
    """``jax.jit(step, compiler_options=concurrent_compiler_options())``: let XLA run the decode
    step's independent launches concurrently (see ``_CONCURRENT``)."""
    return dict(_CONCURRENT)


def _validate(q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lengths, prefix_lengths,
              seq_to_prefix, sm_scale, return_lse, impl, interpret, check_ranges):
    """Validate and canonicalise; returns ``(prefix_k, prefix_v [G, P, Hkv, D], seq_to_prefix [B],
    prefix_lengths [G])``."""
    check_impl(impl, IMPLS)
    check_bool("interpret", interpret)
    check_bool("check_ranges", check_ranges)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_kv("prefix_k", prefix_k, "prefix_v", prefix_v, (3, 4),
             layout="[P, heads_kv, head_dim] or [G, P, heads_kv, head_dim]", dtype=q.dtype,
             dtype_of="q")
    check_kv("suffix_k", suffix_k, "suffix_v", suffix_v, 4,
             layout="[batch, S_max, heads_kv, head_dim]", dtype=q.dtype, dtype_of="q")
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
    check_gqa(hq, hkv)
    check_sm_scale(sm_scale)
    seq_to_prefix, prefix_lengths, suffix_lengths = check_prefix_groups(
        "prefix_k", prefix_k.shape, b, suffix_lengths=suffix_lengths, suffix_cap=suffix_k.shape[1],
        prefix_lengths=prefix_lengths, seq_to_prefix=seq_to_prefix, check_ranges=check_ranges)
    return prefix_k, prefix_v, seq_to_prefix, prefix_lengths, suffix_lengths


_reference_jit = jax.jit(reference_shared_prefix, static_argnames=("scale",))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                 suffix_lengths, scale, plan, interpret):
    return run_plan(plan, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                    prefix_lengths, suffix_lengths, scale, interpret)


def _kernel_path_fwd(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                     suffix_lengths, scale, plan, interpret):
    out, lse = _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                            prefix_lengths, suffix_lengths, scale, plan, interpret)
    res = (q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
           suffix_lengths, out, lse)
    return (out, lse), res


def _kernel_path_bwd(scale, plan, interpret, res, cts):
    q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths, suffix_lengths, \
        out, lse = res
    if plan.backward.mode == "reference":
        dq, dpk, dpv, dsk, dsv = _reference_grads(q, prefix_k, prefix_v, suffix_k, suffix_v,
                                                  seq_to_prefix, prefix_lengths, suffix_lengths,
                                                  cts[0], cts[1], scale)
    else:
        dq, dpk, dpv, dsk, dsv = _grads_via_kernels(
            q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
            suffix_lengths, out, lse, cts[0], cts[1], scale, plan.backward, interpret)
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return dq, dpk, dpv, dsk, dsv, f0(seq_to_prefix), f0(prefix_lengths), f0(suffix_lengths)


def _kernel_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                  suffix_lengths, out, lse, cts, *, scale, backward, interpret):
    """Gradients through the flash backward kernels: each part (prefix, suffix) is a flash
    backward evaluated with the merged ``out``/``lse`` (see
    :mod:`pallas_kernels.prefix_attention_bwd`); ``dq`` is the sum of the two parts'."""
    d_out, d_lse = cts
    seq_to_prefix, prefix_lengths, suffix_lengths = clamp_shared_inputs(
        seq_to_prefix, prefix_lengths, suffix_lengths, *prefix_k.shape[:2], suffix_k.shape[1])
    delta = (jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
             - d_lse.astype(jnp.float32))                                       # [B, Tq, Hq]
    if backward.mode == "mgpu":
        grads = mgpu_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                           suffix_lengths, lse, delta, d_out, d_lse, scale=scale, interpret=interpret)
        inputs = (q, prefix_k, prefix_v, suffix_k, suffix_v)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, inputs))
    lim_p, _ = row_limits(q.shape[1], prefix_lengths[seq_to_prefix], suffix_lengths)
    dq_p, dpk, dpv = prefix_grads(q, d_out, lse, delta, prefix_k, prefix_v, seq_to_prefix, lim_p,
                                  prefix_lengths, scale=scale, interpret=interpret,
                                  row_splits=backward.prefix_row_splits,
                                  key_splits=backward.prefix_key_splits)
    dq_s, dsk, dsv = suffix_part_grads(q, d_out, lse, delta, suffix_k, suffix_v, suffix_lengths,
                                       scale=scale, interpret=interpret,
                                       key_splits=backward.suffix_key_splits)
    dq = (dq_p.astype(jnp.float32) + dq_s.astype(jnp.float32)).astype(q.dtype)
    return dq, dpk, dpv, dsk, dsv


def _reference_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                     suffix_lengths, d_out, d_lse, scale):
    """The same gradients by autodiff of the reference decomposition (differentiable again)."""
    _, vjp = jax.vjp(lambda q_, pk, pv, sk, sv: reference_shared_prefix(
        q_, pk, pv, sk, sv, seq_to_prefix, prefix_lengths, suffix_lengths, scale),
        q, prefix_k, prefix_v, suffix_k, suffix_v)
    return vjp((d_out, d_lse))


@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13, 14))
def _grads_via_kernels(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                       suffix_lengths, out, lse, d_out, d_lse, scale, backward, interpret):
    return _kernel_grads(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                         suffix_lengths, out, lse, (d_out, d_lse), scale=scale,
                         backward=backward, interpret=interpret)


def _grads_via_kernels_fwd(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                           prefix_lengths, suffix_lengths, out, lse, d_out, d_lse, scale,
                           backward, interpret):
    grads = _grads_via_kernels(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                               prefix_lengths, suffix_lengths, out, lse, d_out, d_lse, scale,
                               backward, interpret)
    return grads, (q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, prefix_lengths,
                   suffix_lengths, out, lse, d_out, d_lse)


def _grads_via_kernels_bwd(scale, backward, interpret, res, cts):
    del backward, interpret
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


def shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, *, suffix_lengths,
                            prefix_lengths=None, seq_to_prefix=None, sm_scale=None,
                            return_lse: bool = False, impl: str = "auto",
                            interpret: bool = False, plan: SharedPrefixPlan | None = None,
                            backward: str = "auto", check_ranges: bool = False):
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
      impl: ``"auto"``, ``"shared"``, ``"flat"`` or ``"reference"`` (see the module docstring).
      interpret: run the kernels in Pallas interpret mode (CPU).
      plan: a :class:`SharedPrefixPlan` for these shapes
        (:func:`jax_prefix_attn.plan_shared_prefix`), overriding ``impl``'s planning: forces a
        leaf, its tiling and the backward.
      backward: the backward of the kernel paths when ``plan`` is not given: ``"auto"``,
        ``"kernels"`` (Triton), ``"mgpu"`` (Mosaic GPU) or ``"reference"``
        (:func:`plan_shared_prefix`).
      check_ranges: add ``checkify`` checks of traced lengths and ``seq_to_prefix`` (out-of-range
        values are clamped, the module docstring); the caller wraps the call in
        ``checkify.checkify(..., errors=checkify.user_checks)``.  Off: no check is compiled.

    Returns:
      ``out [B, Tq, Hq, D]`` in q's dtype, exactly :func:`jax_prefix_attn.reference.attention`
      over ``[prefix[:prefix_len]; suffix[:suffix_len]]`` with bottom-right causal masking;
      with ``return_lse`` also ``lse [B, Tq, Hq]`` float32.
    """
    prefix_k, prefix_v, seq_to_prefix, prefix_lengths, suffix_lengths = _validate(
        q, prefix_k, prefix_v, suffix_k, suffix_v, suffix_lengths, prefix_lengths,
        seq_to_prefix, sm_scale, return_lse, impl, interpret, check_ranges)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    shapes = dict(batch=q.shape[0], tq=q.shape[1], heads_q=q.shape[2], heads_kv=prefix_k.shape[2],
                  head_dim=q.shape[3], groups=prefix_k.shape[0], prefix_len=prefix_k.shape[1],
                  suffix_len=suffix_k.shape[1])
    if plan is None:
        plan = plan_shared_prefix(**shapes, dtype=q.dtype, impl=impl, interpret=interpret,
                                  backward=backward)
    else:
        if backward != "auto":
            raise ValueError(f"pass backward= or plan= (whose backward is {plan.backward.mode!r}), "
                             f"not both; got backward={backward!r}")
        if not isinstance(plan, SharedPrefixPlan):
            raise TypeError(f"plan must be a SharedPrefixPlan (plan_shared_prefix), got "
                            f"{type(plan).__name__}")
        want = Shapes(**shapes, dtype=jnp.dtype(q.dtype).name)
        if plan.shapes != want:
            raise ValueError(f"plan was made for {plan.shapes}, but the inputs have {want}")
    if plan.impl == "reference":
        out, lse = _reference_jit(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                                  prefix_lengths, suffix_lengths, scale=scale)
    else:
        # (a head_dim that is not a power of two runs zero-padded: scores are unchanged)
        d = q.shape[-1]
        dk = kernel_head_dim(d)
        q, prefix_k, prefix_v, suffix_k, suffix_v = (
            pad_axis(x, x.ndim - 1, dk) for x in (q, prefix_k, prefix_v, suffix_k, suffix_v))
        out, lse = _kernel_path(q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix,
                                prefix_lengths, suffix_lengths, scale, plan, interpret)
        out = out[..., :d]
        if return_lse:  # (kernels leave a finite LSE on rows whose NaN came from a value)
            lse = flag_nonfinite(jax.lax.stop_gradient(out), lse)
    return (out, lse) if return_lse else out
