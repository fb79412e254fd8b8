"""Suffix decode with the fused merge in the queries' own layout (interpret mode on the CPU,
the real kernel with marker ``gpu``), against a float64 NumPy computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.suffix_attention import suffix_decode_merge, suffix_rows


def _np_attend(q, k, v, n, scale):
    """float64 ``(o, lse)`` of one query row ``q [D]`` over keys ``k/v [S, D]`` up to ``n``."""
    if n == 0:
        return np.zeros(q.shape[-1]), -np.inf
    s = (k[:n] @ q) * scale
    m = s.max()
    w = np.exp(s - m)
    return (w @ v[:n]) / w.sum(), m + np.log(w.sum())


def _case(seed, b, hq, hkv, d, s, dtype, n_in, stride_extra=0):
    rng = np.random.default_rng(seed)
    g = hq // hkv
    r = suffix_rows(hq, hkv)
    stride = max(g, 1) + stride_extra
    q = rng.standard_normal((b, hq, d))
    k = rng.standard_normal((b, s, hkv, d))
    v = rng.standard_normal((b, s, hkv, d))
    lens = rng.integers(0, s + 1, size=b)
    lens[0], lens[-1] = 0, s
    for i in range(b):  # a cache may hold anything past a sequence's length: it must not leak
        k[i, lens[i]:] = np.nan
        v[i, lens[i]:] = np.nan
    m_in = (b - 1) * stride + r
    o_in = rng.standard_normal((n_in, hkv, m_in, d))
    lse_in = rng.standard_normal((n_in, hkv, m_in)) * 3
    if n_in:
        lse_in[0, :, :stride] = -np.inf  # sequence 0: first partial empty
        o_in[0, :, :stride] = 0.0
    pos = rng.permutation(b)
    return q, k, v, lens, o_in, lse_in, stride, pos


def _expected(q, k, v, lens, o_in, lse_in, stride, pos, scale):
    b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    out = np.zeros((b, hq, d))
    lse = np.zeros((b, hq))
    for i in range(b):
        for hh in range(hq):
            h, j = hh // g, hh % g
            o_s, l_s = _np_attend(q[i, hh], k[i, :, h], v[i, :, h], lens[i], scale)
            os_, ls_ = [o_s], [l_s]
            for t in range(o_in.shape[0]):
                os_.append(o_in[t, h, pos[i] * stride + j])
                ls_.append(lse_in[t, h, pos[i] * stride + j])
            ls_ = np.array(ls_)
            mx = ls_.max()
            if mx == -np.inf:
                lse[i, hh] = -np.inf
                continue
            w = np.exp(ls_ - mx)
            out[i, hh] = sum(wi * oi for wi, oi in zip(w, os_)) / w.sum()
            lse[i, hh] = mx + np.log(w.sum())
    return out, lse


CASES = [
    (5, 8, 2, 64, 40, jnp.float32, 2, 16),      # G=4: 16-row tile, 12 masked rows
    (3, 32, 1, 64, 33, jnp.float32, 1, 32),     # G=32: tile = the group; S not a multiple of bk
    (4, 6, 2, 128, 20, jnp.bfloat16, 0, 16),    # G=3 (not a power of two), no incoming state
    (6, 16, 8, 64, 64, jnp.bfloat16, 3, 32),    # G=2
]


@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,n_in,bk", CASES)
def test_matches_float64(b, hq, hkv, d, s, dtype, n_in, bk):
    _check(b, hq, hkv, d, s, dtype, n_in, bk, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,n_in,bk", CASES + [
    (40, 32, 8, 128, 300, jnp.bfloat16, 4, 32), (17, 8, 1, 128, 129, jnp.bfloat16, 1, 64)])
def test_gpu_matches_float64(b, hq, hkv, d, s, dtype, n_in, bk):
    _check(b, hq, hkv, d, s, dtype, n_in, bk, gpu=True)


def _check(b, hq, hkv, d, s, dtype, n_in, bk, gpu):
    q, k, v, lens, o_in, lse_in, stride, pos = _case(b * hq + s, b, hq, hkv, d, s, dtype, n_in,
                                                     stride_extra=1 if n_in == 2 else 0)
    scale = d ** -0.5
    to = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    inc = None if n_in == 0 else (jnp.asarray(o_in, jnp.float32), jnp.asarray(lse_in, jnp.float32))
    out, lse = jax.jit(lambda q, k, v, n, p: suffix_decode_merge(
        q, k, v, n, inc, in_stride=stride, position_b=p, scale=scale, block_k=bk,
        interpret=not gpu))(to(q), to(k), to(v), jnp.asarray(lens, jnp.int32),
                            jnp.asarray(pos, jnp.int32))
    assert out.shape == (b, hq, d) and out.dtype == dtype and lse.shape == (b, hq)
    eo, el = _expected(*(np.asarray(to(x), np.float64) for x in (q, k, v)), lens, o_in, lse_in,
                       stride, pos, scale)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(el))
    fin = np.isfinite(el)
    np.testing.assert_allclose(lse[fin], el[fin], atol=1e-4 if dtype == jnp.float32 else 2e-2)
    rel = np.linalg.norm(out - eo) / np.linalg.norm(eo)
    assert rel < (1e-5 if dtype == jnp.float32 else 2e-2), rel
    assert np.all(out[~fin] == 0)


SPAN_CASES = [
    (6, 8, 2, 64, 24, jnp.float32, 16),       # G=4
    (5, 6, 2, 128, 0, jnp.bfloat16, 32),      # G=3, no suffix axis to speak of (S=1 dummy below)
    (9, 32, 8, 128, 40, jnp.bfloat16, 32),    # Llama-3-8B heads
]


@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", SPAN_CASES)
def test_span_and_two_sources_match_float64(b, hq, hkv, d, s, dtype, bk):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", SPAN_CASES + [(300, 32, 8, 128, 200, jnp.bfloat16, 32)])
def test_gpu_span_and_two_sources_match_float64(b, hq, hkv, d, s, dtype, bk):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=True)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", SPAN_CASES[:1] + SPAN_CASES[2:])
def test_split_span_partials_match_float64(b, hq, hkv, d, s, dtype, bk, num_splits):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=False, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [3, 17])
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", [(9, 32, 8, 128, 40, jnp.bfloat16, 64),
                                                   (16, 8, 1, 128, 1000, jnp.bfloat16, 64)])
def test_gpu_split_span_partials_match_float64(b, hq, hkv, d, s, dtype, bk, num_splits):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=True, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", SPAN_CASES[:1] + SPAN_CASES[2:])
def test_one_span_for_all_sequences_matches_float64(b, hq, hkv, d, s, dtype, bk, num_splits):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=False, num_splits=num_splits, one_span=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("b,hq,hkv,d,s,dtype,bk", [(9, 32, 8, 128, 40, jnp.bfloat16, 64),
                                                   (16, 8, 1, 128, 300, jnp.bfloat16, 128)])
def test_gpu_one_span_for_all_sequences_matches_float64(b, hq, hkv, d, s, dtype, bk, num_splits):
    _check_span(b, hq, hkv, d, s, dtype, bk, gpu=True, num_splits=num_splits, one_span=True)


def _check_span(b, hq, hkv, d, s, dtype, bk, gpu, num_splits=1, one_span=False):
    """Pool spans at unaligned starts (some empty, one at the very end of the pool) plus two
    incoming sources in different layouts (one permuted with a wider stride, one in order).

    ``one_span``: the form a single shared prefix takes, every sequence the same span given as
    a ``[1]`` start and a ``[1]`` length (from pool token 3, 123 keys: unaligned to any tile).

    ``num_splits > 1``: no incoming sources; the span's and the suffix's keys are split across
    programs and the float32 partial states merged afterwards (``merge_partials``)."""
    from pallas_kernels._common import merge_partials
    rng = np.random.default_rng(b * 7 + s)
    g = hq // hkv
    r = suffix_rows(hq, hkv)
    s_arr = max(s, 1)
    q = rng.standard_normal((b, hq, d))
    k = rng.standard_normal((b, s_arr, hkv, d))
    v = rng.standard_normal((b, s_arr, hkv, d))
    lens = rng.integers(0, s + 1, size=b)
    lens[1 % b] = 0                                    # a sequence with a span but no suffix
    for i in range(b):
        k[i, lens[i]:] = np.nan
        v[i, lens[i]:] = np.nan
    n_pool = 500
    kp = rng.standard_normal((n_pool, hkv, d))
    vp = rng.standard_normal((n_pool, hkv, d))
    span_len = rng.integers(0, 150, size=b)
    span_len[0] = 0
    span_start = np.array([rng.integers(0, n_pool - n + 1) for n in span_len])
    span_start[-1], span_len[-1] = n_pool - 37, 37      # runs to the last pool token
    if one_span:
        span_start, span_len = np.full(b, 3), np.full(b, 123)
    used = np.zeros(n_pool, bool)
    for a, n in zip(span_start, span_len):
        used[a:a + n] = True
    kp[~used] = np.nan                                 # pool tokens outside every span
    vp[~used] = np.nan
    sources, np_sources = [], []
    for stride, permute in ((g + 3, True), (g, False)) if num_splits == 1 else ():
        m_in = (b - 1) * stride + r
        o_in = rng.standard_normal((2, hkv, m_in, d))
        lse_in = rng.standard_normal((2, hkv, m_in)) * 3
        lse_in[1] = -np.inf                            # an empty split
        pos = rng.permutation(b) if permute else None
        sources.append((jnp.asarray(o_in, jnp.float32), jnp.asarray(lse_in, jnp.float32), stride,
                        None if pos is None else jnp.asarray(pos, jnp.int32)))
        np_sources.append((o_in, lse_in, stride, np.arange(b) if pos is None else pos))
    scale = d ** -0.5
    to = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    st, sn = jnp.asarray(span_start, jnp.int32), jnp.asarray(span_len, jnp.int32)
    if one_span:
        st, sn = jnp.asarray([3], jnp.int32), jnp.asarray([123], jnp.int32)
    out, lse = jax.jit(lambda q, k, v, n, kp, vp, sn, st=st: suffix_decode_merge(
        q, k, v, n, sources or None, span=(kp, vp, st, sn), span_max=150, num_splits=num_splits,
        scale=scale, block_k=bk, interpret=not gpu))(
        to(q), to(k), to(v), jnp.asarray(lens, jnp.int32), to(kp), to(vp), sn)
    if num_splits > 1:
        assert out.shape == (num_splits, b, hq, d) and out.dtype == jnp.float32
        assert lse.shape == (num_splits, b, hq)
        out, lse = merge_partials(out, lse)
    qf, kf, vf, kpf, vpf = (np.asarray(to(x), np.float64) for x in (q, k, v, kp, vp))
    eo = np.zeros((b, hq, d))
    el = np.zeros((b, hq))
    for i in range(b):
        for hh in range(hq):
            h, j = hh // g, hh % g
            sl = slice(span_start[i], span_start[i] + span_len[i])
            kk = np.concatenate([kpf[sl, h], kf[i, :lens[i], h]])  # (NaN only outside these)
            vv = np.concatenate([vpf[sl, h], vf[i, :lens[i], h]])
            o_s, l_s = _np_attend(qf[i, hh], kk, vv, kk.shape[0], scale)
            os_, ls_ = [o_s], [l_s]
            for o_in, lse_in, stride, pos in np_sources:
                for t in range(2):
                    os_.append(o_in[t, h, pos[i] * stride + j])
                    ls_.append(lse_in[t, h, pos[i] * stride + j])
            ls_ = np.array(ls_)
            if ls_.max() == -np.inf:  # (split case: neither span nor suffix keys)
                el[i, hh] = -np.inf
                continue
            w = np.exp(ls_ - ls_.max())
            eo[i, hh] = sum(wi * oi for wi, oi in zip(w, os_)) / w.sum()
            el[i, hh] = ls_.max() + np.log(w.sum())
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    fin = np.isfinite(el)
    assert num_splits > 1 or fin.all()
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert np.all(out[~fin] == 0)
    np.testing.assert_allclose(lse[fin], el[fin], atol=1e-4 if dtype == jnp.float32 else 2e-2)
    rel = np.linalg.norm(out - eo) / np.linalg.norm(eo)
    assert rel < (1e-5 if dtype == jnp.float32 else 2e-2), rel
