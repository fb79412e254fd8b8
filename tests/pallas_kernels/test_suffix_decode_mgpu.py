"""The stream-only Mosaic GPU decode suffix launch (``pallas_kernels.suffix_decode_mgpu``): the
stream role of the role-split kernel on every CTA.

CPU: support and validation; the launch lowered for CUDA (Mosaic GPU layout inference, the
role's shared-memory budget; no PTX is compiled); Mosaic GPU's interpreter: the suffix states
against float64 NumPy with random suffix lengths (0 and the capacity included), NaN in the
cache past them and more tasks than workers; the whole shared path through the leaf that runs
it beside the Mosaic GPU prefix kernel (``mgpu_stream_two_launch``, forced by a plan) against
the concatenation oracle, and its CUDA lowering; the same for the flat decode leaf that runs
the launch twice (``flat_mgpu_stream``: the prefix through ``kv_rows``, then the suffix).  GPU
(marker ``gpu``): the same at decode sizes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (check, check_row_states, decode_row_states, decode_rows_case, forced_plan,
                     lower_for_cuda, make_case, oracle)
from jax_prefix_attn import shared_prefix_attention
from jax_prefix_attn.device import H100_SXM, device_info
from pallas_kernels import suffix_decode_mgpu as sdm
from pallas_kernels._common import rows_128

S = jax.ShapeDtypeStruct
HOPPER_SMEM = H100_SXM.smem_per_block
BF = jnp.bfloat16


def _states(q_hmd, sk, sv, sl, *, group, ctas, stages=None, wgs=3, interpret=False):
    return [sdm.suffix_decode_partials_mgpu(
        q_hmd, sk, sv, sl, scale=q_hmd.shape[-1] ** -0.5, group=group, stream_ctas=ctas,
        smem_bytes=HOPPER_SMEM, stream_stages=stages, stream_wgs=wgs, interpret=interpret)]


def test_supported_and_validation():
    ok = dict(batch=64, heads_q=32, heads_kv=8, suffix_cap=128, head_dim=128, dtype=BF,
              smem_bytes=HOPPER_SMEM)
    assert sdm.suffix_decode_supported(**ok) is None
    assert "power of two" in sdm.suffix_decode_supported(**{**ok, "heads_q": 24})
    assert "suffix capacity" in sdm.suffix_decode_supported(**{**ok, "suffix_cap": 100})
    assert "shared memory" in sdm.suffix_decode_supported(**{**ok, "smem_bytes": 60000})
    q = jnp.zeros((8, 128, 128), BF)
    skv = jnp.zeros((32, 64, 8, 128), BF)
    sl = jnp.zeros((32,), jnp.int32)
    with pytest.raises(ValueError, match="stream_ctas=65"):      # 8 tasks per kv head: 64
        _states(q, skv, skv, sl, group=4, ctas=65)
    with pytest.raises(ValueError, match="stream_wgs=4"):
        _states(q, skv, skv, sl, group=4, ctas=2, wgs=4)
    with pytest.raises(ValueError, match="q_hmd has 16 rows"):
        _states(q[:, :16], skv, skv, sl, group=4, ctas=2)
    with pytest.raises(ValueError, match="suffix k/v must have shape"):
        _states(q, skv, skv[:, :, :4], sl, group=4, ctas=2)
    with pytest.raises(ValueError, match="kv_rows must have shape \\(32,\\)"):
        sdm.suffix_decode_partials_mgpu(q, skv[:3], skv[:3], sl, scale=1.0, group=4,
                                        stream_ctas=2, smem_bytes=HOPPER_SMEM,
                                        kv_rows=jnp.zeros((31,), jnp.int32))


@pytest.mark.parametrize("b,hq,hkv,d,s,ctas,wgs", [(1024, 32, 8, 128, 128, 132, 3),
                                                   (256, 8, 1, 128, 1024, 64, 2),
                                                   (6, 4, 2, 64, 192, 1, 3)])
def test_lowers_for_cuda_on_cpu(b, hq, hkv, d, s, ctas, wgs):
    g = hq // hkv

    def fn(q, sk, sv, sl):
        return _states(rows_128(q[:, None], hkv, g)[0], sk, sv, sl, group=g, ctas=ctas, wgs=wgs)
    txt = lower_for_cuda(fn, S((b, hq, d), BF), S((b, s, hkv, d), BF), S((b, s, hkv, d), BF),
                         S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


def _check(b, hq, hkv, d, s, *, interpret=False, **kw):
    g = hq // hkv
    q, pk, pv, sk, sv, sl = decode_rows_case(b + 7, b, hq, hkv, d, 128, s)
    fn = lambda *a: _states(*a, group=g, interpret=interpret, **kw)  # noqa: E731
    got = jax.jit(fn)(q, sk, sv, jnp.asarray(sl, jnp.int32))
    want = decode_row_states(q, pk, pv, 0, sk, sv, sl, g, d ** -0.5)
    check_row_states(got, want, b, g, names=("suf",))


# Mosaic GPU's CPU interpreter, about 10-20 s a case.
@pytest.mark.parametrize("b,hq,hkv,d,s,kw", [
    (10, 8, 2, 64, 128, dict(ctas=1, wgs=3)),     # G=4: 3 workers, several rounds
    (5, 16, 1, 64, 64, dict(ctas=2, wgs=2)),      # G=16: one sequence per task, padding tasks
])
def test_interpreter_matches_float64_with_nan_past_lengths(b, hq, hkv, d, s, kw):
    _check(b, hq, hkv, d, s, interpret=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,s,ctas,wgs", [
    (1024, 32, 8, 128, 128, 132, 3),   # Llama-3 heads, B=1024
    (256, 8, 1, 128, 1024, 128, 3),    # G=8, long suffixes: 128 tasks
    (33, 4, 2, 64, 192, 3, 2),         # G=2, D=64, two workers
])
def test_gpu_matches_float64_with_nan_past_lengths(b, hq, hkv, d, s, ctas, wgs):
    _check(b, hq, hkv, d, s, ctas=ctas, wgs=wgs)


def _leaf_path(path, b, hq, hkv, d, p, s, seed, interpret, g=0):
    """The whole path through leaf ``path`` (forced by a plan) against the oracle (``g``
    prefixes with random lengths and a random assignment; 0: one)."""
    sl = np.random.default_rng(seed).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(seed, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=g, p=p, s=s, dtype=BF,
                               suffix_lengths=sl)
    plan = forced_plan(args[0], args[1], args[3], path,
                       device=H100_SXM if interpret else device_info(), interpret=interpret)
    assert plan.path == path
    fn = lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, plan=plan,  # noqa: E731
                                            interpret=interpret)
    out, lse = jax.jit(fn)(*args)
    check(out, lse, oracle(args, kw, meta), BF)
    return plan


def _lowers_without_triton(path, b, hq, hkv, d, p, s, g):
    """Leaf ``path`` lowered for CUDA at ``g`` full prefixes (0: one, given as ``[1, P]``): only
    Mosaic GPU kernels in the program."""
    gg = max(g, 1)
    args = (S((b, 1, hq, d), BF), S((gg, p, hkv, d), BF), S((gg, p, hkv, d), BF),
            S((b, s, hkv, d), BF), S((b, s, hkv, d), BF))
    plan = forced_plan(args[0], args[1], args[3], path, device=H100_SXM, interpret=False)
    lens = dict(suffix_lengths=jnp.full((b,), s, jnp.int32))
    if g:
        lens.update(prefix_lengths=jnp.full((g,), p, jnp.int32),
                    seq_to_prefix=jnp.arange(b, dtype=jnp.int32) % g)
    txt = lower_for_cuda(lambda *a: shared_prefix_attention(*a, **lens, plan=plan), *args)
    assert txt.count("mosaic_gpu") >= 2 and "triton" not in txt.lower()


def test_shared_path_in_cpu_interpreter():
    _leaf_path("mgpu_stream_two_launch", 20, 8, 2, 64, 256, 64, 13, interpret=True)


def test_shared_path_with_prefix_groups_in_cpu_interpreter():
    """Three prefixes: each group's rows in row blocks of their own (groups of unequal sizes,
    maybe one empty), a prefix length of 0 possible."""
    _leaf_path("mgpu_stream_two_launch", 12, 8, 2, 64, 128, 64, 5, interpret=True, g=3)


@pytest.mark.parametrize("b,hq,hkv,d,p,s,g", [(1024, 32, 8, 128, 4096, 256, 0),
                                              (512, 32, 8, 128, 2048, 128, 4)])
def test_shared_path_lowers_for_cuda_on_cpu(b, hq, hkv, d, p, s, g):
    _lowers_without_triton("mgpu_stream_two_launch", b, hq, hkv, d, p, s, g)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s,g", [(1024, 32, 8, 128, 4096, 256, 0),
                                              (96, 8, 1, 128, 1024, 256, 0),
                                              (64, 16, 4, 64, 512, 192, 0),
                                              (512, 32, 8, 128, 2048, 128, 4),
                                              (64, 8, 1, 64, 1024, 256, 3)])
def test_gpu_shared_path(b, hq, hkv, d, p, s, g):
    _leaf_path("mgpu_stream_two_launch", b, hq, hkv, d, p, s, 90 + b + g, interpret=False, g=g)


@pytest.mark.parametrize("g", [0, 3])
def test_flat_path_in_cpu_interpreter(g):
    """One prefix, and three (each sequence streams its group's row of the prefix buffer;
    ragged prefix lengths, 0 possible)."""
    plan = _leaf_path("flat_mgpu_stream", 9, 8, 2, 64, 128, 64, 21 + g, interpret=True, g=g)
    assert plan.impl == "flat"


def test_flat_path_lowers_for_cuda_on_cpu():
    _lowers_without_triton("flat_mgpu_stream", 16, 32, 8, 128, 4096, 256, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s,g", [(8, 32, 8, 128, 4096, 256, 0),
                                              (16, 8, 1, 64, 1024, 128, 3)])
def test_gpu_flat_path(b, hq, hkv, d, p, s, g):
    _leaf_path("flat_mgpu_stream", b, hq, hkv, d, p, s, 50 + b, interpret=False, g=g)
