"""``plan_flash``: which kernel families run ``attention(impl="auto")`` per device and shape;
``FlashPlan`` validation; the plans lowered for CUDA with their gradients, and on an H200 run
against the reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, rel_err
from jax_prefix_attn.device import CPU, H100_PCIE, H200, DeviceInfo
from jax_prefix_attn.flash_plan import (MGPU_MIN_QUERIES, FlashPlan, plan_flash,
                                        run_flash_plan)

A100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("dev,q_shape,k_shape,dtype,want", [
    (H200, (2, 2048, 32, 128), (2, 2048, 8, 128), BF16, ("mgpu", "mgpu")),
    (H200, (4, 1024, 16, 64), (4, 1024, 16, 64), F16, ("mgpu", "mgpu")),
    (H100_PCIE, (1, 4096, 8, 96), (1, 4096, 8, 96), BF16, ("mgpu", "mgpu")),
    (H200, (2, 2048, 8, 256), (2, 2048, 8, 256), BF16, ("mgpu", "mgpu")),
    (H200, (2, 512, 8, 160), (2, 512, 2, 160), BF16, ("mgpu", "mgpu")),
    (H200, (2, 2048, 32, 128), (2, 2048, 8, 128), F32, ("triton", "triton")),
    (H200, (8, MGPU_MIN_QUERIES - 1, 32, 128), (8, 4096, 8, 128), BF16, ("triton", "triton")),
    (H200, (8, MGPU_MIN_QUERIES, 32, 128), (8, 4096, 8, 128), BF16, ("mgpu", "mgpu")),
    (A100, (2, 2048, 32, 128), (2, 2048, 8, 128), BF16, ("triton", "triton")),
    (H200, (2, 2048, 8, 512), (2, 2048, 8, 512), BF16, ("reference", "reference")),
    (CPU, (2, 2048, 32, 128), (2, 2048, 8, 128), BF16, ("reference", "reference")),
])
def test_plan_flash_picks_by_device_dtype_and_shape(dev, q_shape, k_shape, dtype, want):
    plan = plan_flash(q_shape, k_shape, dtype, dev)
    assert (plan.forward, plan.backward) == want, plan
    assert plan.reason


@pytest.mark.parametrize("fwd,bwd,match", [
    ("mgpu", "cudnn", "backward must be one of"),
    ("triton", "mgpu", "not a pair that runs"),
    ("mgpu", "triton", "not a pair that runs"),
    ("reference", "triton", "not a pair that runs"),
])
def test_flash_plan_rejects_pairs_that_do_not_run(fwd, bwd, match):
    with pytest.raises(ValueError, match=match):
        FlashPlan(fwd, bwd)


def test_run_flash_plan_rejects_a_non_plan():
    x = jnp.zeros((1, 4, 2, 64), BF16)
    with pytest.raises(TypeError, match="plan must be a FlashPlan, got tuple"):
        run_flash_plan(("mgpu", "mgpu"), x, x, x)


@pytest.mark.parametrize("d,plan", [(256, FlashPlan("mgpu", "mgpu")), (128, FlashPlan("mgpu", "mgpu")),
                                    (128, FlashPlan("triton", "triton"))])
def test_plans_lower_for_cuda_with_their_gradients(d, plan):
    """The plans ``plan_flash`` gives an H200 at prefill shapes lower for CUDA on the CPU
    (forward and backward kernels: Mosaic GPU's layout and transfer inference, Triton's
    lowering), under ``jax.grad`` of a loss of ``out`` and ``lse``."""
    s = jax.ShapeDtypeStruct
    q, kv = s((2, 256, 8, d), BF16), s((2, 256, 2, d), BF16)
    if plan.forward == "mgpu":
        assert plan_flash(q.shape, kv.shape, BF16, H200) == dataclasses.replace(
            plan, reason=plan_flash(q.shape, kv.shape, BF16, H200).reason)

    def loss(q, k, v):
        o, l = run_flash_plan(plan, q, k, v, causal=True, kv_lengths=jnp.array([256, 100]))
        return jnp.sum(o.astype(F32)) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0))

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert text.count("mosaic_gpu") >= 2 if plan.forward == "mgpu" else "mosaic_gpu" not in text
    assert ("triton" in text) == (plan.forward == "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("d,want", [(128, ("mgpu", "mgpu")), (256, ("mgpu", "mgpu"))])
def test_gpu_auto_runs_its_plan_against_the_reference(d, want):
    """On an H200, ``attention(impl="auto")`` at prefill shapes: the plan it takes, and its
    forward and gradients (through ``out`` and ``lse``) against the reference, ragged causal,
    GQA 4, in one program."""
    from jax_prefix_attn import attention
    from jax_prefix_attn.device import device_info
    b, t, hq, hkv = 2, 1024, 16, 4
    plan = plan_flash((b, t, hq, d), (b, t, hkv, d), BF16, device_info())
    assert (plan.forward, plan.backward) == want, plan
    ks = jax.random.split(jax.random.PRNGKey(d), 5)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), F32).astype(BF16)
               for kk, h in zip(ks, (hq, hkv, hkv)))
    lengths = jnp.array([t, 700], jnp.int32)
    w_out = jax.random.normal(ks[3], (b, t, hq, d), F32)
    w_lse = jax.random.normal(ks[4], (b, t, hq), F32)

    @jax.jit
    def run(q, k, v):
        def grads(impl, q, k, v):
            def loss(q, k, v):
                o, l = attention(q, k, v, causal=True, kv_lengths=lengths, impl=impl)
                fin = jnp.where(jnp.isfinite(l), l, 0)
                return jnp.sum(o.astype(F32) * w_out) + jnp.sum(fin * w_lse), (o, l)
            return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return grads("auto", q, k, v), grads("reference", *(x.astype(F32) for x in (q, k, v)))

    (got, (out, lse)), (want_g, (want_out, want_lse)) = run(q, k, v)
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    assert np.abs(lse[fin] - want_lse[fin]).max() < 2e-2
    assert rel_err(out, want_out) < 2e-2
    for name, g, w in zip("qkv", got, want_g):
        assert rel_err(g, w) < 3e-2, name
