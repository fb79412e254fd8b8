"""The one-pass shared-prefix decode kernel (``pallas_kernels.joint_decode_mgpu``).

CPU: the shared-memory plan, the errors, the kernel lowered for CUDA, and the kernel in Mosaic
GPU's CPU interpreter against an independent float64 NumPy computation of each row's attention
over ``[prefix[:p_len]; its suffix[:len]]`` (suffix caches poisoned with NaN past each length,
lengths 0 and ``S`` included, padding sequences in the last row block).  GPU (marker ``gpu``):
the same on the device, at the shapes of the benchmark grid too.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import merge_partials
from pallas_kernels.joint_decode_mgpu import joint_decode_mgpu, joint_supported, joint_tiles
from test_shared_decode_mgpu import _case, _numpy_states


def test_block_s_fits_shared_memory_and_errors():
    assert joint_tiles(128) == (128, 64) and joint_tiles(64) == (128, 128)
    bf = jnp.bfloat16
    assert joint_supported(batch=256, heads_q=32, heads_kv=8, prefix_len=4096, suffix_cap=64,
                           head_dim=128, dtype=bf) is None
    assert "multiple of block_s" in joint_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                                    suffix_cap=96, head_dim=128, dtype=bf)
    assert "power of two" in joint_supported(batch=8, heads_q=12, heads_kv=4, prefix_len=256,
                                             suffix_cap=64, head_dim=64, dtype=bf)
    q = jnp.zeros((2, 128, 64), bf)
    k = jnp.zeros((256, 2, 64), bf)
    sk = jnp.zeros((20, 128, 2, 64), bf)
    with pytest.raises(ValueError, match="num_splits=3"):
        joint_decode_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0, group=4,
                          num_splits=3)
    with pytest.raises(ValueError, match="multiple of 128"):
        joint_decode_mgpu(q[:, :100], k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0,
                          group=4)


def _want(q, pk, pv, p_len, sk, sv, sl, g, scale):
    """float64 attention of each real row over the prefix and its own suffix (merged states)."""
    st = _numpy_states(q, pk, pv, p_len, sk, sv, sl, g, scale)
    (o1, l1), (o2, l2) = st["pre"], st["suf"]
    lse = np.logaddexp(l1, l2)
    w1 = np.where(np.isfinite(l1), np.exp(l1 - np.where(np.isfinite(lse), lse, 0)), 0)
    w2 = np.where(np.isfinite(l2), np.exp(l2 - np.where(np.isfinite(lse), lse, 0)), 0)
    return o1 * w1[..., None] + o2 * w2[..., None], lse


def _run(b, hq, hkv, d, p, p_len, s, splits, block_s, interpret, seed=0, barrier=True):
    q, pk, pv, sk, sv, sl = _case(seed + b * 31 + p + s, b, hq, hkv, d, p, s)
    g = hq // hkv
    o, lse = joint_decode_mgpu(q, pk, pv, p_len, sk, sv, jnp.asarray(sl, jnp.int32),
                               scale=d ** -0.5, group=g, num_splits=splits, block_s=block_s,
                               schedule_barrier=barrier, interpret=interpret,
                               _cpu_check=interpret)
    assert o.shape[0] == (splits or o.shape[0]) and lse.shape == o.shape[:3]
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
    """Lowered for CUDA (shared memory checked against Hopper's 227 KB per CTA)."""
    from test_prefix_attention_mgpu import _lower_for_cuda
    S = jax.ShapeDtypeStruct
    b, hq, hkv, p, s = 64, 32, 8, 1024, 128
    txt = _lower_for_cuda(
        lambda q, pk, pv, n, sk, sv, sl: joint_decode_mgpu(
            q, pk, pv, n, sk, sv, sl, scale=d ** -0.5, group=4, num_splits=2, block_s=block_s),
        S((hkv, b * 4, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
        S((), jnp.int32), S((b, s, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,block_s,barrier", [
    (40, 8, 2, 64, 256, 200, 128, 1, 64, True),   # G = 4: 16 sequences per warpgroup, 2 tiles
    (40, 8, 2, 64, 384, 384, 64, 3, 64, True),    # 3 splits: 6/6/4 sequences of 16 per split
    (20, 8, 1, 64, 256, 130, 128, 2, 64, True),   # G = 8, more suffix steps than prefix tiles
    (40, 8, 2, 64, 384, 300, 64, 3, 64, False),   # no ping-pong turns (the auto plan's setting)
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
    _run(b, hq, hkv, d, p, p_len, s, splits, None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits", [
    (256, 32, 8, 128, 4096, 4000, 64, 2),   # the auto plan's settings at D=128: 128-key tiles
    (1000, 8, 1, 128, 4096, 4096, 256, 2),  # G = 8, 8 suffix steps per split and warpgroup
    (300, 32, 8, 128, 1024, 1024, 256, 1),  # more suffix steps than prefix tiles
])
def test_kernel_on_gpu_without_turns(b, hq, hkv, d, p, p_len, s, splits):
    _run(b, hq, hkv, d, p, p_len, s, splits, None, interpret=False, barrier=False)


def test_joint_plan_follows_the_measured_rule(monkeypatch):
    """``MGPU_MERGE="auto"`` takes the one-pass kernel only where session 14 measured it faster
    (prefix 1K-4K; suffix capacity 64 from 16 CTAs, up to 256 at G >= 8 from 64), with splits that
    keep one wave and no ping-pong turns; ``force`` takes it wherever the kernel applies."""
    import pallas_kernels.prefix_attention as pa
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    bf = jnp.bfloat16
    assert pa.joint_plan(256, 32, 8, 4096, 64, 128, bf) == dict(
        num_splits=2, schedule_barrier=False, steps=2)
    assert pa.joint_plan(1024, 32, 8, 4096, 64, 128, bf)["num_splits"] == 1    # 256 CTAs
    assert pa.joint_plan(1024, 8, 1, 4096, 64, 128, bf)["num_splits"] == 2
    assert pa.joint_plan(1024, 8, 1, 4096, 256, 128, bf)["num_splits"] == 2
    assert pa.joint_plan(1024, 32, 8, 1024, 64, 128, bf)["num_splits"] == 1    # prefix 1K
    assert pa.joint_plan(256, 32, 8, 2048, 64, 128, bf)["num_splits"] == 2
    for b, hq, hkv, p, s in [(256, 32, 8, 4096, 128), (1024, 32, 8, 16384, 64),
                             (64, 8, 1, 4096, 64), (256, 8, 1, 16384, 64),
                             (256, 8, 1, 4096, 256), (256, 8, 1, 1024, 128),
                             (1024, 8, 1, 4096, 1024), (512, 32, 8, 8192, 64),
                             (1024, 32, 8, 512, 64), (512, 32, 8, 2048, 128),
                             (1024, 16, 8, 4096, 64)]:
        assert pa.joint_plan(b, hq, hkv, p, s, 128, bf) is None, (b, hq, hkv, p, s)
    assert pa.joint_plan(256, 8, 1, 4096, 64, 128, bf)["num_splits"] == 8      # 16 CTAs
    assert pa.joint_plan(64, 32, 8, 1024, 64, 128, bf)["num_splits"] == 8
    assert pa.joint_plan(64, 8, 1, 4096, 64, 128, bf, force=True)["num_splits"] == 16
    assert pa.joint_plan(1024, 16, 8, 4096, 64, 128, bf, force=True) is not None  # G = 2
    assert pa.joint_splits(32, 64) == 2 and pa.joint_splits(32, 256) == 1
    assert pa.joint_splits(32, 16) == 8 and pa.joint_splits(6, 16) == 2
    monkeypatch.setattr(pa, "JOINT_SPLITS", 4)
    assert pa.joint_plan(256, 32, 8, 4096, 64, 128, bf)["num_splits"] == 4
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "triton")
    assert pa.joint_plan(256, 32, 8, 4096, 64, 128, bf, force=True) is None


def _shared_path(monkeypatch, b, hq, hkv, d, p, s, impl, seed, splits=None, merge="joint",
                 barrier=None):
    import pallas_kernels.prefix_attention as pa
    from jax_prefix_attn import shared_prefix_attention
    from test_shared_prefix import check, make_case, oracle
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    monkeypatch.setattr(pa, "MGPU_MERGE", merge)
    monkeypatch.setattr(pa, "JOINT_SPLITS", splits)  # 1: the kernel's output is the attention
    if barrier is not None:
        monkeypatch.setattr(pa, "JOINT_SCHEDULE_BARRIER", barrier)
    assert pa.joint_plan(b, hq, hkv, p, s, d, jnp.bfloat16, interpret=impl != "shared",
                         force=merge == "joint") is not None
    sl = np.random.default_rng(seed).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(seed, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl=impl))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.parametrize("splits,barrier", [(None, True), (1, False)])
def test_shared_path_joint_in_cpu_interpreter(monkeypatch, splits, barrier):
    """``MGPU_MERGE = "joint"``: the whole shared path against the concatenation oracle (with
    one split, no merge: the kernel's output, relaid out, is the result)."""
    _shared_path(monkeypatch, 36, 8, 2, 64, 256, 128, "pallas_interpret", 12, splits,
                 barrier=barrier)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s,splits", [
    (256, 32, 8, 128, 4096, 128, None), (256, 32, 8, 128, 1024, 64, 1),
    (96, 8, 1, 128, 1024, 512, None)])
def test_gpu_shared_path_joint(monkeypatch, b, hq, hkv, d, p, s, splits):
    # (the oracle draws and fills every sequence's concatenated K/V in float32 on the host:
    # at B=1024 P=4K, 2 x 4.4e9 values, and that case did not finish in 150 s; so the
    # one-split case runs at B=256 P=1K)
    _shared_path(monkeypatch, b, hq, hkv, d, p, s, "shared", 80 + b, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,p,s", [(256, 32, 8, 4096, 64), (1024, 8, 1, 1024, 256)])
def test_gpu_shared_path_auto_takes_joint(monkeypatch, b, hq, hkv, p, s):
    """The default (``MGPU_MERGE = "auto"``) at points of ``JOINT_REGIONS``: the one-pass
    kernel, 2 splits, no ping-pong turns, against the concatenation oracle."""
    _shared_path(monkeypatch, b, hq, hkv, 128, p, s, "shared", 7, merge="auto")
