"""One-launch merge of split partial states (interpret mode on the CPU, the real kernel with
marker ``gpu``), against a float64 NumPy merge."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda
from pallas_kernels.merge_splits import merge_splits, supported


def _np_merge(o, lse):
    """float64 merge of ``o [n, R, D]``, ``lse [n, R]`` with the empty-part and NaN rules."""
    n, rows, d = o.shape
    out = np.zeros((rows, d))
    out_lse = np.full((rows,), -np.inf)
    for r in range(rows):
        live = [i for i in range(n) if not lse[i, r] == -np.inf]
        if not live:
            continue
        ls = np.array([lse[i, r] for i in live])
        if np.isnan(ls).any():
            out[r], out_lse[r] = np.nan, np.nan
            continue
        m = ls.max()
        w = np.exp(ls - m)
        out[r] = sum(wi * o[i, r] for wi, i in zip(w, live)) / w.sum()
        out_lse[r] = m + np.log(w.sum())
    return out, out_lse


def _case(seed, n, rows, d):
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((n, rows, d))
    lse = rng.standard_normal((n, rows)) * 4
    empty = rng.random((n, rows)) < 0.3
    lse[empty] = -np.inf
    o[empty] = np.nan                 # an empty part's output must not leak into the row
    lse[:, 1] = -np.inf               # a row with no part: out 0, lse -inf
    if rows > 3:
        lse[0, 2] = np.nan            # a NaN lse: the row is NaN
        lse[n - 1, 3] = 0.5           # a live part with a NaN output: that element is NaN
        o[n - 1, 3, 0] = np.nan
    return o, lse


def _check(n, rows, d, out_dtype, *, interpret):
    o, lse = _case(n * 1000 + rows + d, n, rows, d)
    want_o, want_lse = _np_merge(o, lse)
    got_o, got_lse = merge_splits(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32),
                                  out_dtype=out_dtype, interpret=interpret)
    assert got_o.shape == (rows, d) and got_o.dtype == out_dtype
    assert got_lse.shape == (rows,) and got_lse.dtype == jnp.float32
    got_o, got_lse = np.asarray(got_o, np.float64), np.asarray(got_lse, np.float64)
    np.testing.assert_array_equal(np.isnan(got_o), np.isnan(want_o))
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_array_equal(got_lse == -np.inf, want_lse == -np.inf)
    assert (got_o[1] == 0).all() and got_lse[1] == -np.inf
    ok = ~np.isnan(want_o)
    tol = 1e-5 if out_dtype == jnp.float32 else 2e-2
    scale = np.abs(want_o[ok]).max()
    assert np.abs(got_o[ok] - want_o[ok]).max() <= tol * scale
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,rows,d,out_dtype", [(1, 8, 16, jnp.float32), (3, 40, 32, jnp.bfloat16),
                                                (17, 24, 16, jnp.float32), (64, 20, 16, jnp.bfloat16)])
def test_matches_float64(n, rows, d, out_dtype):
    _check(n, rows, d, out_dtype, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows,d,out_dtype", [(2, 8, 128, jnp.bfloat16), (17, 256, 128, jnp.float32),
                                                (64, 8, 128, jnp.bfloat16), (64, 4096, 64, jnp.float16)])
def test_gpu_matches_float64(n, rows, d, out_dtype):
    _check(n, rows, d, out_dtype, interpret=False)


@pytest.mark.parametrize("n,rows,d", [(64, 8, 128), (17, 256, 128), (2, 4096, 64)])
def test_lowers_for_cuda(n, rows, d):
    s = jax.ShapeDtypeStruct
    txt = lower_for_cuda(lambda o, l: merge_splits(o, l, out_dtype=jnp.bfloat16),
                         s((n, rows, d), jnp.float32), s((n, rows), jnp.float32))
    assert "merge_splits" in txt and "triton" in txt


def test_limits():
    assert supported(parts=64, head_dim=128) is None
    assert "parts" in supported(parts=0, head_dim=128)
    assert "head_dim" in supported(parts=4, head_dim=96)
    with pytest.raises(ValueError, match="lse_nr"):
        merge_splits(jnp.zeros((2, 4, 16)), jnp.zeros((2, 5)), out_dtype=jnp.float32)
