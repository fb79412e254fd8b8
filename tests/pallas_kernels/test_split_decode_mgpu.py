"""One-launch shared-prefix decode with the SMs split by role (``pallas_kernels.split_decode_mgpu``)
and the planner's ``mgpu_split`` leaf (its region and its role split, ``leaf_plans.plan_roles``).

CPU: validation; the kernel traced and lowered for CUDA (Mosaic GPU layout inference and the
shared-memory budget of both roles; no PTX is compiled); Mosaic GPU's interpreter against
float64 NumPy; where the planner takes the leaf; the leaf (forced by a plan) against the
concatenation oracle.  GPU (marker ``gpu``): against float64 NumPy with a ragged prefix length,
random suffix lengths (0, 1 and the capacity included), NaN in the suffix cache past them,
several rounds of prefix and stream tasks, and padding tasks.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import forced_plan, lower_for_cuda
from jax_prefix_attn import DeviceInfo, device_info, plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H100_PCIE, H100_SXM
from jax_prefix_attn.leaf_plans import choose_splits, plan_roles, split_region
from jax_prefix_attn.plans import Shapes
from pallas_kernels import split_decode_mgpu as sd
from pallas_kernels import suffix_stream_mgpu as ss
from pallas_kernels._common import merge_row_parts, rows_128
from helpers import check, make_case, oracle

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
HOPPER_SMEM = H100_SXM.smem_per_block


def _split_decode(q_bhd, pk, pv, p_len, sk, sv, s_len, *, interpret=False, **kw):
    """Decode attention of ``q_bhd [B, Hq, D]`` through ``split_decode_partials_mgpu``
    (``**kw``: its static options; Hopper's shared memory unless ``smem_bytes``) and one XLA
    merge of the two partial sets: ``(out [B, Hq, D], lse [B, Hq])``."""
    b, hq, d = q_bhd.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = rows_128(q_bhd[:, None], hkv, g)
    (o_pre, l_pre), (o_s, l_s) = sd.split_decode_partials_mgpu(
        qm, pk, pv, p_len, sk, sv, s_len, scale=d ** -0.5, group=g, interpret=interpret,
        **{"smem_bytes": HOPPER_SMEM, **kw})
    out, lse = merge_row_parts([(o_pre, l_pre, g), (o_s, l_s, g)], b=b, tq=1, hq=hq, r=g,
                               dtype=q_bhd.dtype, inv=None)
    return out[:, 0], lse[:, 0]


def test_validation():
    q = jnp.zeros((2, 128, 64), BF)          # [Hkv, M, D]
    pkv = jnp.zeros((256, 2, 64), BF)
    skv = jnp.zeros((10, 128, 2, 64), BF)
    pl_, sl = jnp.array([256], jnp.int32), jnp.zeros((10,), jnp.int32)
    call = lambda **kw: sd.split_decode_partials_mgpu(  # noqa: E731
        kw.pop("q", q), kw.pop("pk", pkv), pkv, pl_, kw.pop("sk", skv), skv, sl, scale=1.0,
        group=kw.pop("group", 4), **{"prefix_ctas": 2, "stream_ctas": 1, "num_splits": 1,
                                     "smem_bytes": HOPPER_SMEM, **kw})
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
    with pytest.raises(ValueError, match="stream_stages"):
        call(stream_stages=1, smem_bytes=32 * 1024)   # not even one stage fits that budget
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
    ok = dict(batch=10, heads_q=8, heads_kv=2, prefix_len=256, suffix_cap=128, head_dim=64,
              dtype=BF, smem_bytes=HOPPER_SMEM)
    assert sd.split_supported(**ok) is None
    assert "heads_q" in sd.split_supported(**{**ok, "heads_q": 6, "heads_kv": 4})
    assert "multiple" in sd.split_supported(**{**ok, "prefix_len": 200})
    assert "shared memory" in sd.split_supported(**{**ok, "head_dim": 128, "smem_bytes": 101376})


@pytest.mark.parametrize("b,hq,hkv,p,s,n,m", [(512, 32, 8, 8192, 128, 104, 28),
                                              (1024, 8, 1, 4096, 256, 100, 32),
                                              (40, 32, 2, 1024, 64, 3, 2)])
def test_lowers_for_cuda_on_cpu(b, hq, hkv, p, s, n, m):
    """(prefix splits: ``choose_splits`` for the prefix role's ``n`` SMs)"""
    splits = choose_splits(p // 128, hkv * -(-b * (hq // hkv) // 128), n)
    txt = lower_for_cuda(
        lambda q, pk, pv, pl_, sk, sv, sl: _split_decode(
            q, pk, pv, pl_, sk, sv, sl, prefix_ctas=n, stream_ctas=m, num_splits=splits),
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
    with random suffix lengths (the capacity, 1 and 0 included) and NaN in the cache past them.
    ``kw``: the kernel's options (one prefix split unless ``num_splits``)."""
    rng = np.random.default_rng(b + p)
    f = lambda *sh: jnp.asarray(rng.standard_normal(sh, np.float32), BF)  # noqa: E731
    q, pk, pv, sk, sv = f(b, hq, d), f(p, hkv, d), f(p, hkv, d), f(b, s, hkv, d), f(b, s, hkv, d)
    sl = rng.integers(0, s + 1, b)
    sl[0], sl[-1], sl[1] = s, 0, 1
    past = jnp.asarray(np.arange(s)[None, :, None, None] >= sl[:, None, None, None])
    nan = lambda x: jnp.where(past, jnp.nan, x).astype(x.dtype)  # noqa: E731

    def fn(q, pk, pv, sk, sv, sl):
        return _split_decode(q, pk, pv, jnp.array([plen], jnp.int32), sk, sv, sl,
                             interpret=interpret, **{"num_splits": 1, **kw})
    o, lse = jax.jit(fn)(q, pk, pv, nan(sk), nan(sv), jnp.asarray(sl, jnp.int32))
    o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
    ref_o, ref_l = _oracle(q, pk, pv, plen, sk, sv, sl)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o) < 2e-2
    assert np.abs(lse - ref_l).max() < 2e-2


# Mosaic GPU's CPU interpreter (simulated warpgroups, barriers, TMA, wgmma), 15-25 s a case.
@pytest.mark.parametrize("b,hq,hkv,d,p,plen,s,kw", [
    # G=4: 2 prefix CTAs over 4 tasks (2 rounds, ragged prefix), 1 stream CTA (3 workers, 1 task)
    (10, 8, 2, 64, 256, 200, 128, dict(prefix_ctas=2, stream_ctas=1, num_splits=2,
                                        stream_stages=2)),
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
    (160, 32, 8, 128, 2048, 2048, 128, dict(prefix_ctas=50, stream_ctas=32, num_splits=2)),
    (70, 32, 8, 128, 1024, 1000, 128, dict(prefix_ctas=7, stream_ctas=3, stream_wgs=2)),
])
def test_gpu_matches_float64(b, hq, hkv, d, p, plen, s, kw):
    _check(b, hq, hkv, d, p, plen, s, **kw)


# --------------------------------------------------------------------------- the planner

def _shapes(b, hq, hkv, p, s, d=128):
    return Shapes(b, 1, hq, hkv, d, 1, p, s, "bfloat16")


def _plan(b, hq, hkv, p, s, d=128, device=H100_SXM, **kw):
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                              prefix_len=p, suffix_len=s, dtype=BF, device=device, **kw)


def test_split_plan_follows_the_measured_rule():
    """The planner takes the role split (first in its Mosaic GPU tree) only in its region: G = 4,
    B * G >= 2048, D = 128, prefix 4K-8K with suffix 64-256 or prefix 16K with suffix 128-256;
    with ``plan_roles``'s CTAs (the fastest measured settings on 132 SMs); a plan forces it
    wherever the kernel applies."""
    def roles(*a, **kw):
        plan = _plan(*a, impl="shared", **kw)
        assert plan.path == "mgpu_split", a
        leaf = plan.chunks[0].leaf
        return leaf.prefix_ctas, leaf.stream_ctas, leaf.num_splits
    assert roles(512, 32, 8, 8192, 128) == (103, 29, 4)
    assert roles(1024, 32, 8, 16384, 256) == (103, 29, 2)
    assert roles(1024, 32, 8, 4096, 128) == (86, 46, 1)
    assert roles(1024, 32, 8, 4096, 256) == (64, 68, 1)
    assert roles(1024, 32, 8, 4096, 64) == (103, 29, 2)
    assert _plan(512, 32, 8, 8192, 128).chunks[0].leaf.smem_bytes == HOPPER_SMEM
    for args in [(1024, 32, 8, 16384, 64), (256, 32, 8, 4096, 128), (256, 32, 8, 16384, 256),
                 (1024, 8, 1, 16384, 256), (1024, 8, 1, 4096, 64), (1024, 32, 8, 1024, 128),
                 (1024, 32, 8, 4096, 1024), (1024, 64, 8, 4096, 128)]:
        assert not split_region(_shapes(*args), H100_SXM), args
        assert _plan(*args, impl="shared").path != "mgpu_split", args
    assert _plan(256, 32, 8, 4096, 128, path="mgpu_split").path == "mgpu_split"
    with pytest.raises(ValueError, match="mgpu_split"):
        _plan(1024, 32, 8, 4000, 128, path="mgpu_split")          # prefix not a multiple of 128
    with pytest.raises(ValueError, match="head_dim"):
        _plan(1024, 32, 8, 4096, 128, d=96, path="mgpu_split")
    a100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
    assert _plan(512, 32, 8, 8192, 128, impl="shared", device=a100).path.startswith("triton")
    # an H100 PCIe (114 SMs): the same region, a different split of its SMs
    assert roles(512, 32, 8, 8192, 128, device=H100_PCIE) == (86, 28, 2)
    assert roles(1024, 32, 8, 4096, 128, device=H100_PCIE) == (74, 40, 2)


@pytest.mark.parametrize("sms", [H100_SXM.sm_count, H100_PCIE.sm_count, 4])
def test_plan_roles_bounds(sms):
    """``plan_roles``: at least one CTA of each role, together at most the SMs, at most the
    tasks of each role, prefix splits dividing the 128-key tiles."""
    for b, hq, hkv, p, s in [(36, 8, 2, 256, 64), (1, 1, 1, 128, 64), (4096, 32, 8, 16384, 1024),
                             (512, 32, 8, 8192, 128)]:
        n, splits, m = plan_roles(_shapes(b, hq, hkv, p, s), sms)
        g = hq // hkv
        tasks = hkv * -(-b * g // 128) * splits
        assert 1 <= n <= tasks and 1 <= m and n + m <= sms and (p // 128) % splits == 0
        assert m <= -(-b * g // ss.cols_for(g)) * hkv


def _shared_path(b, hq, hkv, d, p, s, seed, interpret):
    """The whole shared path through the ``mgpu_split`` leaf (forced by a plan; in interpret
    mode its roles share 4 simulated SMs) against the concatenation oracle."""
    sl = np.random.default_rng(seed).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(seed, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=BF,
                               suffix_lengths=sl)
    plan = forced_plan(args[0], args[1], args[3], "mgpu_split",
                       device=H100_SXM if interpret else device_info(), interpret=interpret)
    leaf = plan.chunks[0].leaf
    assert leaf.prefix_ctas + leaf.stream_ctas <= (4 if interpret else device_info().sm_count)
    fn = lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, plan=plan,  # noqa: E731
                                            interpret=interpret)
    out, lse = jax.jit(fn)(*args)
    check(out, lse, oracle(args, kw, meta), BF)


def test_shared_path_split_in_cpu_interpreter():
    _shared_path(20, 8, 2, 64, 256, 64, 13, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(300, 32, 8, 128, 2048, 128), (96, 8, 1, 128, 1024, 256),
                                            (64, 16, 4, 64, 512, 192)])
def test_gpu_shared_path_split(b, hq, hkv, d, p, s):
    _shared_path(b, hq, hkv, d, p, s, 90 + b, interpret=False)


@pytest.mark.gpu
def test_gpu_auto_takes_split_in_region():
    """At a point of the role-split region (Hq=32/Hkv=8 B=512 P=8K S=128, ragged suffixes) the
    default plan on this GPU (the role split) against the two-launch leaf; the concatenation
    oracle is too slow on the host at this size."""
    b, hq, hkv, d, p, s = 512, 32, 8, 128, 8192, 128
    assert _plan(b, hq, hkv, p, s, impl="shared", device=device_info()).path == "mgpu_split"
    sl = np.random.default_rng(5).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, _ = make_case(5, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=BF,
                            suffix_lengths=sl)
    two = forced_plan(args[0], args[1], args[3], "mgpu_two_launch", device=device_info(),
                      interpret=False)
    outs = []
    for plan_kw in (dict(impl="shared"), dict(plan=two)):
        o, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True,
                                                            **plan_kw))(*args)
        outs.append((np.asarray(o.astype(jnp.float32)), np.asarray(lse)))
    (o1, l1), (o2, l2) = outs
    assert np.isfinite(o1).all()
    assert np.linalg.norm(o1 - o2) / np.linalg.norm(o2) < 2e-2
    assert np.abs(l1 - l2).max() < 2e-2
