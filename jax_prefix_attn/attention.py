"""Public flash-attention entry point: validate, choose the algorithm, run it.

``impl`` names the algorithm:

* ``"flash"``: :func:`pallas_kernels.flash_attention.flash_attention` (Pallas, one pass over
  the keys with an online softmax: nothing of size ``[Tq, Tk]`` is stored);
* ``"flash_mgpu"``: :func:`pallas_kernels.flash_attention_mgpu_vjp.flash_attention_mgpu_vjp`
  (Mosaic GPU: TMA, wgmma and warp specialization, forward and backward kernels; Hopper GPUs,
  bfloat16 and float16);
* ``"reference"``: :func:`jax_prefix_attn.reference.attention` (pure JAX, materialises the
  scores);
* ``"auto"``: the kernels :func:`jax_prefix_attn.flash_plan.plan_flash` picks for the shapes
  and the device (on Hopper and newer GPUs the Mosaic GPU kernels for 16-bit inputs; the Triton
  kernels on other GPUs and for float32; the
  reference off the GPU).

``interpret=True`` runs the Pallas kernels in interpret mode (any backend, e.g. CPU tests with
``impl="flash"`` or ``impl="flash_mgpu"``).
"""
from __future__ import annotations

import types

import jax

from jax_prefix_attn._validation import check_bool, check_impl, check_qkv
from jax_prefix_attn.device import device_info
from jax_prefix_attn.flash_plan import FlashPlan, plan_flash, run_flash_plan
from pallas_kernels import flash_attention as flash
from pallas_kernels import flash_attention_mgpu as flash_mgpu
from pallas_kernels._common import flag_nonfinite

IMPLS = ("auto", "flash", "flash_mgpu", "reference")
# The kernel families (forward, backward) of each impl other than "auto".
FIXED_PLANS = types.MappingProxyType({"flash": ("triton", "triton"), "flash_mgpu": ("mgpu", "mgpu"),
                                      "reference": ("reference", "reference")})


def attention(q, k, v, *, causal: bool = False, kv_lengths=None, sm_scale=None, impl: str = "auto",
              interpret: bool = False, check_ranges: bool = False):
    """Attention ``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)`` of ``q [B, Tq, Hq, D]`` over
    ``k, v [B, Tk, Hkv, D]`` (GQA: ``Hq % Hkv == 0``).

    ``causal``: bottom-right causal mask aligned to each sequence's valid length;
    ``kv_lengths``: optional int ``[B]``, keys at or past it are masked (data: no recompile);
    ``sm_scale``: score scale, default ``1/sqrt(D)``; ``impl``, ``interpret``: see the module
    docstring; ``check_ranges``: ``checkify`` checks of traced ``kv_lengths`` (clamped to
    ``[0, Tk]``), for a caller that wraps the call in ``checkify.checkify``.  Rows that see no key get ``out = 0``, ``lse = -inf``; a row that sees a NaN or
    an infinity (in its query, a visible key or a visible value) gets NaN in ``out`` and ``lse``.
    """
    check_impl(impl, IMPLS)
    check_bool("check_ranges", check_ranges)
    check_qkv(q, k, v, kv_lengths=kv_lengths, sm_scale=sm_scale, check_ranges=check_ranges)
    check_bool("causal", causal)
    check_bool("interpret", interpret)
    if impl == "auto":
        plan = plan_flash(q.shape, k.shape, q.dtype, device_info())
    else:
        plan = FlashPlan(*FIXED_PLANS[impl], reason=f"impl={impl!r}")
        kernel = {"mgpu": flash_mgpu, "triton": flash}.get(plan.forward)
        reason = None if kernel is None else kernel.supported(q.shape, k.shape, q.dtype)
        if reason is not None:
            raise ValueError(f"impl={impl!r} (Pallas kernel) cannot run these shapes: {reason}; "
                             f"use impl='reference'")
    out, lse = run_flash_plan(plan, q, k, v, causal=causal, kv_lengths=kv_lengths,
                              sm_scale=sm_scale, interpret=interpret)
    if plan.forward == "reference":
        return out, lse
    return out, flag_nonfinite(jax.lax.stop_gradient(out), lse)
