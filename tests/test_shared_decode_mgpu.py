"""The one-launch prefix + suffix decode kernel (``pallas_kernels.shared_decode_mgpu``).

CPU: the task interleaving; the kernel lowered for CUDA; the kernel's prefix and suffix tasks in
Mosaic GPU's CPU interpreter against an independent float64 NumPy computation (suffix caches
poisoned with NaN past each length); the shared path taking it, against the concatenation
oracle.  GPU (marker ``gpu``): the same on the device.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.prefix_attention as pa
from pallas_kernels._common import merge_partials
from pallas_kernels.shared_decode_mgpu import fused_supported, shared_decode_partials_mgpu, task_order


@pytest.mark.parametrize("n_pre,n_suf", [(7, 3), (3, 7), (4, 4), (5, 0), (0, 2)])
@pytest.mark.parametrize("order", ["interleave", "suffix_first", "prefix_first"])
def test_task_order_is_a_bijection(n_pre, n_suf, order):
    seen = set()
    for t in range(n_pre + n_suf):
        is_suf, idx = task_order(jnp.int32(t), n_pre, n_suf, order)
        seen.add((bool(is_suf), int(idx)))
    assert seen == {(False, i) for i in range(n_pre)} | {(True, i) for i in range(n_suf)}
    if order == "interleave" and n_pre and n_suf:   # a suffix task first, then alternating
        assert [bool(task_order(jnp.int32(t), n_pre, n_suf, order)[0]) for t in range(4)][:2] == [True, False]


def test_supported_and_errors():
    bf = jnp.bfloat16
    assert fused_supported(batch=256, heads_q=32, heads_kv=8, prefix_len=4096, suffix_cap=128,
                           head_dim=128, dtype=bf) is None
    assert "power of two" in fused_supported(batch=8, heads_q=12, heads_kv=4, prefix_len=256,
                                             suffix_cap=64, head_dim=64, dtype=bf)
    assert "multiple of block_s" in fused_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                                    suffix_cap=100, head_dim=64, dtype=bf)
    assert "dtype" in fused_supported(batch=8, heads_q=8, heads_kv=2, prefix_len=256,
                                      suffix_cap=64, head_dim=64, dtype=jnp.float32)
    q = jnp.zeros((2, 100, 64), bf)
    k = jnp.zeros((256, 2, 64), bf)
    sk = jnp.zeros((20, 64, 2, 64), bf)
    with pytest.raises(ValueError, match="multiple of 128"):
        shared_decode_partials_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0, group=4)
    q = jnp.zeros((2, 128, 64), bf)
    with pytest.raises(ValueError, match="suffix_splits=3"):
        shared_decode_partials_mgpu(q, k, k, 256, sk, sk, jnp.zeros(20, jnp.int32), scale=1.0,
                                    group=4, suffix_splits=3)


def _case(seed, b, hq, hkv, d, p, s, nan_tail=True):
    g = hq // hkv
    rng = np.random.default_rng(seed)
    m = -(-b * g // 128) * 128
    q = rng.standard_normal((hkv, m, d)).astype(np.float32)
    q[:, b * g:] = 0.0                                   # padding rows
    pk, pv = (rng.standard_normal((p, hkv, d)).astype(np.float32) for _ in range(2))
    sk, sv = (rng.standard_normal((b, s, hkv, d)).astype(np.float32) for _ in range(2))
    sl = rng.integers(0, s + 1, size=b)
    sl[0], sl[-1] = 0, s
    if nan_tail:
        for i in range(b):
            sk[i, sl[i]:] = np.nan
            sv[i, sl[i]:] = np.nan
    as16 = lambda x: jnp.asarray(x, jnp.bfloat16)        # noqa: E731
    return as16(q), as16(pk), as16(pv), as16(sk), as16(sv), sl


def _numpy_states(q, pk, pv, p_len, sk, sv, sl, group, scale):
    """float64 NumPy: each real row's state over the prefix keys [0, p_len) and over its own
    sequence's suffix keys [0, len)."""
    q, pk, pv, sk, sv = (np.asarray(x, np.float64) for x in (q, pk, pv, sk, sv))
    hkv, _, d = q.shape
    b = sk.shape[0]

    def state(qr, keys, vals):                  # qr [r, D], keys/vals [n, D]
        if len(keys) == 0:
            return np.zeros((len(qr), d)), np.full(len(qr), -np.inf)
        sc = qr @ keys.T * scale
        mx = sc.max(axis=1, keepdims=True)
        w = np.exp(sc - mx)
        return w @ vals / w.sum(axis=1, keepdims=True), mx[:, 0] + np.log(w.sum(axis=1))
    out = {}
    for name in ("pre", "suf"):
        o = np.zeros((hkv, b * group, d))
        lse = np.full((hkv, b * group), -np.inf)
        for h in range(hkv):
            if name == "pre":
                o[h], lse[h] = state(q[h, :b * group], pk[:p_len, h], pv[:p_len, h])
                continue
            for i in range(b):
                rows = slice(i * group, (i + 1) * group)
                o[h, rows], lse[h, rows] = state(q[h, rows], sk[i, :sl[i], h], sv[i, :sl[i], h])
        out[name] = (o, lse)
    return out


