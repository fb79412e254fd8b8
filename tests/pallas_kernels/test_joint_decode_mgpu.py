"""The one-pass shared-prefix decode kernel (``pallas_kernels.joint_decode_mgpu``) and the
planner's ``mgpu_joint`` leaf.

CPU: the shared-memory plan, the errors, the kernel lowered for CUDA, and the kernel in Mosaic
GPU's CPU interpreter against an independent float64 NumPy computation of each row's attention
over ``[prefix[:p_len]; its suffix[:len]]`` (suffix caches poisoned with NaN past each length,
lengths 0 and ``S`` included, padding sequences in the last row block); where the planner takes
the leaf and its splits; the leaf (forced by a plan) against the concatenation oracle.  GPU
(marker ``gpu``): the same on the device, at the shapes of the benchmark grid too.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import decode_row_states, decode_rows_case, forced_plan, lower_for_cuda
from jax_prefix_attn import DeviceInfo, device_info, plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H100_PCIE, H100_SXM
from jax_prefix_attn.leaf_plans import choose_splits, joint_region
from jax_prefix_attn.plans import Shapes
from pallas_kernels._common import merge_partials
from pallas_kernels.joint_decode_mgpu import joint_decode_mgpu, joint_supported, joint_tiles
from helpers import check, make_case, oracle

HOPPER_SMEM = H100_SXM.smem_per_block     # 232,448 bytes per CTA


def test_block_s_fits_shared_memory_and_errors():
    assert joint_tiles(128, HOPPER_SMEM) == (128, 64) and joint_tiles(64, HOPPER_SMEM) == (128, 128)
    # less shared memory per CTA (an A100's 166,912 bytes, 101,376 on Ada): smaller tiles
    assert joint_tiles(128, 166912) == (64, 64) and joint_tiles(64, 166912) == (128, 128)
    assert joint_tiles(64, 101376) == (64, 64)
    bf = jnp.bfloat16
    assert joint_supported(batch=256, heads_q=32, heads_kv=8, prefix_len=4096, suffix_cap=64,
                           head_dim=128, dtype=bf, block_s=64) is None
    assert "multiple of block_s" in joint_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                                    suffix_cap=96, head_dim=128, dtype=bf,
                                                    block_s=64)
    assert "power of two" in joint_supported(batch=8, heads_q=12, heads_kv=4, prefix_len=256,
                                             suffix_cap=64, head_dim=64, dtype=bf, block_s=128)
    q = jnp.zeros((2, 128, 64), bf)
    k = jnp.zeros((256, 2, 64), bf)
    sk = jnp.zeros((20, 128, 2, 64), bf)
    tiles = dict(block_kv=128, block_s=128)
    with pytest.raises(ValueError, match="num_splits=3"):
        joint_decode_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0, group=4,
                          num_splits=3, **tiles)
    with pytest.raises(ValueError, match="multiple of 128"):
        joint_decode_mgpu(q[:, :100], k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0,
                          group=4, **tiles)


def _want(q, pk, pv, p_len, sk, sv, sl, g, scale):
    """float64 attention of each real row over the prefix and its own suffix (merged states)."""
    st = decode_row_states(q, pk, pv, p_len, sk, sv, sl, g, scale)
    (o1, l1), (o2, l2) = st["pre"], st["suf"]
    lse = np.logaddexp(l1, l2)
    w1 = np.where(np.isfinite(l1), np.exp(l1 - np.where(np.isfinite(lse), lse, 0)), 0)
    w2 = np.where(np.isfinite(l2), np.exp(l2 - np.where(np.isfinite(lse), lse, 0)), 0)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def _run(b, hq, hkv, d, p, p_len, s, splits, block_s, interpret, seed=0, barrier=True):
    """``block_s=None``: the largest tiles that fit Hopper's shared memory (``joint_tiles``)."""
    q, pk, pv, sk, sv, sl = decode_rows_case(seed + b * 31 + p + s, b, hq, hkv, d, p, s)
    g = hq // hkv
    block_kv, fit_s = joint_tiles(d, HOPPER_SMEM)
    o, lse = joint_decode_mgpu(q, pk, pv, p_len, sk, sv, jnp.asarray(sl, jnp.int32),
                               scale=d ** -0.5, group=g, num_splits=splits, block_kv=block_kv,
                               block_s=fit_s if block_s is None else block_s,
                               schedule_barrier=barrier, interpret=interpret,
                               _cpu_check=interpret)
    assert o.shape[0] == splits and lse.shape == o.shape[:3]
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    o, lse = np.asarray(o)[:, :b * g], np.asarray(lse)[:, :b * g]
    wo, wl = _want(q, pk, pv, p_len, sk, sv, sl, g, d ** -0.5)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    fin = np.isfinite(wl)
    assert (np.isfinite(lse) == fin).all()
    assert (o[~fin] == 0).all()
    rel = np.linalg.norm(o - wo) / np.linalg.norm(wo)
    assert rel < 2e-2, rel
    np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize("d,block_s", [(128, None), (64, None), (64, 64)])
