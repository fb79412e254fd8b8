"""The one-launch prefix + suffix decode kernel (``pallas_kernels.shared_decode_mgpu``) and the
planner's ``mgpu_one_launch`` leaf.

CPU: the task interleaving; the kernel lowered for CUDA; the kernel's prefix and suffix tasks in
Mosaic GPU's CPU interpreter against an independent float64 NumPy computation (suffix caches
poisoned with NaN past each length); the leaf (forced by a plan) against the concatenation
oracle; where the planner takes the leaf.  GPU (marker ``gpu``): the same on the device.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (check_row_states, decode_row_states, decode_rows_case, forced_plan,
                     lower_for_cuda)
from jax_prefix_attn import DeviceInfo, device_info, plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H100_PCIE, H100_SXM
from jax_prefix_attn.leaf_plans import one_launch_region
from jax_prefix_attn.plans import Shapes
from pallas_kernels.shared_decode_mgpu import fused_supported, shared_decode_partials_mgpu, task_order
from helpers import check, make_case, oracle


@pytest.mark.parametrize("n_pre,n_suf", [(7, 3), (3, 7), (4, 4), (5, 0), (0, 2)])
def test_task_order_is_a_bijection(n_pre, n_suf):
    seen = set()
    for t in range(n_pre + n_suf):
        is_suf, idx = task_order(jnp.int32(t), n_pre, n_suf)
        seen.add((bool(is_suf), int(idx)))
    assert seen == {(False, i) for i in range(n_pre)} | {(True, i) for i in range(n_suf)}
    if n_pre and n_suf:   # a suffix task first, then alternating
        assert [bool(task_order(jnp.int32(t), n_pre, n_suf)[0]) for t in range(2)] == [True, False]


def test_supported_and_errors():
    bf = jnp.bfloat16
    assert fused_supported(batch=256, heads_q=32, heads_kv=8, prefix_len=4096, suffix_cap=128,
                           head_dim=128, dtype=bf) is None
    assert "power of two" in fused_supported(batch=8, heads_q=12, heads_kv=4, prefix_len=256,
                                             suffix_cap=64, head_dim=64, dtype=bf)
    assert "multiple of block_s" in fused_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                                    suffix_cap=100, head_dim=64, dtype=bf)
    assert "dtype" in fused_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                      suffix_cap=64, head_dim=64, dtype=jnp.float32)
    q = jnp.zeros((2, 100, 64), bf)
    k = jnp.zeros((256, 2, 64), bf)
    sk = jnp.zeros((20, 64, 2, 64), bf)
    with pytest.raises(ValueError, match="multiple of 128"):
        shared_decode_partials_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0, group=4)
    q = jnp.zeros((2, 128, 64), bf)
    with pytest.raises(ValueError, match="suffix_splits=3"):
        shared_decode_partials_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0,
                                    group=4, suffix_splits=3)
    with pytest.raises(ValueError, match="tasks"):
        shared_decode_partials_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0,
                                    group=4, tasks=("both",))


def _run(b, hq, hkv, d, p, p_len, s, splits, ss, block_s, interpret, steps=2):
    q, pk, pv, sk, sv, sl = decode_rows_case(b * 31 + p + s, b, hq, hkv, d, p, s)
    g = hq // hkv
    o_pre, l_pre, o_suf, l_suf = shared_decode_partials_mgpu(
        q, pk, pv, p_len, sk, sv, jnp.asarray(sl, jnp.int32), scale=d ** -0.5, group=g,
        num_splits=splits, suffix_splits=ss, block_s=block_s, suffix_steps=steps,
        interpret=interpret, _cpu_check=interpret)
    assert o_pre.shape[0] == splits and o_suf.shape[0] == ss
    want = decode_row_states(q, pk, pv, p_len, sk, sv, sl, g, d ** -0.5)
    check_row_states([(o_pre, l_pre), (o_suf, l_suf)], want, b, g)


@pytest.mark.parametrize("d,block_s,steps", [(128, 64, 2), (64, 128, 3)])
def test_kernel_lowers_for_cuda(d, block_s, steps):
    """Lowered for CUDA (shared memory checked against Hopper's 227 KB per CTA)."""
    S = jax.ShapeDtypeStruct
    b, hq, hkv, p, s = 64, 32, 8, 1024, 256
    txt = lower_for_cuda(
        lambda q, pk, pv, n, sk, sv, sl: shared_decode_partials_mgpu(
            q, pk, pv, n, sk, sv, sl, scale=d ** -0.5, group=4, suffix_splits=2,
            block_s=block_s, suffix_steps=steps),
        S((hkv, b * 4, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
        S((), jnp.int32), S((b, s, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,ss,block_s", [
    (20, 8, 2, 64, 256, 200, 128, 2, 1, 64),    # G = 4, 2 kv heads, ragged prefix, 2 splits
    (12, 8, 1, 128, 256, 256, 128, 1, 2, 64),   # G = 8, S split in 2
])
def test_kernel_in_cpu_interpreter(b, hq, hkv, d, p, p_len, s, splits, ss, block_s):
    _run(b, hq, hkv, d, p, p_len, s, splits, ss, block_s, interpret=True)


def test_shared_path_one_launch_in_cpu_interpreter():
    """The ``mgpu_one_launch`` leaf (forced by a plan) against the concatenation oracle; the
    planner does not take it at these shapes (suffix capacity below 128)."""
    b, hq, hkv, d, p, s = 20, 8, 2, 64, 256, 64
    args, kw, meta = make_case(11, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=jnp.bfloat16,
                               suffix_lengths=[0, s] + [5] * (b - 2))
    plan = forced_plan(args[0], args[1], args[3], "mgpu_one_launch")
    assert plan.path == "mgpu_one_launch"
    assert not one_launch_region(plan.shapes, H100_SXM)
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, plan=plan, interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


def _plan(b, hq, hkv, p, s, d=128, device=H100_SXM, **kw):
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                              prefix_len=p, suffix_len=s, dtype=jnp.bfloat16, device=device, **kw)


def test_one_launch_plan_follows_the_measured_rule():
    """The planner's one-launch region (prefix 4K, suffix capacity 128-256, G >= 4; prefix 16K,
    suffix 1024, G >= 8; >= 64 prefix CTAs; an unsplit suffix beside the prefix) and its leaf
    (the prefix unsplit, as many suffix stages as fit); the role-split and one-pass regions
    come first in the tree; a plan forces the leaf wherever the kernel applies."""
    plan = _plan(256, 32, 8, 4096, 128, impl="shared")
    leaf = plan.chunks[0].leaf
    assert plan.path == "mgpu_one_launch" and leaf.num_splits == 1 and leaf.block_s == 64
    assert leaf.suffix_steps == 2                   # 4 x 16 KB tiles per stage at D=128
    assert _plan(256, 32, 8, 4096, 256, impl="shared").path == "mgpu_one_launch"
    assert _plan(1024, 8, 1, 16384, 1024, impl="shared").chunks[0].leaf.num_splits == 1
    assert _plan(1024, 8, 1, 16384, 1024, impl="shared").path == "mgpu_one_launch"
    region = lambda b, hq, hkv, p, s, dev=H100_SXM: one_launch_region(  # noqa: E731
        Shapes(b, 1, hq, hkv, 128, 1, p, s, "bfloat16"), dev)
    assert region(1024, 8, 1, 4096, 256)            # in the region, but the one-pass leaf's too:
    assert _plan(1024, 8, 1, 4096, 256, impl="shared").path == "mgpu_joint"
    for args in [(512, 32, 8, 8192, 128), (256, 32, 8, 4096, 64), (256, 32, 8, 4096, 1024),
                 (1024, 8, 1, 16384, 256), (1024, 32, 8, 16384, 1024), (256, 8, 1, 16384, 1024),
                 (256, 32, 8, 2048, 128), (256, 8, 1, 4096, 256), (1024, 16, 8, 4096, 128)]:
        assert not region(*args), args
        assert _plan(*args, impl="shared").path != "mgpu_one_launch", args
    assert _plan(256, 32, 8, 4096, 1024, path="mgpu_one_launch").path == "mgpu_one_launch"
    assert _plan(256, 16, 8, 4096, 128, path="mgpu_one_launch").path == "mgpu_one_launch"  # G = 2
    assert not region(256, 16, 8, 4096, 128)
    a100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
    with pytest.raises(ValueError, match="compute capability"):
        _plan(256, 32, 8, 4096, 128, path="mgpu_one_launch", device=a100)
    # suffix splits: up to one wave of suffix tasks, then the first count with at most 8 tiles
    # per task (64 CTAs, 4 suffix tiles: 2 x 64 fit 132 SMs, so 4; on 114 SMs 2)
    assert _plan(256, 32, 8, 4096, 256, impl="shared").chunks[0].leaf.suffix_splits == 4
    pcie = _plan(256, 32, 8, 4096, 256, impl="shared", device=H100_PCIE)
    assert pcie.path == "mgpu_one_launch" and pcie.chunks[0].leaf.suffix_splits == 2


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,ss,block_s,steps", [
    (256, 32, 8, 128, 4096, 4000, 128, 4, 1, 64, 2),
    (100, 32, 8, 128, 1024, 1024, 256, 2, 2, 64, 2),
    (300, 8, 1, 128, 2048, 1500, 128, 4, 1, 64, 2),
    (64, 16, 4, 64, 512, 0, 256, 1, 1, 128, 2),   # D = 64: 128-key tiles
])
def test_gpu_kernel(b, hq, hkv, d, p, p_len, s, splits, ss, block_s, steps):
    _run(b, hq, hkv, d, p, p_len, s, splits, ss, block_s, interpret=False, steps=steps)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(256, 32, 8, 128, 4096, 128), (96, 8, 1, 128, 1024, 512)])
def test_gpu_shared_path_one_launch(b, hq, hkv, d, p, s):
    sl = np.random.default_rng(b).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(70 + b, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    plan = forced_plan(args[0], args[1], args[3], "mgpu_one_launch", device=device_info(),
                       interpret=False)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, plan=plan))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)