def _check_states(got, want, b, group):
    for (o, lse), name in zip(got, ("pre", "suf")):
        o, lse = merge_partials(o.astype(jnp.float32), lse)
        o, lse = np.asarray(o)[:, :b * group], np.asarray(lse)[:, :b * group]
        wo, wl = want[name]
        assert not np.isnan(o).any() and not np.isnan(lse).any(), name
        fin = np.isfinite(wl)
        assert (np.isfinite(lse) == fin).all(), name
        assert (o[~fin] == 0).all(), name
        if fin.any():
            rel = np.linalg.norm(o - wo) / np.linalg.norm(wo)
            assert rel < 2e-2, (name, rel)
        np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-2, rtol=1e-3, err_msg=name)


def _run(b, hq, hkv, d, p, p_len, s, splits, ss, order, block_s, interpret, mode="alternate",
         steps=2):
    q, pk, pv, sk, sv, sl = _case(b * 31 + p + s, b, hq, hkv, d, p, s)
    g = hq // hkv
    o_pre, l_pre, o_suf, l_suf = shared_decode_partials_mgpu(
        q, pk, pv, p_len, sk, sv, jnp.asarray(sl, jnp.int32), scale=d ** -0.5, group=g,
        num_splits=splits, suffix_splits=ss, order=order, block_s=block_s, suffix_mode=mode,
        suffix_steps=steps, interpret=interpret, _cpu_check=interpret)
    assert o_suf.shape[0] == (2 * ss if mode == "alternate" else ss)
    want = _numpy_states(q, pk, pv, p_len, sk, sv, sl, g, d ** -0.5)
    _check_states([(o_pre, l_pre), (o_suf, l_suf)], want, b, g)


@pytest.mark.parametrize("d,block_s,steps,mode", [(128, 64, 2, "rows"), (64, 128, 3, "rows"),
                                                  (128, 64, 5, "alternate")])
def test_kernel_lowers_for_cuda(d, block_s, steps, mode):
    """Lowered for CUDA (shared memory checked against Hopper's 227 KB per CTA)."""
    from test_prefix_attention_mgpu import _lower_for_cuda
    S = jax.ShapeDtypeStruct
    b, hq, hkv, p, s = 64, 32, 8, 1024, 256
    txt = _lower_for_cuda(
        lambda q, pk, pv, n, sk, sv, sl: shared_decode_partials_mgpu(
            q, pk, pv, n, sk, sv, sl, scale=d ** -0.5, group=4, suffix_splits=2,
            block_s=block_s, suffix_steps=steps, suffix_mode=mode),
        S((hkv, b * 4, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16), S((p, hkv, d), jnp.bfloat16),
        S((), jnp.int32), S((b, s, hkv, d), jnp.bfloat16), S((b, s, hkv, d), jnp.bfloat16),
        S((b,), jnp.int32))
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,ss,order,block_s,mode", [
    (40, 8, 2, 64, 256, 200, 128, 2, 1, "interleave", 64, "rows"),
    (40, 8, 2, 64, 256, 200, 128, 2, 1, "interleave", 64, "alternate"),
    (20, 8, 1, 128, 256, 256, 128, 1, 2, "suffix_first", 64, "alternate"),  # G = 8, S split in 2
])
def test_kernel_in_cpu_interpreter(b, hq, hkv, d, p, p_len, s, splits, ss, order, block_s, mode):
    _run(b, hq, hkv, d, p, p_len, s, splits, ss, order, block_s, interpret=True, mode=mode)


