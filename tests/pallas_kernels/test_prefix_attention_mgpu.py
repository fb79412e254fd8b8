"""Mosaic GPU prefix kernel (``pallas_kernels.prefix_attention_mgpu``) and the planner's Mosaic
GPU region and prefix splits.

CPU: (1) the kernel and the shared path using it are traced and lowered for CUDA (API,
layout-inference and shared-memory-budget errors; no PTX is compiled); (2) the kernel runs in
Mosaic GPU's CPU interpreter (simulated warpgroups, barriers, TMA copies, wgmma) against the
reference, with the forms that interpreter lacks replaced (``_cpu_check=True``: K pre-transposed
in memory instead of a transposed shared-memory view for ``Q K^T``; ``P`` staged through shared
memory instead of registers and ``P V`` into a fresh accumulator instead of in place): the
pipeline, split offsets, masking, online softmax, LSE and output layout are the GPU code's;
(3) the ``mgpu_two_launch`` leaf (forced by a plan) against the concatenation oracle.
GPU (marker ``gpu``): parity of the real kernel and the leaf with the pure-JAX reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import forced_plan, lower_for_cuda
from jax_prefix_attn import DeviceInfo, device_info, plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H100_PCIE, H100_SXM, H200
from jax_prefix_attn.leaf_plans import choose_splits, even_enough, mosaic_region, suffix_splits
from jax_prefix_attn.plans import Shapes
from pallas_kernels._common import merge_partials
from pallas_kernels.prefix_attention_mgpu import mgpu_supported, prefix_partials_mgpu
from helpers import check, make_case, oracle

S = jax.ShapeDtypeStruct
A100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")


def _shapes(b, hq, hkv, p, s=128, d=128, tq=1, groups=1, dtype="bfloat16"):
    return Shapes(b, tq, hq, hkv, d, groups, p, s, dtype)


def _plan(b, hq, hkv, p, s, d=128, dtype=jnp.bfloat16, device=H100_SXM, **kw):
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                              prefix_len=p, suffix_len=s, dtype=dtype, device=device, **kw)


def test_supported_shapes_and_splits():
    assert mgpu_supported(rows=1152, prefix_len=4096, head_dim=128, dtype=jnp.bfloat16) is None
    assert "head_dim" in mgpu_supported(rows=1152, prefix_len=4096, head_dim=96, dtype=jnp.bfloat16)
    assert "dtype" in mgpu_supported(rows=1152, prefix_len=4096, head_dim=128, dtype=jnp.float32)
    assert "multiple" in mgpu_supported(rows=1152, prefix_len=4000, head_dim=128, dtype=jnp.bfloat16)
    assert "rows" in mgpu_supported(rows=100, prefix_len=4096, head_dim=128, dtype=jnp.bfloat16)
    sms = H100_SXM.sm_count                          # 132
    assert choose_splits(32, 8 * 8, sms) == 4        # 64 CTAs -> 4 splits of 8 tiles (256 CTAs)
    assert choose_splits(32, 8 * 9, sms) == 2        # 72 CTAs: 4 splits would pass two waves
    assert choose_splits(64, 8 * 16, sms) == 1       # 128 CTAs: one wave already
    assert choose_splits(32, 8 * 32, sms) == 1
    assert choose_splits(128, 8 * 8, sms) == 2       # 16K prefix: at most 2 splits
    assert choose_splits(127, 8 * 8, sms) == 2       # 16256 keys, 127 tiles (a prime): 64 + 63
    assert choose_splits(64, 8 * 8, sms) == 4        # 8K prefix: still 4
    assert choose_splits(128, 16, sms) == 8          # fewer than FEW_CTAS: unchanged
    assert choose_splits(30, 48, sms) == 3           # largest divisor of the tile count up to 4
    assert choose_splits(7, 48, sms) == 1            # 7 tiles: no split count wastes <= 1/16
    assert even_enough(127, 2) and even_enough(128, 4) and not even_enough(9, 4)  # (4th split empty)
    assert choose_splits(2, 48, sms) == 2
    # fewer than FEW_CTAS CTAs: up to 16 splits within one wave, >= 2 tiles per split
    assert choose_splits(32, 16, sms) == 8           # 16 CTAs -> 128
    assert choose_splits(128, 4, sms) == 16          # 4 CTAs -> 64
    assert choose_splits(8, 16, sms) == 4            # 2 tiles per split
    assert choose_splits(2, 8, sms) == 1             # one tile per split would starve the pipeline
    assert choose_splits(30, 1, sms) == 15
    # an H100 PCIe (114 SMs): 64 CTAs x 4 splits would pass two waves there, 2 fit
    assert choose_splits(32, 8 * 8, H100_PCIE.sm_count) == 2
    assert choose_splits(32, 16, H100_PCIE.sm_count) == 4     # 16 x 8 > 114
    for n_tiles, ctas in [(32, 64), (32, 16), (128, 4), (30, 1), (7, 48), (127, 64), (61, 16)]:
        c = choose_splits(n_tiles, ctas, H100_PCIE.sm_count)
        assert even_enough(n_tiles, c) and (c == 1 or ctas * c <= 2 * H100_PCIE.sm_count)
    with pytest.raises(ValueError, match="head_dim"):
        prefix_partials_mgpu(jnp.zeros((1, 128, 96), jnp.bfloat16), jnp.zeros((128, 1, 96), jnp.bfloat16),
                             jnp.zeros((128, 1, 96), jnp.bfloat16), 128, scale=0.1)
    with pytest.raises(ValueError, match="out_rows=100"):
        prefix_partials_mgpu(jnp.ones((1, 128, 64), jnp.bfloat16), jnp.ones((128, 1, 64), jnp.bfloat16),
                             jnp.ones((128, 1, 64), jnp.bfloat16), 128, scale=0.1, out_rows=100)
    with pytest.raises(ValueError, match="num_splits=3"):
        prefix_partials_mgpu(jnp.ones((1, 128, 64), jnp.bfloat16), jnp.ones((256, 1, 64), jnp.bfloat16),
                             jnp.ones((256, 1, 64), jnp.bfloat16), 256, scale=0.1, num_splits=3)


def test_uneven_prefix_splits_in_the_plan_not_in_the_region():
    """A prefix of a prime number of key tiles: the two-launch leaf splits it unevenly, but the
    Mosaic GPU region counts divisor splits only, so the leaf chosen is the same as without
    uneven splits."""
    big = _plan(256, 32, 8, 16256, 128, device=H200)      # 64 CTAs: in the region unsplit
    assert big.chunks[0].leaf.path == "mgpu_two_launch" and big.chunks[0].leaf.num_splits == 2
    small = _shapes(32, 32, 8, 3968)                      # 8 CTAs x 31 tiles
    assert choose_splits(31, 8, H200.sm_count) == 8 and choose_splits(31, 8, H200.sm_count, uneven=False) == 1
    assert not mosaic_region(small, H200, interpret=False)
    assert mosaic_region(_shapes(32, 32, 8, 4096), H200, interpret=False)   # 32 tiles: 16 splits


def test_decode_plan_and_cost_model_with_mgpu():
    """The planner's Mosaic GPU decode plan on a Hopper part (the prefix kernel's splits where
    the Mosaic GPU region holds, else ``None``: the Triton kernels), suffix splits, and the cost
    model's choice of family there."""
    def mgpu_splits(b, hq, hkv, p, d=128, dtype="bfloat16", device=H100_SXM):
        if not mosaic_region(_shapes(b, hq, hkv, p, d=d, dtype=dtype), device, interpret=False):
            return None
        plan = _plan(b, hq, hkv, p, 128, d=d, path="mgpu_two_launch", device=device)
        return plan.chunks[0].leaf.num_splits
    assert mgpu_splits(256, 8, 1, 4096) == 8        # 16 CTAs -> 8 splits
    assert mgpu_splits(64, 8, 1, 16384) == 16       # 4 CTAs -> 16 splits
    assert mgpu_splits(256, 32, 8, 4096) == 4       # 64 CTAs -> 4 splits
    assert mgpu_splits(1024, 32, 8, 4096) == 1      # 256 CTAs
    assert mgpu_splits(64, 8, 1, 1024) is None      # 4 CTAs x 4 splits: too few
    assert mgpu_splits(16, 32, 8, 4096) is None     # half the 128-row block is padding
    assert mgpu_splits(256, 32, 8, 4096, dtype="float32") is None
    assert mgpu_splits(256, 32, 8, 4000) is None    # prefix not a multiple of 128
    assert mgpu_splits(256, 32, 8, 4096, device=H100_PCIE) == 2   # 64 x 4 > 2 x 114
    sxm = lambda b, hkv, s: suffix_splits(_shapes(b, 8 * hkv, hkv, 4096, s), H100_SXM)  # noqa: E731
    assert sxm(256, 8, 128) == 1 and sxm(64, 1, 1024) == 5    # 264 programs: two per SM
    assert suffix_splits(_shapes(64, 8, 1, 4096, 1024), H100_PCIE) == 4   # 228 programs
    # on an H200 the shared family took 0.048 ms, the flat 0.327 ms (B=256, P=16K, S=64)
    assert _plan(256, 8, 1, 16384, 64).impl == "shared"
    assert mgpu_splits(256, 8, 1, 4096, device=A100) is None          # not Hopper
    assert _plan(256, 8, 1, 4096, 128, impl="shared", device=A100).path.startswith("triton")


