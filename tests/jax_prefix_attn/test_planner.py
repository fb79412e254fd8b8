"""The planner: decisions at representative shapes, region boundaries, device facts, forced
paths, and the device reader."""
import jax.numpy as jnp
import pytest

from jax_prefix_attn import DeviceInfo, device_info, plan_shared_prefix
from jax_prefix_attn.device import CPU, H100_PCIE, H100_SXM, H200
from jax_prefix_attn.planner import PATHS, row_splits, suffix_grad_key_splits


def plan(b, p, s, *, hq=32, hkv=8, d=128, tq=1, g=1, dtype=jnp.bfloat16, device=H100_SXM, **kw):
    return plan_shared_prefix(batch=b, tq=tq, heads_q=hq, heads_kv=hkv, head_dim=d, groups=g,
                              prefix_len=p, suffix_len=s, dtype=dtype, device=device, **kw)


@pytest.mark.parametrize("shape,impl,path", [
    ((256, 4096, 128), "auto", "mgpu_one_launch"),
    ((512, 8192, 128), "auto", "mgpu_split"),
    ((1024, 4096, 64), "auto", "mgpu_split"),
    ((256, 4096, 64), "auto", "mgpu_joint"),
    ((256, 16384, 256), "shared", "mgpu_two_launch"),
    ((16, 1024, 64), "auto", "flat_own"),
    ((8, 4000, 1024), "shared", "triton_overlap"),
    ((16, 16384, 256), "flat", "flat_rows"),
])
def test_decisions_at_representative_shapes(shape, impl, path):
    assert plan(*shape, impl=impl).path == path


def test_region_boundaries():
    # the Triton families: overlap below 2048 (sequence, kv head) programs, else two launches
    assert plan(255, 1000, 64, g=2, impl="shared").path == "triton_overlap"
    assert plan(256, 1000, 64, g=2, impl="shared").path == "triton_two_launch"
    # the role split needs B * G >= 2048 (G = 4): B = 512 in, B = 511 out
    assert plan(512, 8192, 128, impl="shared").path == "mgpu_split"
    assert plan(511, 8192, 128, impl="shared").path != "mgpu_split"
    # the one-pass kernel up to a 4K prefix
    assert plan(256, 4096, 64, impl="shared").path == "mgpu_joint"
    assert plan(256, 8192, 64, impl="shared").path != "mgpu_joint"
    # Mosaic GPU only decoding with one prefix, 16-bit, on Hopper
    assert plan(256, 4096, 128, g=2, impl="shared").path.startswith("triton")
    assert plan(256, 4096, 128, tq=2, impl="shared").path.startswith("triton")
    assert plan(256, 4096, 128, dtype=jnp.float32, impl="shared").path.startswith("triton")
    a100 = DeviceInfo("gpu", "A100", 108, 166912, "8.0")
    assert plan(256, 4096, 128, impl="shared", device=a100).path.startswith("triton")


def test_sm_count_changes_splits():
    sxm = plan(64, 4096, 128, impl="shared", path="mgpu_two_launch").chunks[0].leaf
    pcie = plan(64, 4096, 128, impl="shared", path="mgpu_two_launch",
                device=H100_PCIE).chunks[0].leaf
    assert sxm.num_splits != pcie.num_splits
    assert plan(8, 4000, 1024, impl="flat").chunks[0].leaf.num_splits != plan(
        8, 4000, 1024, impl="flat", device=H100_PCIE).chunks[0].leaf.num_splits
    assert plan(256, 4096, 128).path == plan(256, 4096, 128, device=H200).path


def test_forced_paths_and_errors():
    for path in PATHS:
        if path in ("mgpu_split",):
            continue
        assert plan(256, 4096, 128, path=path, interpret=True).path == path
    with pytest.raises(ValueError, match="flat_own"):
        plan(4, 4096, 128, tq=4, path="flat_own")
    with pytest.raises(ValueError, match="mgpu_two_launch"):
        plan(4, 4096, 128, g=2, path="mgpu_two_launch", interpret=True)
    with pytest.raises(ValueError, match="compute capability"):
        plan(256, 4096, 128, path="mgpu_joint", device=CPU)
    with pytest.raises(ValueError, match="path must be one of"):
        plan(256, 4096, 128, path="fastest")
    with pytest.raises(ValueError, match="dtype"):
        plan(256, 4096, 128, dtype=jnp.int8, impl="shared")
    assert plan(256, 4096, 128, dtype=jnp.int8).path == "reference"   # auto falls back
    # any head_dim: the kernels run it zero-padded to a power of two (not on Mosaic GPU)
    assert plan(256, 4096, 128, d=24, impl="shared").path.startswith("triton")
    assert plan(256, 4096, 128, d=96).path != "reference"


def test_auto_off_the_gpu_is_the_reference_and_plans_are_hashable():
    p = plan(256, 4096, 128, device=CPU)
    assert p.impl == "reference" and p.path == "reference"
    assert hash(plan(256, 4096, 128)) == hash(plan(256, 4096, 128))


def test_suffix_splits_rules():
    # beside the Mosaic GPU prefix kernel the suffix is split only below 256 programs
    assert plan(256, 4096, 1024, hq=8, hkv=1, path="mgpu_two_launch").chunks[0].leaf.suffix_splits == 1
    assert plan(128, 4096, 1024, hq=8, hkv=1, path="mgpu_two_launch").chunks[0].leaf.suffix_splits > 1
    assert plan(256, 4096, 1024, hq=8, hkv=1, path="triton_two_launch").chunks[0].leaf.suffix_splits == 2


def test_backward_splits():
    assert row_splits(300, 10, 132) == 1
    assert row_splits(8, 100, 132) == 16 and row_splits(8, 3, 132) == 3
    assert suffix_grad_key_splits(2, 8, 512, H100_SXM) == 8
    assert plan(2, 1024, 512).backward.suffix_key_splits == 8


def test_device_info_reads_the_host():
    dev = device_info()
    assert isinstance(dev, DeviceInfo) and dev is device_info()
    if dev.platform == "cpu":
        assert not dev.mosaic_gpu_ok and dev.sm_count == 0
    assert H100_SXM.mosaic_gpu_ok and H100_PCIE.sm_count == 114