def test_shared_path_one_launch_in_cpu_interpreter(monkeypatch):
    """``MGPU_MERGE = "one_launch"``: the whole shared path against the concatenation oracle."""
    from jax_prefix_attn import shared_prefix_attention
    from test_shared_prefix import check, make_case, oracle
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    monkeypatch.setattr(pa, "MGPU_MERGE", "one_launch")
    b, hq, hkv, d, p, s = 36, 8, 2, 64, 256, 64
    assert pa.one_launch_plan(b, hq, hkv, p, s, d, jnp.bfloat16, interpret=True, force=True) is not None
    assert pa.one_launch_plan(b, hq, hkv, p, s, d, jnp.bfloat16, interpret=True) is None  # S < 128
    args, kw, meta = make_case(11, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s, dtype=jnp.bfloat16,
                               suffix_lengths=[0, s] + [5] * (b - 2))
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, impl="pallas_interpret")
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,p_len,s,splits,ss,order,block_s,mode,steps", [
    (256, 32, 8, 128, 4096, 4000, 128, None, 1, "interleave", 64, "rows", 2),
    (256, 32, 8, 128, 4096, 4000, 128, 1, 1, "interleave", 64, "alternate", 5),
    (100, 32, 8, 128, 1024, 1024, 256, 2, 2, "suffix_first", 64, "alternate", 4),
    (300, 8, 1, 128, 2048, 1500, 128, None, 1, "prefix_first", 64, "alternate", 2),
    (64, 16, 4, 64, 512, 0, 256, 1, 1, "interleave", 128, "rows", 2),  # D = 64: 128-key tiles
])
def test_gpu_kernel(b, hq, hkv, d, p, p_len, s, splits, ss, order, block_s, mode, steps):
    _run(b, hq, hkv, d, p, p_len, s, splits, ss, order, block_s, interpret=False, mode=mode,
         steps=steps)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hq,hkv,d,p,s", [(256, 32, 8, 128, 4096, 128), (96, 8, 1, 128, 1024, 512)])
def test_gpu_shared_path_one_launch(monkeypatch, b, hq, hkv, d, p, s):
    from jax_prefix_attn import shared_prefix_attention
    from test_shared_prefix import check, make_case, oracle
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    monkeypatch.setattr(pa, "MGPU_MERGE", "one_launch")
    assert pa.one_launch_plan(b, hq, hkv, p, s, d, jnp.bfloat16, force=True) is not None
    sl = np.random.default_rng(b).integers(0, s + 1, size=b)
    sl[:2] = [0, s]
    args, kw, meta = make_case(70 + b, b=b, tq=1, hq=hq, hkv=hkv, d=d, g=0, p=p, s=s,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl="shared"))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


def test_one_launch_plan_follows_the_measured_rule(monkeypatch):
    """``MGPU_MERGE="auto"`` takes the one launch only where it was measured faster (prefix 4K,
    suffix capacity 128-256, G >= 4; prefix 16K, suffix 1024, G >= 8; >= 64 prefix CTAs);
    ``force`` takes it wherever the kernel applies."""
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "mgpu")
    bf = jnp.bfloat16
    plan = pa.one_launch_plan(256, 32, 8, 4096, 128, 128, bf)
    assert plan is not None and plan["num_splits"] == 1 and plan["suffix_mode"] == "rows"
    assert plan["suffix_steps"] == 2                       # 4 x 16 KB tiles per stage at D=128
    assert pa.one_launch_plan(1024, 8, 1, 4096, 256, 128, bf) is not None
    assert pa.one_launch_plan(1024, 8, 1, 16384, 1024, 128, bf)["num_splits"] == 1
    for args in [(512, 32, 8, 8192, 128), (256, 32, 8, 4096, 64), (256, 32, 8, 4096, 1024),
                 (1024, 8, 1, 16384, 256), (1024, 32, 8, 16384, 1024), (256, 8, 1, 16384, 1024),
                 (256, 32, 8, 2048, 128), (256, 8, 1, 4096, 256), (1024, 16, 8, 4096, 128)]:
        b, hq, hkv, p, s = args
        assert pa.one_launch_plan(b, hq, hkv, p, s, 128, bf) is None, args
    assert pa.one_launch_plan(256, 32, 8, 4096, 1024, 128, bf, force=True) is not None
    assert pa.one_launch_plan(256, 16, 8, 4096, 128, 128, bf, force=True) is None  # G = 2
    monkeypatch.setattr(pa, "PREFIX_BACKEND", "triton")
    assert pa.one_launch_plan(256, 32, 8, 4096, 128, 128, bf, force=True) is None