def test_mosaic_gpu_region():
    """Where the planner takes a Mosaic GPU leaf: decoding with one prefix on a Hopper GPU, not
    in interpret mode, with enough CTAs after splitting and enough real rows; a plan may force
    the leaf wherever the kernel runs (in interpret mode too, at any CTA count)."""
    s = _shapes(256, 32, 8, 4096)
    assert mosaic_region(s, H100_SXM, interpret=False)
    assert not mosaic_region(s, H100_SXM, interpret=True)    # interpret mode: only when forced
    assert not mosaic_region(_shapes(256, 32, 8, 4096, groups=2), H100_SXM, False)
    assert not mosaic_region(_shapes(256, 32, 8, 4096, tq=4), H100_SXM, False)
    assert not mosaic_region(s, A100, False)                 # not Hopper
    assert mosaic_region(_shapes(256, 8, 1, 4096), H100_SXM, False)      # 16 CTAs x 8 splits
    assert not mosaic_region(_shapes(64, 8, 1, 1024), H100_SXM, False)   # 4 CTAs x 4: too few
    assert not mosaic_region(_shapes(16, 32, 8, 4096), H100_SXM, False)  # 64 of 128 rows real
    assert mosaic_region(_shapes(96, 32, 8, 4096), H100_SXM, False)      # 384 of 384
    plan = _plan(1, 8, 1, 256, 128, d=64, path="mgpu_two_launch", interpret=True)
    assert plan.path == "mgpu_two_launch"                    # forced: no CTA threshold
    with pytest.raises(ValueError, match="path must be one of"):
        _plan(256, 32, 8, 4096, 128, path="cuda")
    with pytest.raises(ValueError, match="compute capability"):
        _plan(256, 32, 8, 4096, 128, path="mgpu_two_launch", device=A100)
    if jax.default_backend() == "cpu":
        assert not device_info().mosaic_gpu_ok


