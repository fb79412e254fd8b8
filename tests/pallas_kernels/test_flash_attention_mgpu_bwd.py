"""Mosaic GPU flash attention backward (``pallas_kernels.flash_attention_mgpu_bwd``) and the
differentiable entry point (``pallas_kernels.flash_attention_mgpu_vjp``).

CPU: (1) argument and tile checks; (2) the kernels traced and lowered for CUDA at realistic
shapes (API, layout inference, transfer plans; no PTX is compiled); (3) the kernels in Mosaic
GPU's CPU interpreter at small odd shapes against float64 NumPy gradients written from the
softmax equations, with a cotangent on ``out`` and one on ``lse``: ragged ``kv_lengths`` with NaN
keys and values past them, ``Tq != Tk``, rows that see no key, GQA groups 1/2/4/8, head_dim
64/128 and a zero-padded 80, causal and full, bfloat16 and float16; the backward alone (row
statistics from the reference) and through ``jax.vjp`` of the forward; the dK/dV kernel with its
columns split between two warpgroups (``split_dkv_columns``) likewise and lowered at head_dim 256.
GPU (marker ``gpu``): compiled, jitted, at realistic sizes against ``jax.grad`` of the library's
pure-JAX reference and, without lengths, cuDNN's gradients; the split dK/dV kernel against the
default one and the reference.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda
from jax_prefix_attn import reference
from pallas_kernels.flash_attention_mgpu import SMEM_LIMIT
from pallas_kernels.flash_attention_mgpu_bwd import (default_tiles, flash_attention_mgpu_bwd,
                                                     resolve_tiles, smem_bytes)
from pallas_kernels.flash_attention_mgpu_vjp import flash_attention_mgpu_vjp

S = jax.ShapeDtypeStruct


def np_attention_grads(q, k, v, d_out, d_lse, lengths, causal, scale):
    """float64 ``(out, lse, dq, dk, dv)`` from the equations, per sequence and query head over
    the keys ``j < L`` (and ``j <= i + L - Tq`` when causal): ``s = scale q k^T``, ``lse =
    log sum exp s``, ``p = exp(s - lse)``, ``out = p v``; with cotangents ``d_out``, ``d_lse``:
    ``ds = p (d_out v^T - rowsum(d_out * out) + d_lse)``, ``dq = scale ds k``, ``dk = scale ds^T q``,
    ``dv = p^T d_out``, summed over the query heads of a kv head.  A row without keys: ``lse =
    -inf``, ``out = 0``, no gradient; keys past ``L`` (NaN allowed) get zero gradients."""
    q, k, v, d_out, d_lse = (np.asarray(x, np.float64) for x in (q, k, v, d_out, d_lse))
    b, tq, hq, _ = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out, lse = np.zeros_like(q), np.full((b, tq, hq), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        n = int(lengths[bi])
        i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
        vis = np.broadcast_to((j < n) & ((j <= i + n - tq) if causal else True), (tq, tk))
        kk, vv = np.nan_to_num(k[bi] * (j[0, :, None, None] < n)), np.nan_to_num(v[bi])
        vv = vv * (j[0, :, None, None] < n)
        for h in range(hq):
            s = np.where(vis, scale * q[bi, :, h] @ kk[:, h // g].T, -np.inf)
            rows = vis.any(1)
            m = np.where(rows, s.max(1), 0.0)[:, None]
            w = np.exp(s - m)
            lse[bi, rows, h] = (m[:, 0] + np.log(np.where(rows, w.sum(1), 1.0)))[rows]
            p = np.where(rows[:, None], w / np.where(rows, w.sum(1), 1.0)[:, None], 0.0)
            out[bi, :, h] = p @ vv[:, h // g]
            do = d_out[bi, :, h]
            ds = p * (do @ vv[:, h // g].T - (do * out[bi, :, h]).sum(1, keepdims=True)
                      + d_lse[bi, :, h][:, None])
            dq[bi, :, h] = scale * ds @ kk[:, h // g]
            dk[bi, :, h // g] += scale * ds.T @ q[bi, :, h]
            dv[bi, :, h // g] += p.T @ do
    return out, lse, dq, dk, dv


def _case(seed, b, tq, tk, hq, hkv, d, dtype, lengths):
    """Random operands and cotangents; keys and values at and past each length are NaN."""
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((b, tq, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, tk, hkv, d)).astype(np.float32) for _ in range(2))
    dlse = rng.standard_normal((b, tq, hq)).astype(np.float32)
    lens = np.full((b,), tk) if lengths is None else np.asarray(lengths)
    for bi in range(b):
        k[bi, lens[bi]:] = np.nan
        v[bi, lens[bi]:] = np.nan
    q, k, v, do = (jnp.asarray(x, dtype) for x in (q, k, v, do))
    return q, k, v, do, jnp.asarray(dlse), lens


def _check_grads(got, want, lens, tol):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert not np.isnan(g).any(), name
        rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert rel < tol, (name, rel)
        if name != "dq":
            for bi, n in enumerate(lens):
                assert np.all(g[bi, n:] == 0), (name, bi)


# ---------------------------------------------------------------------------- arguments

def test_tiles_and_argument_checks():
    bf = jnp.bfloat16
    for d in (64, 128, 256):
        need = smem_bytes(d, bf, **default_tiles(d))
        assert max(need.values()) <= SMEM_LIMIT, (d, need)
    assert resolve_tiles(80, bf)["block_kv_dq"] == 128 and resolve_tiles(200, bf)["compute_wgs"] == 1
    unsplit_two = dict(default_tiles(256), compute_wgs=2, split_dkv_columns=False)
    assert max(smem_bytes(256, bf, **unsplit_two).values()) > SMEM_LIMIT
    assert [default_tiles(d)["split_dkv_columns"] for d in (64, 128, 256)] == [False, False, True]
    split = smem_bytes(256, bf, **dict(default_tiles(256), split_dkv_columns=True))
    assert split["dkv"] <= SMEM_LIMIT and split["dkv"] < smem_bytes(256, bf, **unsplit_two)["dkv"]
    assert resolve_tiles(200, bf, split_dkv_columns=True)["split_dkv_columns"] is True
    with pytest.raises(ValueError, match="shared memory in the dq kernel"):
        resolve_tiles(128, bf, block_kv_dq=256, num_stages=3)
    for kw, msg in (({"block_q_dq": 96}, "block_q_dq must be a multiple of 64, got 96"),
                    ({"block_kv_dq": 32}, "block_kv_dq must be a multiple of 64 in \\[64, 256\\]"),
                    ({"block_q_dkv": 320}, "block_q_dkv must be a multiple of 64 in"),
                    ({"num_stages": 1}, "num_stages must be in \\[2, 8\\], got 1"),
                    ({"compute_wgs": 3}, "compute_wgs must be in \\[1, 2\\], got 3"),
                    ({"split_dkv_columns": 1}, "split_dkv_columns must be a bool, got 1"),
                    ({"split_dkv_columns": True}, "split_dkv_columns needs head_dim above 64"),
                    ({"block_size": 64}, "unknown tile arguments \\['block_size'\\]")):
        with pytest.raises(ValueError, match=msg):
            resolve_tiles(64, bf, **kw)
    z = lambda *s, dt=bf: jnp.zeros(s, dt)  # noqa: E731
    q, kv, r = z(1, 64, 2, 64), z(1, 64, 1, 64), z(1, 64, 2, dt=jnp.float32)
    with pytest.raises(TypeError, match="bfloat16 or float16, got float32"):
        flash_attention_mgpu_bwd(z(1, 64, 2, 64, dt=jnp.float32), kv, kv, q, r, r)
    with pytest.raises(TypeError, match="d_out must be an array"):
        flash_attention_mgpu_bwd(q, kv, kv, None, r, r)
    with pytest.raises(ValueError, match="lse must have shape \\(1, 64, 2\\), got \\(1, 2, 64\\)"):
        flash_attention_mgpu_bwd(q, kv, kv, q, z(1, 2, 64, dt=jnp.float32), r)
    with pytest.raises(ValueError, match="kv_lengths must be an integer array of shape \\[1\\]"):
        flash_attention_mgpu_bwd(q, kv, kv, q, r, r, kv_lengths=jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        flash_attention_mgpu_bwd(q, kv, z(1, 32, 1, 64), q, r, r)
    with pytest.raises(ValueError, match="heads_q must be a multiple of heads_kv"):
        flash_attention_mgpu_bwd(z(1, 64, 3, 64), kv[:, :, :1].repeat(2, 2), kv.repeat(2, 2),
                                 z(1, 64, 3, 64), z(1, 64, 3, dt=jnp.float32),
                                 z(1, 64, 3, dt=jnp.float32))
    with pytest.raises(TypeError, match="bwd_tiles must be a dict"):
        flash_attention_mgpu_vjp(q, kv, kv, bwd_tiles=[64])
    with pytest.raises(ValueError, match="block_kv_dkv must be a multiple of 64"):
        flash_attention_mgpu_vjp(q, kv, kv, bwd_tiles={"block_kv_dkv": 32})
    with pytest.raises(TypeError, match="bfloat16 and float16.*float32"):
        flash_attention_mgpu_vjp(z(1, 64, 2, 64, dt=jnp.float32), kv, kv)
    with pytest.raises(ValueError, match="split_dkv_columns must be a bool, got 'yes'"):
        flash_attention_mgpu_vjp(q, kv, kv, bwd_tiles={"split_dkv_columns": "yes"})


# ---------------------------------------------------------------------------- CUDA lowering

@pytest.mark.parametrize("t,hq,hkv,d,causal,dtype", [
    (4096, 32, 8, 128, True, jnp.bfloat16), (4096, 32, 8, 64, False, jnp.float16),
    (4096, 32, 8, 256, True, jnp.bfloat16),
    (1000, 28, 7, 96, True, jnp.float16)])   # padded head_dim, sequence not a tile multiple
def test_backward_lowers_for_cuda(t, hq, hkv, d, causal, dtype):
    b = 2
    txt = lower_for_cuda(
        lambda q, k, v, do, lse, delta, n: flash_attention_mgpu_bwd(
            q, k, v, do, lse, delta, causal=causal, kv_lengths=n),
        S((b, t, hq, d), dtype), S((b, t, hkv, d), dtype), S((b, t, hkv, d), dtype),
        S((b, t, hq, d), dtype), S((b, t, hq), jnp.float32), S((b, t, hq), jnp.float32),
        S((b,), jnp.int32))
    assert txt.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("d,tiles", [(256, {}), (128, {"block_q_dkv": 128})])
def test_split_dkv_columns_lowers_for_cuda(d, tiles):
    """The dK/dV kernel with its columns split between two warpgroups, at the head_dim it is for
    (and at 128 with 128-row streamed tiles), through the differentiable entry point."""
    b, t, hq, hkv, dt = 2, 2048, 16, 4, jnp.bfloat16

    def fwd_bwd(q, k, v, do, dlse, n):
        (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention_mgpu_vjp(
            q, k, v, causal=True, kv_lengths=n, bwd_tiles=dict(tiles, split_dkv_columns=True)),
            q, k, v)
        return out, lse, vjp((do, dlse))
    txt = lower_for_cuda(fwd_bwd, S((b, t, hq, d), dt), S((b, t, hkv, d), dt),
                         S((b, t, hkv, d), dt), S((b, t, hq, d), dt), S((b, t, hq), jnp.float32),
                         S((b,), jnp.int32))
    assert txt.count("mosaic_gpu") >= 3


def test_vjp_lowers_for_cuda():
    b, t, hq, hkv, d, dt = 2, 4096, 32, 8, 128, jnp.bfloat16

    def fwd_bwd(q, k, v, do, dlse, n):
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: flash_attention_mgpu_vjp(q, k, v, causal=True, kv_lengths=n), q, k, v)
        return out, lse, vjp((do, dlse))
    txt = lower_for_cuda(fwd_bwd, S((b, t, hq, d), dt), S((b, t, hkv, d), dt),
                         S((b, t, hkv, d), dt), S((b, t, hq, d), dt), S((b, t, hq), jnp.float32),
                         S((b,), jnp.int32))
    assert txt.count("mosaic_gpu") >= 3


# ---------------------------------------------------------------------------- CPU interpreter

@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,causal,dtype,lengths,tiles", [
    # G=1, Tq < Tk, a length shorter than Tq (rows with no key), NaN past the lengths; 3 stages
    (2, 50, 150, 2, 2, 64, True, jnp.bfloat16, [150, 37], {"num_stages": 3}),
    # G=2, float16, head_dim 128, ragged; one compute warpgroup
    (1, 30, 100, 4, 2, 128, True, jnp.float16, [77], {"compute_wgs": 1}),
    # G=8, head_dim 80 (zero-padded to 128), full, Tq > Tk, a zero length next to a ragged one
    (2, 20, 16, 8, 1, 80, False, jnp.bfloat16, [0, 11], {}),
    # two row blocks per warpgroup pair and two key blocks: warpgroups skip tiles; Tq = Tk
    (1, 200, 200, 1, 1, 64, True, jnp.float16, None, {"block_kv_dkv": 64, "block_q_dkv": 64}),
    # dK/dV columns split between two warpgroups: G=2, ragged, a key block past the length
    (1, 21, 75, 2, 1, 128, True, jnp.bfloat16, [53], {"split_dkv_columns": True}),
])
def test_backward_in_cpu_interpreter_matches_reference(b, tq, tk, hq, hkv, d, causal, dtype,
                                                       lengths, tiles):
    _backward_case(b, tq, tk, hq, hkv, d, causal, dtype, lengths, tiles)


def _interpreter_has_transposed_views() -> bool:
    """Whether Mosaic GPU's CPU interpreter reads a transposed shared-memory view as a wgmma
    operand (its accesses carry an axis permutation: ``to_access``); earlier interpreters do not."""
    try:
        from jax._src.pallas.mosaic.interpret import utils  # noqa: PLC0415
    except ImportError:
        return False
    return hasattr(utils, "to_access")


@pytest.mark.skipif(not _interpreter_has_transposed_views(),
                    reason="this jax's Mosaic GPU interpreter has no transposed views")
@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,causal,dtype,lengths,tiles", [
    (2, 50, 150, 4, 2, 64, True, jnp.bfloat16, [150, 37], {}),
    (1, 40, 90, 8, 1, 80, False, jnp.float16, [61], {"compute_wgs": 1}),
    (1, 21, 75, 2, 1, 128, True, jnp.bfloat16, [53], {"split_dkv_columns": True}),
])
def test_backward_with_gpu_operand_views_matches_reference(b, tq, tk, hq, hkv, d, causal, dtype,
                                                           lengths, tiles):
    """The transposed operands read through transposed shared-memory views, as on the GPU."""
    _backward_case(b, tq, tk, hq, hkv, d, causal, dtype, lengths, dict(tiles, _interpret_views=True))


def _backward_case(b, tq, tk, hq, hkv, d, causal, dtype, lengths, tiles):
    q, k, v, do, dlse, lens = _case(b * 100 + tq + tk + d, b, tq, tk, hq, hkv, d, dtype, lengths)
    scale = 0.7 / np.sqrt(d)
    out, lse, *want = np_attention_grads(*(np.asarray(x, np.float32) for x in (q, k, v, do)),
                                         dlse, lens, causal, scale)
    delta = (out * np.asarray(do, np.float64)).sum(-1) - np.asarray(dlse, np.float64)
    got = flash_attention_mgpu_bwd(
        q, k, v, do, jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32),
        causal=causal, kv_lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
        sm_scale=scale, interpret=True, **{"block_kv_dq": 64, **tiles})
    assert [x.dtype for x in got] == [dtype] * 3
    _check_grads(got, want, lens, 2e-2 if dtype == jnp.bfloat16 else 4e-3)


@pytest.mark.parametrize("b,tq,tk,hq,hkv,d,causal,dtype,lengths", [
    # G=4, causal, Tq < Tk, ragged with an empty-row sequence
    (2, 24, 70, 4, 1, 64, True, jnp.bfloat16, [70, 9]),
    # G=2, full, float16, head_dim 128, no lengths (Tk not a tile multiple)
    (1, 33, 90, 2, 1, 128, False, jnp.float16, None),
])
def test_vjp_in_cpu_interpreter_matches_reference(b, tq, tk, hq, hkv, d, causal, dtype, lengths):
    q, k, v, do, dlse, lens = _case(b * 10 + tq + tk + d, b, tq, tk, hq, hkv, d, dtype, lengths)
    n = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    (out, lse), vjp = jax.vjp(lambda q, k, v: flash_attention_mgpu_vjp(
        q, k, v, causal=causal, kv_lengths=n, block_kv=64, bwd_tiles={"block_kv_dq": 64},
        interpret=True), q, k, v)
    got = vjp((do, dlse))
    ro, rl, *want = np_attention_grads(*(np.asarray(x, np.float32) for x in (q, k, v, do)),
                                       dlse, lens, causal, 1.0 / np.sqrt(d))
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    assert np.linalg.norm(np.asarray(out, np.float64) - ro) < tol * np.linalg.norm(ro)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(rl))
    _check_grads(got, want, lens, tol)


# ---------------------------------------------------------------------------- GPU

@functools.partial(jax.jit, static_argnames=("shape_q", "shape_kv", "dtype"))
def _gpu_case(seed, lens, shape_q, shape_kv, dtype):
    """Operands and cotangents drawn on the device; keys and values past each length NaN."""
    kq, kk, kv, ko, kl = jax.random.split(jax.random.PRNGKey(seed), 5)
    past = jnp.arange(shape_kv[1])[None, :, None, None] >= lens[:, None, None, None]
    q, do = (jax.random.normal(x, shape_q, jnp.float32).astype(dtype) for x in (kq, ko))
    k, v = (jnp.where(past, jnp.nan, jax.random.normal(x, shape_kv, jnp.float32)).astype(dtype)
            for x in (kk, kv))
    return q, k, v, do, jax.random.normal(kl, shape_q[:3], jnp.float32)


@functools.partial(jax.jit, static_argnames=("causal", "ragged", "impl"))
def _grads(q, k, v, do, dlse, lens, causal, ragged, impl):
    n = lens if ragged else None
    if impl in ("ours", "ours_split"):
        tiles = {"split_dkv_columns": impl == "ours_split"}
        f = lambda q, k, v: flash_attention_mgpu_vjp(q, k, v, causal=causal, kv_lengths=n,  # noqa: E731
                                                     bwd_tiles=tiles)
    elif impl == "reference":
        f = lambda q, k, v: reference.attention(  # noqa: E731
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=causal, kv_lengths=n)
    else:
        f = lambda q, k, v: (jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation="cudnn"), jnp.zeros(q.shape[:3]))
    _, vjp = jax.vjp(f, q, k, v)
    return vjp((do.astype(jnp.float32) if impl == "reference" else do, dlse))


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,hq,hkv,d,causal,dtype,ragged", [
    (2, 4096, 32, 8, 128, True, jnp.bfloat16, False),
    (4, 2048, 16, 2, 128, False, jnp.float16, True),
    (4, 4096, 16, 16, 64, True, jnp.bfloat16, True),
    (2, 4096, 16, 2, 256, True, jnp.bfloat16, False)])
def test_gpu_grads_match_reference_and_cudnn(b, t, hq, hkv, d, causal, dtype, ragged):
    lengths = np.full((b,), t)
    if ragged:   # one full sequence, the others cut anywhere
        lengths[1:] = np.random.default_rng(b * t + d).integers(1, t + 1, size=b - 1)
    lens = jnp.asarray(lengths, jnp.int32)
    q, k, v, do, dlse = _gpu_case(b + t + d, lens, (b, t, hq, d), (b, t, hkv, d), dtype)
    got = _grads(q, k, v, do, dlse, lens, causal, ragged, "ours")
    want = _grads(q, k, v, do, dlse, lens, causal, ragged, "reference")
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and not bool(jnp.isnan(g).any()), name
        rel = float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
        assert rel < tol, (name, rel)
    if not ragged:   # cuDNN's causal mask is top-left: the same only without lengths (Tq = Tk)
        zero = jnp.zeros_like(dlse)
        ours = _grads(q, k, v, do, zero, lens, causal, False, "ours")
        cud = _grads(q, k, v, do, zero, lens, causal, False, "cudnn")
        for name, g, c in zip(("dq", "dk", "dv"), ours, cud):
            g32, c32 = g.astype(jnp.float32), c.astype(jnp.float32)
            rel = float(jnp.linalg.norm(g32 - c32) / jnp.linalg.norm(c32))
            assert rel < 2 * tol, (name, rel)


@pytest.mark.gpu
def test_gpu_split_dkv_columns_matches_default_and_reference():
    """The split dK/dV kernel at the width it is for (B=2, T=2048, Hq=16, Hkv=4, D=256, causal,
    ragged, where it is the default): its dK/dV agree with the unsplit kernel's (the same
    products, another schedule)
    and both with the reference; dQ comes from the same kernel either way."""
    b, t, hq, hkv, d, dtype = 2, 2048, 16, 4, 256, jnp.bfloat16
    lens = jnp.asarray([t, 1357], jnp.int32)
    q, k, v, do, dlse = _gpu_case(7, lens, (b, t, hq, d), (b, t, hkv, d), dtype)
    split = _grads(q, k, v, do, dlse, lens, True, True, "ours_split")
    default = _grads(q, k, v, do, dlse, lens, True, True, "ours")
    want = _grads(q, k, v, do, dlse, lens, True, True, "reference")
    for name, g, g0, w in zip(("dq", "dk", "dv"), split, default, want):
        assert g.dtype == dtype and not bool(jnp.isnan(g).any()), name
        g32, g0_32 = g.astype(jnp.float32), g0.astype(jnp.float32)
        assert float(jnp.linalg.norm(g32 - w) / jnp.linalg.norm(w)) < 2e-2, name
        assert float(jnp.linalg.norm(g32 - g0_32) / jnp.linalg.norm(g0_32)) < 1e-2, name
        if name != "dq":
            assert not bool(jnp.any(g[1, 1357:] != 0)), name
