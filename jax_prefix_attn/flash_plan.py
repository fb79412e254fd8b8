"""Which flash-attention kernels run :func:`jax_prefix_attn.attention` with ``impl="auto"``:
a :class:`FlashPlan` names the kernel family of the forward and of the backward, chosen from the
static shapes and the device; :func:`run_flash_plan` runs it.

Families:

* ``"mgpu"``: :mod:`pallas_kernels.flash_attention_mgpu` and ``flash_attention_mgpu_bwd``
  (Mosaic GPU: TMA, wgmma, warp specialisation; compute capability 9.0 or newer, bfloat16 and
  float16);
* ``"triton"``: :mod:`pallas_kernels.flash_attention` (Pallas's Triton backend; any CUDA GPU,
  float32 too);
* ``"reference"``: :func:`jax_prefix_attn.reference.attention` (pure JAX; off the GPU).

:func:`plan_flash` takes the Mosaic GPU kernels, forward and backward, wherever they run and the
query axis fills their row blocks, else the Triton kernels.  The figures behind the rule are in
``docs/performance.md`` ("Flash attention"), ``bench/results/flash_attention_h200.json`` and
``bench/results/flash_attention_mgpu_bwd_sweep_h200.json`` (the backward at head_dim 256).
"""
from __future__ import annotations

import dataclasses

from jax_prefix_attn import reference
from jax_prefix_attn.device import DeviceInfo
from pallas_kernels import flash_attention as triton_flash
from pallas_kernels import flash_attention_mgpu as mgpu_flash
from pallas_kernels.flash_attention_mgpu_vjp import flash_attention_mgpu_vjp

__all__ = ["FlashPlan", "plan_flash", "run_flash_plan", "FAMILIES", "PAIRS", "MGPU_MIN_QUERIES"]

FAMILIES = ("mgpu", "triton", "reference")
# (forward, backward) pairs: each family differentiates its own forward.
PAIRS = (("mgpu", "mgpu"), ("triton", "triton"), ("reference", "reference"))
# Query positions below which the Triton forward keeps the call: a Mosaic GPU CTA computes two
# 64-row blocks of (position, head-of-group) rows, so a short query axis leaves most of its
# wgmma rows as padding (the measured grid starts at 1K positions).
MGPU_MIN_QUERIES = 64


@dataclasses.dataclass(frozen=True)
class FlashPlan:
    """Kernel families of one attention call: ``forward`` and ``backward``, one of
    :data:`PAIRS`, and the ``reason`` they were chosen."""
    forward: str
    backward: str
    reason: str = ""

    def __post_init__(self):
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value not in FAMILIES:
                raise ValueError(f"FlashPlan.{name} must be one of {FAMILIES}, got {value!r}")
        if (self.forward, self.backward) not in PAIRS:
            raise ValueError(f"FlashPlan: forward={self.forward!r} with backward="
                             f"{self.backward!r} is not a pair that runs; pairs: {PAIRS}")


def plan_flash(q_shape, k_shape, dtype, dev: DeviceInfo) -> FlashPlan:
    """The :class:`FlashPlan` of attention of ``q [B, Tq, Hq, D]`` over ``k/v [B, Tk, Hkv, D]``
    of ``dtype`` on ``dev``: off a GPU, or where no kernel takes the shapes, the reference;
    Mosaic GPU both ways on compute capability 9.0+ for 16-bit inputs with at least
    :data:`MGPU_MIN_QUERIES` query positions; otherwise Triton both ways."""
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if not dev.is_gpu:
        return FlashPlan("reference", "reference", f"{dev.platform}: no GPU kernels")
    triton_why = triton_flash.supported(q_shape, k_shape, dtype)
    mgpu_why = mgpu_flash.supported(q_shape, k_shape, dtype)
    if not dev.mosaic_gpu_ok:
        mgpu_why = f"compute capability {dev.compute_capability or 'unknown'} is below 9.0"
    elif mgpu_why is None and q_shape[1] < MGPU_MIN_QUERIES:
        mgpu_why = f"{q_shape[1]} query positions, fewer than {MGPU_MIN_QUERIES}"
    if mgpu_why is None:
        return FlashPlan("mgpu", "mgpu", "Mosaic GPU forward and backward")
    if triton_why is None:
        return FlashPlan("triton", "triton", f"Triton kernels (Mosaic GPU: {mgpu_why})")
    return FlashPlan("reference", "reference", f"no kernel takes the shapes: {triton_why}")


def run_flash_plan(plan: FlashPlan, q, k, v, *, causal: bool = False, kv_lengths=None,
                   sm_scale=None, interpret: bool = False):
    """``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)`` of ``plan``'s kernels, differentiable
    through both outputs (inputs validated by the caller, :func:`jax_prefix_attn.attention`)."""
    if not isinstance(plan, FlashPlan):
        raise TypeError(f"plan must be a FlashPlan, got {type(plan).__name__}")
    kw = dict(causal=causal, kv_lengths=kv_lengths, sm_scale=sm_scale)
    if plan.forward == "reference":
        return reference.attention(q, k, v, **kw)
    if plan.forward == "triton":
        return triton_flash.flash_attention(q, k, v, interpret=interpret, **kw)
    return flash_attention_mgpu_vjp(q, k, v, interpret=interpret, **kw)