@pytest.mark.parametrize("hkv,m,d,p", [(8, 1152, 128, 4096), (1, 128, 64, 256)])
def test_kernel_lowers_for_cuda(hkv, m, d, p):
    splits = choose_splits(p // 128, hkv * m // 128, H100_SXM.sm_count)
    txt = lower_for_cuda(lambda q, k, v, n: prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5,
                                                                 num_splits=splits),
                         S((hkv, m, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
                         S((p, hkv, d), jnp.bfloat16), S((1,), jnp.int32))
    assert "mosaic_gpu" in txt


def test_shared_path_with_mgpu_backend_lowers_for_cuda():
    b, p, s, hq, hkv, d = 64, 1024, 128, 32, 8, 128
    plan = _plan(b, hq, hkv, p, s, d=d, path="mgpu_two_launch")

    def f(q, pk, pv, sk, sv, sl):
        return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, plan=plan)
    txt = lower_for_cuda(f, S((b, 1, hq, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
                         S((p, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
                         S((b, s, hkv, d), jnp.bfloat16), S((b,), jnp.int32))
    assert "mosaic_gpu" in txt and "triton" in txt   # Mosaic prefix kernel + Triton suffix kernel


@pytest.mark.parametrize("hkv,m,d,p,n,splits,sched,out_rows,stages", [
    (1, 128, 64, 256, 200, 2, True, None, 2), (2, 256, 128, 512, 300, 2, True, 268, 2),
    (1, 128, 64, 256, 0, 1, True, None, 2), (1, 128, 64, 384, 384, 1, False, None, 2),
    (2, 128, 128, 768, 700, 1, True, None, 3),   # 3 stages: the LSE stored from registers
    (1, 256, 64, 768, 0, 2, True, 260, 3),
    (1, 128, 64, 384, 384, 2, True, None, 2),     # 3 tiles in 2 splits: one masked re-read
    (1, 128, 64, 1280, 5000, 4, True, None, 2)])  # 10 tiles in 4 splits; length past P clamps
def test_kernel_in_cpu_interpreter_matches_reference(hkv, m, d, p, n, splits, sched, out_rows, stages):
    rng = np.random.default_rng(m + p + n)
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((p, hkv, d), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((p, hkv, d), np.float32), jnp.bfloat16)
    o, lse = prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=splits, interpret=True,
                                  schedule_barrier=sched, out_rows=out_rows, _cpu_check=True,
                                  max_concurrent_steps=stages)
    rows = m if out_rows is None else -(-out_rows // 16) * 16   # 268 -> 272 allocated rows
    assert o.shape == (splits, hkv, rows, d) and lse.shape == (splits, hkv, rows)
    o, lse = o[:, :, :m], lse[:, :, :m]
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    if n == 0:
        assert bool(jnp.all(jnp.isneginf(lse))) and bool(jnp.all(o == 0))
        return
    ro, rl = _reference_partials(q, k, v, n, d ** -0.5)
    assert float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro)) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=1e-4, rtol=1e-5)


def _rand_operands(hkv, m, d, p, seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
                 for shape in ((hkv, m, d), (p, hkv, d), (p, hkv, d)))


def test_persistent_ctas_in_cpu_interpreter():
    """``persistent_ctas``: CTAs looping over the tasks through one set of pipeline buffers and
    barriers (6 tasks over 4 CTAs: two CTAs run two, with 3 pipeline stages) match the reference
    (the GPU test also checks them bit for bit against the grid form)."""
    hkv, m, d, p, n = 2, 128, 64, 1152, 1100
    q, k, v = _rand_operands(hkv, m, d, p, seed=7)
    o, lse = prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=3, persistent_ctas=4,
                                  max_concurrent_steps=3, interpret=True, _cpu_check=True)
    assert o.shape == (3, hkv, m, d) and lse.shape == (3, hkv, m)
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    ro, rl = _reference_partials(q, k, v, n, d ** -0.5)
    assert float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro)) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=1e-4, rtol=1e-5)