def test_kernel_lowers_for_cuda(d, block_s):
    """Lowered for CUDA (shared memory checked against Hopper's 227 KB per CTA); ``block_s=None``:
    the tiles of ``joint_tiles``."""
    S = jax.ShapeDtypeStruct
    b, hq, hkv, p, s = 64, 32, 8, 1024, 128
    block_kv, fit_s = joint_tiles(d, HOPPER_SMEM)
    txt = lower_for_cuda(
        lambda q, pk, pv, n, sk, sv, sl: joint_decode_mgpu(
            q, pk, pv, n, sk, sv, sl, scale=d ** -0.5, group=4, num_splits=2, block_kv=block_kv,
            block_s=fit_s if block_s is None else block_s),
        S((hkv, b * 4, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
        S((), jnp.int32), S((b, s, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,block_s,barrier", [
    # G = 4: 16 sequences per warpgroup (the second holds 4 and padding rows), 2 kv heads,
    # 2 prefix tiles (ragged), 2 suffix tiles per sequence
    (20, 8, 2, 64, 256, 200, 128, 1, 64, True),
    (24, 4, 1, 64, 384, 384, 64, 3, 64, True),    # 3 splits: 6/6/4 of each warpgroup's 16 sequences
    (12, 8, 1, 64, 256, 130, 128, 2, 64, True),   # G = 8, more suffix steps than prefix tiles
    (24, 4, 1, 64, 384, 300, 64, 3, 64, False),   # no ping-pong turns (the planner's setting)
])
def test_kernel_in_cpu_interpreter(b, hq, hkv, d, p, p_len, s, splits, block_s, barrier):
    _run(b, hq, hkv, d, p, p_len, s, splits, block_s, interpret=True, barrier=barrier)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits", [
    (40, 8, 2, 64, 256, 200, 128, 1),       # D = 64: 128-key tiles
    (40, 8, 2, 128, 384, 384, 64, 3),
    (20, 8, 1, 128, 256, 128, 192, 2),
    (256, 32, 8, 128, 4096, 4000, 64, None),
    (300, 32, 8, 128, 1024, 1024, 256, 1),
    (130, 8, 1, 64, 2048, 1900, 128, None),
])
def test_kernel_on_gpu(b, hq, hkv, d, p, p_len, s, splits):
    """(``splits=None``: the Mosaic GPU prefix kernel's splits for these CTAs on this GPU)"""
    if splits is None:
        splits = choose_splits(p // 128, hkv * -(-b * (hq // hkv) // 128), device_info().sm_count)
    _run(b, hq, hkv, d, p, p_len, s, splits, None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits", [
    (256, 32, 8, 128, 4096, 4000, 64, 2),   # the planner's settings at D=128: 128-key tiles
    (1000, 8, 1, 128, 4096, 4096, 256, 2),  # G = 8, 8 suffix steps per split and warpgroup
    (300, 32, 8, 128, 1024, 1024, 256, 1),  # more suffix steps than prefix tiles
])
def test_kernel_on_gpu_without_turns(b, hq, hkv, d, p, p_len, s, splits):
    _run(b, hq, hkv, d, p, p_len, s, splits, None, interpret=False, barrier=False)


def _plan(b, hq, hkv, p, s, d=128, device=H100_SXM, **kw):
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                              prefix_len=p, suffix_len=s, dtype=jnp.bfloat16, device=device, **kw)


