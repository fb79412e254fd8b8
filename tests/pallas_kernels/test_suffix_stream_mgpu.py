"""The streamed decode suffix pass (``pallas_kernels.suffix_stream_mgpu``): the stream role of the
role-split kernel (``split_decode_mgpu``), whose self-scheduled warpgroups walk (row block, kv
head) tasks with the swapped products of that module's helpers.

CPU: the static helpers (support, task columns, query buffers, shared-memory budget) and the
validation they feed; the split kernel lowered for CUDA at stream settings (Mosaic GPU layout
inference and the stream role's shared-memory budget; no PTX is compiled); Mosaic GPU's
interpreter: the kernel's suffix states (and, beside them, the prefix states) against float64
NumPy.  GPU (marker ``gpu``): the suffix states (output and LSE) against float64 NumPy, with
random suffix lengths (0 and the capacity included), NaN in the cache past them, and more tasks
than workers (several rounds, padding tasks in the last).
"""
import jax
import jax.numpy as jnp
import pytest

from helpers import check_row_states, decode_row_states, decode_rows_case, lower_for_cuda
from jax_prefix_attn.device import H100_SXM
from pallas_kernels import suffix_stream_mgpu as ss
from pallas_kernels._common import rows_128
from pallas_kernels.split_decode_mgpu import STREAM_WGS, split_decode_partials_mgpu

S = jax.ShapeDtypeStruct
HOPPER_SMEM = H100_SXM.smem_per_block
P, P_LEN = 128, 100     # a short ragged prefix: one prefix task per (kv head, row block)