def test_persistent_ctas_validation_and_lowering():
    q, k, v = _rand_operands(1, 128, 64, 512, seed=0)
    for bad in (0, 5):   # 1 kv head x 1 row block x 4 splits = 4 tasks
        with pytest.raises(ValueError, match=f"persistent_ctas={bad} must be in \\[1, 4\\]"):
            prefix_partials_mgpu(q, k, v, 512, scale=0.125, num_splits=4, persistent_ctas=bad)
    txt = lower_for_cuda(
        lambda q, k, v, n: prefix_partials_mgpu(q, k, v, n, scale=0.125, num_splits=4,
                                                persistent_ctas=100),
        S((8, 1024, 128), jnp.bfloat16), S((4096, 8, 128), jnp.bfloat16),
        S((4096, 8, 128), jnp.bfloat16), S((1,), jnp.int32))
    assert "mosaic_gpu" in txt


def _grouped_case(hkv, blocks, groups, d, p, seed):
    rng = np.random.default_rng(seed)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16)  # noqa: E731
    return f(hkv, blocks * 128, d), f(groups, p, hkv, d), f(groups, p, hkv, d)


def _check_grouped(q, k, v, lengths, block_group, o, lse, scale):
    """Each 128-row block against the reference over its own group's prefix."""
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    for mb, g in enumerate(np.asarray(block_group)):
        rows = slice(mb * 128, (mb + 1) * 128)
        ro, rl = _reference_partials(q[:, rows], k[g], v[g], int(lengths[g]), scale)
        if int(lengths[g]) <= 0:
            assert bool(jnp.all(jnp.isneginf(lse[:, rows]))) and bool(jnp.all(o[:, rows] == 0))
            continue
        assert float(jnp.linalg.norm(o[:, rows] - ro) / jnp.linalg.norm(ro)) < 2e-2, mb
        np.testing.assert_allclose(np.asarray(lse[:, rows]), np.asarray(rl), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(num_splits=2), dict(num_splits=2, persistent_ctas=3)])
