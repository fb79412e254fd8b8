"""One-launch shared-prefix decode with the SMs split by role (experimental; see the module
docstring of ``pallas_kernels/split_decode_mgpu.py``).

CPU: validation; the kernel traced and lowered for CUDA (Mosaic GPU layout inference and the
shared-memory budget of both roles; no PTX is compiled); Mosaic GPU's interpreter against
float64 NumPy.  GPU (marker ``gpu``): against float64 NumPy with a ragged prefix length, random
suffix lengths (0, 1 and the capacity included), NaN in the suffix cache past them, several
rounds of prefix and stream tasks, and padding tasks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import split_decode_mgpu as sd
from test_prefix_attention_mgpu import _lower_for_cuda

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


def test_validation():
    q = jnp.zeros((2, 128, 64), BF)          # [Hkv, M, D]
    pkv = jnp.zeros((256, 2, 64), BF)
    skv = jnp.zeros((10, 128, 2, 64), BF)
    pl_, sl = jnp.array([256], jnp.int32), jnp.zeros((10,), jnp.int32)
    call = lambda **kw: sd.split_decode_partials_mgpu(  # noqa: E731
        kw.pop("q", q), kw.pop("pk", pkv), pkv, pl_, kw.pop("sk", skv), skv, sl, scale=1.0,
        group=kw.pop("group", 4), **{"prefix_ctas": 2, "stream_ctas": 1, **kw})
    with pytest.raises(ValueError, match="prefix_ctas"):
        call(prefix_ctas=0)
    with pytest.raises(ValueError, match="prefix_ctas"):
        call(prefix_ctas=5, num_splits=2)     # 2 kv heads x 1 row block x 2 splits = 4 tasks
    with pytest.raises(ValueError, match="stream_ctas"):
        call(stream_ctas=0)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=3)
    with pytest.raises(ValueError, match="stream_stages"):
        call(stream_stages=5)
    with pytest.raises(ValueError, match="stream_wgs"):
        call(stream_wgs=1)
    with pytest.raises(ValueError, match="prefix k/v"):
        call(pk=pkv[:, :1])
    with pytest.raises(ValueError, match="suffix k/v"):
        call(sk=skv[:, :64])
    with pytest.raises(ValueError, match="power of two"):
        call(group=3, q=jnp.zeros((2, 128, 64), BF))
    with pytest.raises(ValueError, match="rows"):
        call(group=16, q=jnp.zeros((2, 128, 64), BF))   # 10 sequences x 16 rows > 128
    with pytest.raises(ValueError, match="heads_q"):
        sd.split_decode_mgpu(jnp.zeros((10, 6, 64), BF), jnp.zeros((256, 4, 64), BF),
                             jnp.zeros((256, 4, 64), BF), pl_, jnp.zeros((10, 128, 4, 64), BF),
                             jnp.zeros((10, 128, 4, 64), BF), sl, prefix_ctas=1, stream_ctas=1)


@pytest.mark.parametrize("b,hq,hkv,p,s,n,m", [(512, 32, 8, 8192, 128, 104, 28),
                                              (1024, 8, 1, 4096, 256, 100, 32),
                                              (40, 32, 2, 1024, 64, 3, 2)])
def test_lowers_for_cuda_on_cpu(b, hq, hkv, p, s, n, m):
    txt = _lower_for_cuda(
        lambda q, pk, pv, pl_, sk, sv, sl: sd.split_decode_mgpu(
            q, pk, pv, pl_, sk, sv, sl, prefix_ctas=n, stream_ctas=m),
        S((b, hq, 128), BF), S((p, hkv, 128), BF), S((p, hkv, 128), BF), S((1,), jnp.int32),
        S((b, s, hkv, 128), BF), S((b, s, hkv, 128), BF), S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


def _oracle(q, pk, pv, plen, sk, sv, sl):
    q, pk, pv, sk, sv = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, pk, pv, sk, sv))
    b, hq, d = q.shape
    g = hq // pk.shape[1]
    out, lse = np.zeros((b, hq, d)), np.zeros((b, hq))
    for i in range(b):
        for h in range(hq):
            k = np.concatenate([pk[:plen, h // g], sk[i, :sl[i], h // g]])
            v = np.concatenate([pv[:plen, h // g], sv[i, :sl[i], h // g]])
            sc = k @ q[i, h] / np.sqrt(d)
            e = np.exp(sc - sc.max())
            out[i, h], lse[i, h] = e @ v / e.sum(), sc.max() + np.log(e.sum())
    return out, lse


def _check(b, hq, hkv, d, p, plen, s, *, interpret=False, **kw):
    """Output and LSE against float64 NumPy over each sequence's ``[prefix[:plen]; suffix[:len]]``,
    with random suffix lengths (the capacity, 1 and 0 included) and NaN in the cache past them."""
    rng = np.random.default_rng(b + p)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), BF)  # noqa: E731
    q, pk, pv, sk, sv = f(b, hq, d), f(p, hkv, d), f(p, hkv, d), f(b, s, hkv, d), f(b, s, hkv, d)
    sl = rng.integers(0, s + 1, b)
    sl[0], sl[-1], sl[1] = s, 0, 1
    past = jnp.asarray(np.arange(s)[None, :, None, None] >= sl[:, None, None, None])
    nan = lambda x: jnp.where(past, jnp.nan, x).astype(x.dtype)  # noqa: E731

    def fn(q, pk, pv, sk, sv, sl):
        return sd.split_decode_mgpu(q, pk, pv, jnp.array([plen], jnp.int32), sk, sv, sl,
                                    return_lse=True, interpret=interpret, **kw)
    o, lse = (fn if interpret else jax.jit(fn))(q, pk, pv, nan(sk), nan(sv),
                                                jnp.asarray(sl, jnp.int32))
    o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
    ref_o, ref_l = _oracle(q, pk, pv, plen, sk, sv, sl)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o) < 2e-2
    assert np.abs(lse - ref_l).max() < 2e-2


# Mosaic GPU's CPU interpreter (simulated warpgroups, barriers, TMA, wgmma), 15-25 s a case.
@pytest.mark.parametrize("b,hq,hkv,d,p,plen,s,kw", [
    # G=4: 2 prefix CTAs over 4 tasks (2 rounds, ragged prefix), 1 stream CTA (3 workers, 1 task)
    (10, 8, 2, 64, 256, 200, 128, dict(prefix_ctas=2, stream_ctas=1, stream_stages=2)),
    # G=1: 16 sequences per task; 3 prefix tasks on 2 CTAs (a CTA idle in round 2); 2 stages
    (20, 1, 1, 64, 384, 384, 64, dict(prefix_ctas=2, stream_ctas=1, num_splits=3)),
    # two stream workers (the third warpgroup idle in the stream CTA), 3 stages
    (12, 8, 2, 64, 256, 256, 128, dict(prefix_ctas=1, stream_ctas=1, stream_wgs=2)),
])
def test_interpreter_matches_float64(b, hq, hkv, d, p, plen, s, kw):
    _check(b, hq, hkv, d, p, plen, s, interpret=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,plen,s,kw", [
    (70, 32, 8, 128, 1024, 1000, 128, dict(prefix_ctas=7, stream_ctas=3)),
    (33, 8, 1, 128, 2048, 2048, 192, dict(prefix_ctas=2, stream_ctas=2, num_splits=4)),
    (29, 4, 2, 64, 512, 300, 256, dict(prefix_ctas=3, stream_ctas=4, num_splits=2, stream_stages=2)),
    (21, 16, 1, 128, 1024, 777, 64, dict(prefix_ctas=4, stream_ctas=2, num_splits=2)),
    (45, 4, 4, 64, 768, 768, 128, dict(prefix_ctas=5, stream_ctas=3, num_splits=2, stream_stages=1)),
    (300, 32, 8, 128, 4096, 4096, 128, dict(prefix_ctas=100, stream_ctas=32, num_splits=2)),
    (70, 32, 8, 128, 1024, 1000, 128, dict(prefix_ctas=7, stream_ctas=3, stream_wgs=2)),
])
def test_gpu_matches_float64(b, hq, hkv, d, p, plen, s, kw):
    _check(b, hq, hkv, d, p, plen, s, **kw)


# --------------------------------------------------------------------------- the shared path

def test_split_plan_follows_the_measured_rule(monkeypatch):
    """``MGPU_MERGE="auto"`` takes the role split only where session 22 measured it faster
    (G = 4, B * G >= 2048, D = 128, prefix 4K-8K with suffix 64-256 or prefix 16K with suffix
    128-256), with ``plan_roles``'s CTAs (the fastest measured settings); ``force`` wherever
    the kernel applies."""
    from pallas_kernels import prefix_attention as pa
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    plan = lambda *a, **kw: pa.split_plan(*a, 128, BF, **kw)  # noqa: E731
    assert plan(512, 32, 8, 8192, 128) == dict(prefix_ctas=103, stream_ctas=29, num_splits=4)
    assert plan(1024, 32, 8, 16384, 256) == dict(prefix_ctas=103, stream_ctas=29, num_splits=2)
    assert plan(1024, 32, 8, 4096, 128) == dict(prefix_ctas=86, stream_ctas=46, num_splits=1)
    assert plan(1024, 32, 8, 4096, 256) == dict(prefix_ctas=64, stream_ctas=68, num_splits=1)
    assert plan(1024, 32, 8, 4096, 64) == dict(prefix_ctas=103, stream_ctas=29, num_splits=2)
    for args in [(1024, 32, 8, 16384, 64), (256, 32, 8, 4096, 128), (256, 32, 8, 16384, 256),
                 (1024, 8, 1, 16384, 256), (1024, 8, 1, 4096, 64), (1024, 32, 8, 1024, 128),
                 (1024, 32, 8, 4096, 1024), (1024, 64, 8, 4096, 128)]:
        assert plan(*args) is None, args
    assert plan(256, 32, 8, 4096, 128, force=True) is not None
    assert plan(1024, 32, 8, 4000, 128, force=True) is None          # prefix not a multiple of 128
    assert pa.split_plan(1024, 32, 8, 4096, 128, 96, BF, force=True) is None   # head_dim 96
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "triton")
    assert plan(512, 32, 8, 8192, 128) is None


def test_plan_roles_bounds():
    for b, hq, hkv, p, s in [(36, 8, 2, 256, 64), (1, 1, 1, 128, 64), (4096, 32, 8, 16384, 1024)]:
        n, splits, m = sd.plan_roles(b, hq, hkv, p, s, 128, sms=132)
        g = hq // hkv
        tasks = hkv * -(-b * g // 128) * splits
        assert 1 <= n <= tasks and 1 <= m and n + m <= 132 and (p // 128) % splits == 0
        assert m <= -(-b * g // max(16, g)) * hkv


def _shared_path(monkeypatch, b, hq, hkv, d, p, s, impl, seed, merge="split"):
    from jax_prefix_attn import shared_prefix_attention
    from pallas_kernels import prefix_attention as pa
    from test_shared_prefix import check, make_case, oracle
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    monkeypatch.setattr(pa, "MGPU_MERGE", merge)
    assert pa.split_plan(b, hq, hkv, p, s, d, BF, interpret=impl != "shared",
                         force=merge == "split") is not None
    sl = np.random.default_rng(seed).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(seed, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=BF,
                               suffix_lengths=sl)
    fn = lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl=impl)  # noqa: E731
    out, lse = (fn if impl != "shared" else jax.jit(fn))(*args)
    check(out, lse, oracle(args, kw, meta), BF)


def test_shared_path_split_in_cpu_interpreter(monkeypatch):
    """``MGPU_MERGE = "split"``: the whole shared path against the concatenation oracle."""
    _shared_path(monkeypatch, 36, 8, 2, 64, 256, 64, "pallas_interpret", 13)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(300, 32, 8, 128, 2048, 128), (96, 8, 1, 128, 1024, 256),
                                            (64, 16, 4, 64, 512, 192)])
def test_gpu_shared_path_split(monkeypatch, b, hq, hkv, d, p, s):
    _shared_path(monkeypatch, b, hq, hkv, d, p, s, "shared", 90 + b)


@pytest.mark.gpu
def test_gpu_auto_takes_split_in_region(monkeypatch):
    """At a point of ``SPLIT_REGIONS`` (Hq=32/Hkv=8 B=512 P=8K S=128, ragged suffixes) the default
    path (the role split) against the two-launch path (``MGPU_MERGE="independent"``); the
    concatenation oracle is too slow on the host at this size."""
    from jax_prefix_attn import shared_prefix_attention
    from pallas_kernels import prefix_attention as pa
    from test_shared_prefix import make_case
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    b, hq, hkv, d, p, s = 512, 32, 8, 128, 8192, 128
    assert pa.split_plan(b, hq, hkv, p, s, d, BF) is not None
    sl = np.random.default_rng(5).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, _ = make_case(5, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=BF,
                            suffix_lengths=sl)
    outs = []
    for merge in ("auto", "independent"):
        monkeypatch.setattr(pa, "MGPU_MERGE", merge)
        o, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True,
                                                            impl="shared"))(*args)
        outs.append((np.asarray(o.astype(jnp.float32)), np.asarray(lse)))
    (o1, l1), (o2, l2) = outs
    assert np.isfinite(o1).all()
    assert np.linalg.norm(o1 - o2) / np.linalg.norm(o2) < 2e-2
    assert np.abs(l1 - l2).max() < 2e-2