def test_joint_plan_follows_the_measured_rule():
    """The planner's one-pass region (prefix 1K-4K; suffix capacity 64 from 16 CTAs, up to 256
    at G >= 8 from 64; the role-split region comes first in the tree) and its leaf: prefix splits
    keeping one wave (the largest power of two up to 16 dividing the tiles), no ping-pong turns,
    2 stages; a plan forces the leaf wherever the kernel applies."""
    leaf = _plan(256, 32, 8, 4096, 64, impl="shared").chunks[0].leaf
    assert _plan(256, 32, 8, 4096, 64, impl="shared").path == "mgpu_joint"
    assert (leaf.num_splits, leaf.schedule_barrier, leaf.steps) == (2, False, 2)
    assert (leaf.block_kv, leaf.block_s) == joint_tiles(128, HOPPER_SMEM)
    splits = lambda *a, **kw: _plan(*a, path="mgpu_joint", **kw).chunks[0].leaf.num_splits  # noqa: E731
    region = lambda b, hq, hkv, p, s: joint_region(  # noqa: E731
        Shapes(b, 1, hq, hkv, 128, 1, p, s, "bfloat16"), H100_SXM)
    for b, hq, hkv, p, s, n in [(1024, 8, 1, 4096, 64, 2), (1024, 8, 1, 4096, 256, 2),
                                (1024, 32, 8, 1024, 64, 1), (256, 32, 8, 2048, 64, 2),
                                (256, 8, 1, 4096, 64, 8), (64, 32, 8, 1024, 64, 8)]:
        assert region(b, hq, hkv, p, s), (b, hq, hkv, p, s)
        plan = _plan(b, hq, hkv, p, s, impl="shared")
        assert plan.path == "mgpu_joint" and plan.chunks[0].leaf.num_splits == n, (b, hq, p, s)
    assert region(1024, 32, 8, 4096, 64) and splits(1024, 32, 8, 4096, 64) == 1   # 256 CTAs
    assert _plan(1024, 32, 8, 4096, 64, impl="shared").path == "mgpu_split"       # first
    for b, hq, hkv, p, s in [(256, 32, 8, 4096, 128), (1024, 32, 8, 16384, 64),
                             (64, 8, 1, 4096, 64), (256, 8, 1, 16384, 64),
                             (256, 8, 1, 4096, 256), (256, 8, 1, 1024, 128),
                             (1024, 8, 1, 4096, 1024), (512, 32, 8, 8192, 64),
                             (1024, 32, 8, 512, 64), (512, 32, 8, 2048, 128),
                             (1024, 16, 8, 4096, 64)]:
        assert not region(b, hq, hkv, p, s), (b, hq, hkv, p, s)
        assert _plan(b, hq, hkv, p, s, impl="shared").path != "mgpu_joint", (b, hq, hkv, p, s)
    assert splits(64, 8, 1, 4096, 64) == 16                       # forced: 4 CTAs
    assert _plan(1024, 16, 8, 4096, 64, path="mgpu_joint").path == "mgpu_joint"   # G = 2
    assert splits(256, 8, 1, 768, 64) == 2                        # 6 tiles, 16 CTAs
    # an H100 PCIe (114 SMs): 64 CTAs x 2 splits would pass one wave
    assert splits(256, 32, 8, 4096, 64, device=H100_PCIE) == 1
    assert splits(256, 8, 1, 4096, 64, device=H100_PCIE) == 4    # 16 CTAs x 8 > 114
    a100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
    with pytest.raises(ValueError, match="compute capability"):
        _plan(256, 32, 8, 4096, 64, path="mgpu_joint", device=a100)


def _shared_path(b, hq, hkv, d, p, s, seed, interpret, **leaf):
    """The whole shared path through the ``mgpu_joint`` leaf (``leaf``: fields replaced, e.g.
    ``num_splits=1``: the kernel's output is the attention, no merge) against the oracle."""
    sl = np.random.default_rng(seed).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(seed, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    dev = H100_SXM if interpret else device_info()
    plan = forced_plan(args[0], args[1], args[3], "mgpu_joint", device=dev, interpret=interpret,
                       **leaf)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, plan=plan,
                                                          interpret=interpret))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.parametrize("splits,barrier", [(None, True), (1, False)])
def test_shared_path_joint_in_cpu_interpreter(splits, barrier):
    """The ``mgpu_joint`` leaf against the concatenation oracle (``splits=None``: the plan's,
    here 2; with one split, no merge: the kernel's output, relaid out, is the result)."""
    leaf = dict(schedule_barrier=barrier) | ({} if splits is None else dict(num_splits=splits))
    _shared_path(20, 8, 2, 64, 256, 128, 12, interpret=True, **leaf)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s,splits", [
    (256, 32, 8, 128, 4096, 128, None), (256, 32, 8, 128, 1024, 64, 1),
    (96, 8, 1, 128, 1024, 512, None)])
def test_gpu_shared_path_joint(b, hq, hkv, d, p, s, splits):
    # (the oracle draws and fills every sequence's concatenated K/V in float32 on the host:
    # at B=1024 P=4K, 2 x 4.4e9 values, too slow; so the one-split case runs at B=256 P=1K)
    _shared_path(b, hq, hkv, d, p, s, 80 + b, interpret=False,
                 **({} if splits is None else dict(num_splits=splits)))


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,p,s", [(256, 32, 8, 4096, 64), (1024, 8, 1, 1024, 256)])
def test_gpu_shared_path_auto_takes_joint(b, hq, hkv, p, s):
    """The default plan at points of the one-pass region on this GPU: the one-pass kernel, no
    ping-pong turns (2 splits on 132 SMs); the default call against the concatenation oracle."""
    dev = device_info()
    plan = _plan(b, hq, hkv, p, s, impl="shared", device=dev)
    leaf = plan.chunks[0].leaf
    assert plan.path == "mgpu_joint" and not leaf.schedule_barrier
    assert leaf.num_splits == 2 or dev.sm_count != H100_SXM.sm_count
    sl = np.random.default_rng(7).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(7, b=b, tq=1, hq=hq, hkv=hkv, d=128, g=0, p=p, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True,
                                                          impl="shared"))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)