def test_grouped_prefixes_in_cpu_interpreter(kw):
    """``block_group``: each 128-row block reads its own prefix group (groups out of order, one
    twice, one empty, a length past P clamped), split and persistent."""
    hkv, d, p = 2, 64, 256
    lengths = np.array([200, 0, 256, 999])
    block_group = jnp.array([2, 0, 3, 0], jnp.int32)
    q, k, v = _grouped_case(hkv, 4, 4, d, p, seed=3)
    o, lse = prefix_partials_mgpu(q, k, v, jnp.asarray(lengths, jnp.int32), scale=d ** -0.5,
                                  block_group=block_group, interpret=True, _cpu_check=True, **kw)
    assert o.shape == (2, hkv, 512, d)
    _check_grouped(q, k, v, np.minimum(lengths, p), block_group, o, lse, d ** -0.5)


def test_grouped_prefixes_validation_and_lowering():
    q, k, v = _grouped_case(1, 2, 3, 64, 256, seed=0)
    with pytest.raises(ValueError, match="block_group must have shape \\(1,\\)"):
        prefix_partials_mgpu(q[:, :128], k, v, jnp.zeros(3, jnp.int32), scale=0.1,
                             block_group=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="k/v must have shape"):
        prefix_partials_mgpu(q, k[0], v[0], jnp.zeros(3, jnp.int32), scale=0.1,
                             block_group=jnp.zeros(2, jnp.int32))
    for kw in (dict(num_splits=4), dict(num_splits=2, persistent_ctas=100)):
        txt = lower_for_cuda(
            lambda q, k, v, n, bg: prefix_partials_mgpu(q, k, v, n, scale=0.125, block_group=bg,
                                                        **kw),
            S((8, 1280, 128), jnp.bfloat16), S((3, 4096, 8, 128), jnp.bfloat16),
            S((3, 4096, 8, 128), jnp.bfloat16), S((3,), jnp.int32), S((10,), jnp.int32))
        assert "mosaic_gpu" in txt


@pytest.mark.gpu
def test_gpu_grouped_prefixes():
    hkv, d, p, groups = 8, 128, 2048, 4
    lengths = np.array([2048, 1000, 0, 1537])
    block_group = jnp.array([3, 0, 0, 1, 2, 3, 1, 0], jnp.int32)
    q, k, v = _grouped_case(hkv, 8, groups, d, p, seed=11)
    o, lse = jax.jit(lambda *a: prefix_partials_mgpu(*a, scale=d ** -0.5, num_splits=2,
                                                     block_group=block_group))(
        q, k, v, jnp.asarray(lengths, jnp.int32))
    _check_grouped(q, k, v, lengths, block_group, o, lse, d ** -0.5)


@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(3, 8, 2, 64, 256, 20),
                                           (32, 8, 2, 64, 128, 9)])  # 128 rows: unwritten tail rows read
def test_shared_path_with_mgpu_backend_in_cpu_interpreter(b, hq, hkv, d, p, s):
    """The ``mgpu_two_launch`` leaf (Mosaic prefix partials in 16-bit, padding of the rows, the
    suffix kernel in the queries' own layout launched independently, one XLA merge) against the
    concatenation oracle, on the CPU."""
    args, kw, meta = make_case(7, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=jnp.bfloat16,
                               suffix_lengths=[0, s] + [7] * (b - 2))
    plan = forced_plan(args[0], args[1], args[3], "mgpu_two_launch")
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, plan=plan, interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


def test_shared_path_mgpu_split_suffix():
    """Few (sequence, kv head) programs and a long suffix: the suffix keys are split (3 chunks
    here) in the queries' own layout and merged in XLA with the prefix partials; against the
    concatenation oracle."""
    b, hkv, s = 3, 2, 300
    args, kw, meta = make_case(8, b=b, tq=1, hq=8, hkv=hkv, d=64, g=0, p=128, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=[0, s, 131])
    plan = forced_plan(args[0], args[1], args[3], "mgpu_two_launch")
    assert plan.chunks[0].leaf.suffix_splits == 3
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, plan=plan, interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