def test_supported_and_validation():
    ok = dict(heads_q=32, heads_kv=8, suffix_cap=128, head_dim=128, dtype=jnp.bfloat16)
    assert ss.stream_supported(**ok) is None
    assert "power of two" in ss.stream_supported(**{**ok, "heads_q": 24})
    assert "power of two" in ss.stream_supported(**{**ok, "heads_q": 256})
    assert "suffix capacity" in ss.stream_supported(**{**ok, "suffix_cap": 100})
    assert "head_dim" in ss.stream_supported(**{**ok, "head_dim": 96})
    assert "dtype" in ss.stream_supported(**{**ok, "dtype": jnp.float32})
    assert ss.cols_for(4) == 16 and ss.cols_for(16) == 16 and ss.cols_for(1) == 16
    # a task's queries load at its first step, ``stages`` steps ahead: enough buffers that the
    # previous task on that buffer has finished
    assert ss.n_q_buffers(1, 8) == 1 and ss.n_q_buffers(3, 8) == 2 and ss.n_q_buffers(4, 1) == 4
    assert ss.n_q_buffers(4, 2) == 3
    # K/V stages, query buffers, P^T and (with two workers) the O^T staging tile, per worker
    assert ss.stream_smem_bytes(2, 1, 16, 128, 2, wgs=2) == 2 * 2 * (2 * 2 * 64 * 128 + 16 * 128
                                                                    + 64 * 16 + 128 * 16)
    assert ss.stream_smem_bytes(2, 1, 16, 128, 2, wgs=3) == 2 * 3 * (2 * 2 * 64 * 128 + 16 * 128
                                                                    + 64 * 16)
    assert ss.red_bytes(2) == ss.RED_SCRATCH and ss.red_bytes(STREAM_WGS) < ss.RED_SCRATCH
    q = jnp.zeros((8, 128, 128), jnp.bfloat16)
    pkv = jnp.zeros((P, 8, 128), jnp.bfloat16)
    skv = jnp.zeros((32, 100, 8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="suffix capacity 100"):
        split_decode_partials_mgpu(q, pkv, pkv, P, skv, skv, jnp.zeros((32,), jnp.int32),
                                   scale=1.0, group=4, prefix_ctas=1, stream_ctas=1, num_splits=1,
                                   smem_bytes=HOPPER_SMEM)
    with pytest.raises(ValueError, match="stream_ctas=65"):   # 8 tasks per kv head: 64
        split_decode_partials_mgpu(q, pkv, pkv, P, skv[:, :64], skv[:, :64],
                                   jnp.zeros((32,), jnp.int32), scale=1.0, group=4, prefix_ctas=1,
                                   stream_ctas=8 * 8 + 1, num_splits=1, smem_bytes=HOPPER_SMEM)


def _states(q_hmd, pk, pv, sk, sv, sl, *, group, ctas, stages=None, wgs=2, interpret=False):
    """The split kernel's ``[(o_pre, lse_pre), (o_suf, lse_suf)]`` for row-layout queries
    ``q_hmd [Hkv, M, D]`` (``group`` rows per sequence) with ``ctas`` stream CTAs of ``wgs``
    workers (``stages`` steps in flight, None: the most that fit) beside one prefix CTA."""
    return split_decode_partials_mgpu(
        q_hmd, pk, pv, P_LEN, sk, sv, sl, scale=q_hmd.shape[-1] ** -0.5, group=group,
        prefix_ctas=1, stream_ctas=ctas, num_splits=1, smem_bytes=HOPPER_SMEM,
        stream_stages=stages, stream_wgs=wgs, interpret=interpret)


@pytest.mark.parametrize("b,hq,hkv,d,s,ctas,wgs", [(512, 32, 8, 128, 128, 20, 2),
                                                   (40, 32, 2, 128, 64, 2, 2),
                                                   (6, 4, 2, 64, 192, 2, 2),
                                                   (512, 32, 8, 128, 128, 24, 3)])
def test_lowers_for_cuda_on_cpu(b, hq, hkv, d, s, ctas, wgs):
    g = hq // hkv

    def fn(q, pk, pv, sk, sv, sl):
        return _states(rows_128(q[:, None], hkv, g)[0], pk, pv, sk, sv, sl, group=g, ctas=ctas,
                       wgs=wgs)
    txt = lower_for_cuda(fn, S((b, hq, d), jnp.bfloat16), S((P, hkv, d), jnp.bfloat16),
                         S((P, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
                         S((b, s, hkv, d), jnp.bfloat16), S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


def _check(b, hq, hkv, d, s, *, interpret=False, **kw):
    """The kernel's suffix (and prefix) states against float64 NumPy, with random suffix lengths
    (0 and the capacity included) and NaN in the cache past them."""
    g = hq // hkv
    q, pk, pv, sk, sv, sl = decode_rows_case(b, b, hq, hkv, d, P, s)
    fn = lambda *a: _states(*a, group=g, interpret=interpret, **kw)  # noqa: E731
    got = jax.jit(fn)(q, pk, pv, sk, sv, jnp.asarray(sl, jnp.int32))
    want = decode_row_states(q, pk, pv, P_LEN, sk, sv, sl, g, d ** -0.5)
    check_row_states(got, want, b, g)


# Mosaic GPU's CPU interpreter (simulated warpgroups, barriers, TMA, wgmma; it also checks that
# every barrier phase is observed), about 10-20 s a case.
@pytest.mark.parametrize("b,hq,hkv,d,s,kw", [
    (10, 8, 2, 64, 128, dict(ctas=1)),                          # G=4, 3 rounds
    (9, 2, 2, 64, 192, dict(ctas=1)),                           # G=1: 16 sequences per task
    (5, 16, 1, 64, 64, dict(ctas=2)),                           # G=16: 1 step a task, padding tasks
])
def test_interpreter_matches_float64_with_nan_past_lengths(b, hq, hkv, d, s, kw):
    _check(b, hq, hkv, d, s, interpret=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,s,ctas,stages,wgs", [
    (70, 32, 8, 128, 128, 5, None, 2),   # G=4: 4 sequences per task; 15 rounds of 10 workers
    (33, 8, 1, 128, 192, 3, None, 2),    # G=8: 2 sequences per task, 3 tiles each
    (29, 4, 2, 64, 256, 4, 2, 2),        # G=2, D=64, 2 stages
    (21, 16, 1, 128, 64, 2, None, 2),    # G=16: one sequence per task
    (45, 4, 4, 64, 128, 3, 1, 2),        # G=1: 16 sequences per task, 1 stage
    (70, 32, 8, 128, 128, 5, None, 3),   # three workers per CTA (O^T stored from registers)
    (33, 8, 1, 128, 192, 3, None, 3),
])
def test_gpu_matches_float64_with_nan_past_lengths(b, hq, hkv, d, s, ctas, stages, wgs):
    _check(b, hq, hkv, d, s, ctas=ctas, stages=stages, wgs=wgs)