# --------------------------------------------------------------------------- GPU

def _reference_partials(q_hmd, k, v, n, scale):
    qf, kf, vf = (x.astype(jnp.float32) for x in (q_hmd, k, v))
    sc = jnp.einsum("hmd,phd->hmp", qf, kf, precision="highest") * scale
    sc = jnp.where(jnp.arange(k.shape[0])[None, None, :] < n, sc, -jnp.inf)
    lse = jax.nn.logsumexp(sc, axis=-1)
    o = jnp.einsum("hmp,phd->hmd", jnp.exp(sc - lse[..., None]), vf, precision="highest")
    return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("hkv,m,d,p,n,splits,sched,out_rows", [
    (8, 1152, 128, 4096, 4096, None, True, None), (8, 256, 128, 2048, 1500, 4, True, 268),
    (1, 128, 64, 512, 512, 1, True, None), (2, 384, 128, 1024, 0, 2, True, None),
    (8, 1024, 128, 4096, 3000, None, False, 1036), (1, 256, 64, 1024, 1024, 2, False, None),
    (1, 512, 128, 16384, 16000, 16, True, None), (8, 256, 128, 4096, 4000, 8, True, 268),
    (8, 1024, 128, 16384, 16384, None, True, None),   # 64 CTAs, 16K prefix: 2 splits
    (8, 1024, 128, 16256, 16256, None, True, None),   # 127 tiles (prime): 2 uneven splits
    (1, 256, 64, 1280, 5000, 4, True, None)])         # 10 tiles in 4 splits; length past P
@pytest.mark.parametrize("stages", [2, 3])  # 3: the LSE stored from registers
def test_gpu_kernel_matches_reference(hkv, m, d, p, n, splits, sched, out_rows, stages):
    """(``splits=None``: the planner's prefix splits for these CTAs on this GPU)"""
    if splits is None:
        splits = choose_splits(p // 128, hkv * m // 128, device_info().sm_count)
    rng = np.random.default_rng(m + p)
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((p, hkv, d), np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((p, hkv, d), np.float32), jnp.bfloat16)
    o, lse = prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=splits,
                                  schedule_barrier=sched, out_rows=out_rows,
                                  max_concurrent_steps=stages)
    if out_rows is not None:  # allocated rounded up to 16 rows; only the first m are defined
        assert o.shape[2] == lse.shape[2] == -(-out_rows // 16) * 16
        o, lse = o[:, :, :m], lse[:, :, :m]
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    ro, rl = _reference_partials(q, k, v, n, d ** -0.5)
    if n == 0:
        assert bool(jnp.all(jnp.isneginf(lse))) and bool(jnp.all(o == 0))
        return
    rel = float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro))
    assert rel < 2e-2, rel
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hkv,m,d,p,n,splits,ctas", [
    (8, 1024, 128, 4096, 3000, 4, 100), (1, 512, 64, 8192, 8192, 16, 7)])
def test_gpu_persistent_ctas(hkv, m, d, p, n, splits, ctas):
    """The persistent form on the GPU: against the reference, and equal to the grid form."""
    q, k, v = _rand_operands(hkv, m, d, p, seed=m + p)
    o, lse = prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=splits,
                                  persistent_ctas=ctas)
    o_grid, lse_grid = prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=splits)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o_grid, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_grid))
    o, lse = merge_partials(o.astype(jnp.float32), lse)
    ro, rl = _reference_partials(q, k, v, n, d ** -0.5)
    assert float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro)) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(24, 32, 8, 128, 1024, 300), (256, 8, 1, 128, 4096, 64),
                                           (16, 8, 8, 64, 512, 100),
                                           (256, 8, 1, 128, 2048, 300)])  # unsplit suffix at 256
def test_gpu_shared_path_with_mgpu_backend(b, hq, hkv, d, p, s):
    """The ``mgpu_two_launch`` leaf, planned for this GPU, compiled, against the oracle."""
    sl = np.random.default_rng(b).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(90 + b, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=jnp.bfloat16,
                               suffix_lengths=sl)
    plan = forced_plan(args[0], args[1], args[3], "mgpu_two_launch", device=device_info(),
                       interpret=False)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, plan=plan))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)
