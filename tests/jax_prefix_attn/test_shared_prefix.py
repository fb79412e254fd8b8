"""shared_prefix_attention: parity with reference.attention on the explicit concatenation,
gradients, validation; kernel paths in interpret mode (CPU) and compiled (GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses

from jax_prefix_attn import plan_shared_prefix, reference, shared_prefix_attention
from jax_prefix_attn.device import H100_SXM
from jax_prefix_attn.executor import run_plan
from jax_prefix_attn.leaves.base import query_chunks
from helpers import TOL, check, make_case, oracle, ref_attention_jit, rel_err

# test names of the kernel paths in interpret mode -> shared_prefix_attention's arguments
IMPL_KW = {"reference": dict(impl="reference"), "pallas_interpret": dict(impl="shared", interpret=True),
           "flat_interpret": dict(impl="flat", interpret=True)}


# --------------------------------------------------------------------------- reference path

@pytest.mark.parametrize("tq", [1, 4])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("g", [0, 3])
def test_reference_matches_concatenation(tq, hq, hkv, g):
    args, kw, meta = make_case(10 * tq + hq + g, b=5, tq=tq, hq=hq, hkv=hkv, g=g,
                               suffix_lengths=[0, 9, 3, 1, 5])
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, impl="reference")
    check(out, lse, oracle(args, kw, meta), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_reference_dtypes_head_dims(dtype, d):
    args, kw, meta = make_case(3, b=2, tq=2, hq=4, hkv=2, d=d, p=12, s=5, dtype=dtype)
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, impl="reference")
    assert out.dtype == dtype and lse.dtype == jnp.float32
    check(out, lse, oracle(args, kw, meta), dtype)


def test_auto_on_cpu_and_default_return():
    args, kw, meta = make_case(4, g=2, tq=3)
    out = shared_prefix_attention(*args, **kw)
    assert out.shape == args[0].shape
    check(out, shared_prefix_attention(*args, **kw, return_lse=True)[1], oracle(args, kw, meta),
          jnp.float32)


def test_reference_jit_dynamic_lengths_no_recompile():
    args, kw, meta = make_case(5, b=3, tq=1, g=2)
    traces = []

    @jax.jit
    def f(q, pk, pv, sk, sv, sl, plen, s2p):
        traces.append(1)
        return shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, prefix_lengths=plen,
                                       seq_to_prefix=s2p, return_lse=True, impl="reference")
    for sl in ([0, 1, 2], [9, 9, 9], [4, 0, 7]):
        kw2 = dict(kw, suffix_lengths=jnp.asarray(sl, jnp.int32))
        out, lse = f(*args, kw2["suffix_lengths"], kw2["prefix_lengths"], kw2["seq_to_prefix"])
        check(out, lse, oracle(args, kw2, meta), jnp.float32)
    assert len(traces) == 1


def _grad_check(impl, **case):
    case = {**dict(b=3, tq=2, hq=4, hkv=2, d=16, g=2, p=10, s=6, suffix_lengths=[0, 6, 3],
                   prefix_lengths=[7, 10]), **case}
    args, kw, meta = make_case(6, **case)
    q, pk, pv, sk, sv = args
    plen, s2p = meta
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape, np.float32))

    def ours(q, pk, pv, sk, sv):
        out, lse = shared_prefix_attention(q, pk, pv, sk, sv, **kw, return_lse=True,
                                           **IMPL_KW[impl])
        return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    # Oracle: reference.attention over the concatenation built with differentiable gathers.
    sl = kw["suffix_lengths"]
    p = pk.shape[-3]
    s = sk.shape[1]
    j = jnp.arange(p + s)
    pl_b = jnp.asarray(plen)[jnp.asarray(s2p)]

    def concat(pre, suf):
        pre = pre if pre.ndim == 4 else pre[None]  # (one prefix given as [P, H, D])
        pre_b = pre[jnp.asarray(s2p)]  # [B, P, H, D]
        from_pre = j[None, :] < pl_b[:, None]
        si = jnp.clip(j[None, :] - pl_b[:, None], 0, s - 1)
        suf_g = jnp.take_along_axis(suf, si[:, :, None, None], axis=1)
        pi = jnp.clip(j, 0, p - 1)
        pre_g = pre_b[:, pi]
        return jnp.where(from_pre[:, :, None, None], pre_g, suf_g)

    def theirs(q, pk, pv, sk, sv):
        out, lse = reference.attention(q, concat(pk, sk), concat(pv, sv), causal=True,
                                       kv_lengths=pl_b + sl)
        return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g1 = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3, 4)))(*args)
    g2 = jax.jit(jax.grad(theirs, argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b_ in zip(g1, g2):
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, b_) < 1e-5, rel_err(a, b_)


def test_reference_gradients():
    _grad_check("reference")


# --------------------------------------------------------------------------- validation

def _base():
    args, kw, _ = make_case(7, b=2, tq=1, hq=4, hkv=2, g=2)
    return list(args), kw


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a, k: a.__setitem__(0, a[0][:, :, :3]), ValueError, "heads_q"),
    (lambda a, k: a.__setitem__(3, a[3][:1]), ValueError, "suffix_k"),
    (lambda a, k: a.__setitem__(4, a[4][:, :4]), ValueError, "suffix_k and suffix_v"),
    (lambda a, k: a.__setitem__(2, a[2][:, :5]), ValueError, "prefix_k and prefix_v"),
    (lambda a, k: a.__setitem__(1, a[1][..., :8]), ValueError, "prefix_k"),
    (lambda a, k: a.__setitem__(1, a[1].astype(jnp.bfloat16)), TypeError, "prefix_k"),
    (lambda a, k: a.__setitem__(3, a[3].astype(jnp.int32)), TypeError, "suffix_k"),
    (lambda a, k: k.__setitem__("seq_to_prefix", jnp.array([0, 2], jnp.int32)), ValueError, "seq_to_prefix"),
    (lambda a, k: k.__setitem__("seq_to_prefix", jnp.array([0, -1], jnp.int32)), ValueError, "seq_to_prefix"),
    (lambda a, k: k.__setitem__("seq_to_prefix", jnp.array([0.0, 1.0])), TypeError, "seq_to_prefix"),
    (lambda a, k: k.__setitem__("seq_to_prefix", jnp.array([0, 1, 1], jnp.int32)), ValueError, "seq_to_prefix"),
    (lambda a, k: k.pop("seq_to_prefix"), ValueError, "seq_to_prefix"),
    (lambda a, k: k.__setitem__("suffix_lengths", jnp.array([1, 99], jnp.int32)), ValueError, "suffix_lengths"),
    (lambda a, k: k.__setitem__("suffix_lengths", jnp.array([1], jnp.int32)), ValueError, "suffix_lengths"),
    (lambda a, k: k.__setitem__("prefix_lengths", jnp.array([1, 21], jnp.int32)), ValueError, "prefix_lengths"),
    (lambda a, k: k.__setitem__("prefix_lengths", jnp.array([1, 2, 3], jnp.int32)), ValueError, "prefix_lengths"),
    (lambda a, k: k.__setitem__("sm_scale", -1.0), ValueError, "sm_scale"),
    (lambda a, k: k.__setitem__("impl", "fast"), ValueError, "impl"),
    (lambda a, k: k.__setitem__("return_lse", 1), TypeError, "return_lse"),
    (lambda a, k: k.__setitem__("interpret", 1), TypeError, "interpret"),
    (lambda a, k: k.__setitem__("impl", "pallas_interpret"), ValueError, "impl"),
    (lambda a, k: k.__setitem__("plan", "shared"), TypeError, "plan"),
    (lambda a, k: a.__setitem__(0, a[0][0]), ValueError, "q"),
])
def test_validation_errors(mutate, exc, match):
    a, k = _base()
    mutate(a, k)
    with pytest.raises(exc, match=match):
        shared_prefix_attention(*a, **k)


def test_seq_to_prefix_traced_is_accepted():
    args, kw, meta = make_case(8, b=2, g=2)
    f = jax.jit(lambda s2p: shared_prefix_attention(*args, **dict(kw, seq_to_prefix=s2p),
                                                    impl="reference"))
    out = f(kw["seq_to_prefix"])
    assert rel_err(out, oracle(args, kw, meta)[0]) < 1e-5


# --------------------------------------------------------------------------- kernel paths (CPU)

@pytest.mark.parametrize("impl", ["pallas_interpret", "flat_interpret"])
@pytest.mark.parametrize("tq,hq,hkv,d,g,dtype", [
    (1, 8, 1, 64, 0, jnp.bfloat16),
    (4, 8, 2, 128, 3, jnp.float32),
])
def test_kernel_paths_interpret(impl, tq, hq, hkv, d, g, dtype):
    args, kw, meta = make_case(20 + tq, b=4, tq=tq, hq=hq, hkv=hkv, d=d, g=g, p=40, s=18,
                               dtype=dtype, suffix_lengths=[0, 18, 3, 9])
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, **IMPL_KW[impl])
    assert out.dtype == dtype
    check(out, lse, oracle(args, kw, meta), dtype)


def test_query_chunks_cover_tq():
    assert query_chunks(1, 8) == [(0, 1)]
    assert query_chunks(40, 4, max_rows=128) == [(0, 32), (32, 40)]
    assert query_chunks(3, 256, max_rows=128) == [(0, 1), (1, 2), (2, 3)]
    for tq, grp in [(1, 1), (7, 4), (129, 1), (600, 1), (300, 4)]:
        ch = query_chunks(tq, grp)
        assert ch[0][0] == 0 and ch[-1][1] == tq and all(a < b for a, b in ch)
        assert all(ch[i][1] == ch[i + 1][0] for i in range(len(ch) - 1))
        assert all((b - a) * grp <= 128 or b - a == 1 for a, b in ch)


@pytest.mark.parametrize("impl", ["pallas_interpret", "flat_interpret"])
def test_kernel_paths_chunk_long_query_blocks(impl):
    """Tq * group beyond one row tile (suffix prefill): queries run in chunks of positions
    (Tq=36, group 4: chunks (0, 32), (32, 36), each with its own tiling)."""
    args, kw, meta = make_case(77, b=2, tq=36, hq=8, hkv=2, d=16, g=2, p=24, s=40,
                               suffix_lengths=[36, 40])
    plan = plan_shared_prefix(batch=2, tq=36, heads_q=8, heads_kv=2, head_dim=16, groups=2,
                              prefix_len=24, suffix_len=40, dtype=jnp.float32,
                              device=H100_SXM, interpret=True, **{"impl": IMPL_KW[impl]["impl"]})
    assert [(c.start, c.stop) for c in plan.chunks] == [(0, 32), (32, 36)]
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, plan=plan, interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.float32)


def test_kernel_forwards_reject_more_rows_than_a_tile():
    args, kw, _ = make_case(5, b=2, tq=40, hq=8, hkv=2, d=16, p=24, s=48, suffix_lengths=[40, 48])
    q, pk, pv, sk, sv = args
    for impl in ("shared", "flat"):
        plan = plan_shared_prefix(batch=2, tq=40, heads_q=8, heads_kv=2, head_dim=16, groups=1,
                                  prefix_len=24, suffix_len=48, dtype=jnp.float32, impl=impl,
                                  device=H100_SXM, interpret=True)
        one_chunk = dataclasses.replace(plan, chunks=(dataclasses.replace(plan.chunks[0],
                                                                          stop=40),))
        with pytest.raises(ValueError, match="query rows per sequence"):
            run_plan(one_chunk, q, pk[None], pv[None], sk, sv, jnp.zeros((2,), jnp.int32),
                     jnp.full((1,), 24, jnp.int32), kw["suffix_lengths"], 0.25, True)


def test_plan_for_other_shapes_is_rejected():
    args, kw, _ = make_case(5, b=2, tq=1, hq=4, hkv=2, d=16, p=20, s=9)
    plan = plan_shared_prefix(batch=3, tq=1, heads_q=4, heads_kv=2, head_dim=16, groups=1,
                              prefix_len=20, suffix_len=9, dtype=jnp.float32, impl="shared",
                              device=H100_SXM, interpret=True)
    with pytest.raises(ValueError, match="plan was made for"):
        shared_prefix_attention(*args, **kw, plan=plan, interpret=True)


@pytest.mark.parametrize("impl", ["pallas_interpret", "flat_interpret"])
def test_kernel_paths_128_rows_per_sequence_short_prefix(impl):
    """32 queries x G = 4 = 128 rows per sequence (one full row tile) with a prefix too short to
    split: the prefix kernel's tiling takes 128-row tiles unsplit
    at a small batch too."""
    args, kw, meta = make_case(12, b=2, tq=33, hq=8, hkv=2, g=0, p=12, s=40,
                               suffix_lengths=[40, 20])
    out, lse = shared_prefix_attention(*args, **kw, return_lse=True, **IMPL_KW[impl])
    check(out, lse, oracle(args, kw, meta), jnp.float32)


def test_kernel_path_gradients_interpret():
    _grad_check("pallas_interpret")


@pytest.mark.parametrize("impl,case", [
    ("pallas_interpret", dict(g=0, tq=1, prefix_lengths=None, suffix_lengths=[0, 6, 3])),
    ("pallas_interpret", dict(g=3, b=5, tq=4, hq=8, hkv=1, p=19, s=7,
                              suffix_lengths=[7, 0, 2, 5, 4], prefix_lengths=[19, 3, 11])),
    ("pallas_interpret", dict(g=0, tq=3, hq=4, hkv=4, d=32, p=40, s=20, prefix_lengths=None,
                              suffix_lengths=[20, 1, 17])),
    ("flat_interpret", dict()),
    ("pallas_interpret", dict(g=0, b=2, tq=33, hq=8, hkv=2, p=12, s=40, prefix_lengths=None,
                              suffix_lengths=[40, 20])),  # 132 rows: the flash backward
])
def test_kernel_path_gradients_interpret_cases(impl, case):
    """One prefix (given as [P, Hkv, D]), decoding, GQA 8 with ragged groups, MHA, the flat
    path (the same backward kernels), and 132 query rows per (sequence, kv head) (the suffix
    part through the flash backward)."""
    _grad_check(impl, **case)


def test_kernel_path_second_order_gradients():
    """Grad of grad through the kernel path (its backward differentiated through the
    reference's autodiff) equals grad of grad of the reference path."""
    args, kw, _ = make_case(8, b=2, tq=2, hq=4, hkv=2, g=2, p=9, s=5, suffix_lengths=[5, 1])

    def second(impl):
        def f(q, pk):
            out, lse = shared_prefix_attention(q, pk, *args[2:], **kw, return_lse=True,
                                               **IMPL_KW[impl])
            return jnp.sum(out ** 2) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        def g(q, pk):
            dq, dpk = jax.grad(f, argnums=(0, 1))(q, pk)
            return jnp.sum(dq ** 2) + jnp.sum(jnp.sin(dpk))
        return jax.jit(jax.grad(g, argnums=(0, 1)))(args[0], args[1])
    for a, b_ in zip(second("pallas_interpret"), second("reference")):
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, b_) < 1e-5, rel_err(a, b_)


def test_kernel_path_backward_runs_the_flash_kernels():
    """The kernel paths' backward is the kernels, not autodiff of the reference (unless the
    plan says ``backward="reference"``)."""
    args, kw, _ = make_case(3, b=2, tq=2, g=2, p=10, s=6)
    shapes = dict(batch=2, tq=2, heads_q=4, heads_kv=2, head_dim=16, groups=2, prefix_len=10,
                  suffix_len=6, dtype=jnp.float32, impl="shared", device=H100_SXM,
                  interpret=True)

    def loss(q, pk, plan=None):
        return jnp.sum(shared_prefix_attention(q, pk, *args[2:], **kw, impl="shared",
                                               interpret=True, plan=plan))
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(args[0], args[1]))
    for name in ("prefix_bwd_dq", "prefix_bwd_dkv", "suffix_bwd"):
        assert name in text, name
    # more than suffix_attention_bwd.MAX_ROWS query rows per (sequence, kv head): the suffix
    # part through the flash backward
    args2, kw2, _ = make_case(4, b=2, tq=33, hq=8, hkv=2, g=0, p=12, s=40,
                              suffix_lengths=[40, 35])
    text2 = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(shared_prefix_attention(
        q, *args2[1:], **kw2, impl="shared", interpret=True))))(args2[0]))
    assert "flash_attention_bwd_dkv" in text2 and "suffix_bwd" not in text2
    ref_plan = plan_shared_prefix(**shapes, backward="reference")
    text = str(jax.make_jaxpr(jax.grad(lambda q, pk: loss(q, pk, ref_plan), argnums=(0, 1)))(
        args[0], args[1]))
    assert "prefix_bwd_dq" not in text
    with pytest.raises(ValueError, match="backward"):
        plan_shared_prefix(**shapes, backward="nope")


def test_cost_model_prefers_shared_for_large_batches():
    shapes = dict(tq=1, heads_q=32, heads_kv=8, head_dim=128, groups=1, suffix_len=128,
                  dtype=jnp.bfloat16, device=H100_SXM)
    assert plan_shared_prefix(batch=256, prefix_len=4096, **shapes).impl == "shared"
    # One sequence: nothing to share, flat reads the same bytes in one launch.
    assert plan_shared_prefix(batch=1, prefix_len=4096, **shapes).impl == "flat"


# --------------------------------------------------------------------------- GPU (compiled)

@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["shared", "flat", "auto"])
@pytest.mark.parametrize("tq,hq,hkv,d,g,dtype", [
    (1, 32, 8, 128, 0, jnp.bfloat16),
    (1, 8, 1, 128, 0, jnp.bfloat16),
    (4, 32, 8, 128, 3, jnp.bfloat16),
    (1, 8, 8, 64, 2, jnp.float32),
    (4, 16, 4, 64, 0, jnp.float32),
])
def test_gpu_parity(impl, tq, hq, hkv, d, g, dtype):
    b = 24
    sl = np.random.default_rng(3).integers(0, 301, size=b)
    sl[:3] = [0, 300, 1]
    args, kw, meta = make_case(30 + tq + hq, b=b, tq=tq, hq=hq, hkv=hkv, d=d, g=g, p=1000, s=300,
                               dtype=dtype, suffix_lengths=sl)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl=impl))(*args)
    check(out, lse, oracle(args, kw, meta), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["shared", "flat"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 8)])
def test_gpu_long_suffix_prefill(impl, hq, hkv):
    """Hundreds of new tokens per sequence (a problem prefilled after a shared root): more rows
    per sequence than one tile holds (CodeLlama-like MHA shapes): the queries run in chunks."""
    args, kw, meta = make_case(60, b=3, tq=300, hq=hq, hkv=hkv, d=128, g=0, p=700, s=420,
                               dtype=jnp.bfloat16, suffix_lengths=[300, 420, 333])
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl=impl))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["shared", "flat"])
@pytest.mark.parametrize("b,hq,hkv,g", [(16, 8, 1, 1), (300, 8, 1, 1), (64, 32, 8, 1),
                                        (300, 32, 8, 1), (40, 32, 8, 3)])
def test_gpu_ragged_prefix_with_nan_tail(impl, b, hq, hkv, g):
    """Prefixes shorter than their buffer, garbage past each length: it must not reach the
    output.  Covers the one-prefix decode forms without per-row metadata (the overlap launch at
    small batch, the Mosaic GPU kernel at large) and grouped prefixes whose row blocks end in
    padding rows.  The garbage is NaN except for the shared path with one prefix, where the
    Mosaic GPU kernel may run: it masks scores, not the values it multiplies by 0, so there it
    is large finite values (``prefix_attention_mgpu``'s docstring states this limit)."""
    sl = np.random.default_rng(7).integers(0, 65, size=b)
    sl[:2] = [0, 64]
    args, kw, meta = make_case(70 + b, b=b, tq=1, hq=hq, hkv=hkv, d=128, g=g, p=1024, s=64,
                               dtype=jnp.bfloat16, suffix_lengths=sl,
                               prefix_lengths=[1000] if g == 1 else [1000, 333, 1024])
    q, pk, pv, sk, sv = args
    plen = np.asarray(meta[0])
    tail = np.arange(1024)[None, :, None, None] >= plen[:, None, None, None]
    bad = 3e4 if impl == "shared" and g == 1 else jnp.nan
    pk_nan, pv_nan = (jnp.where(tail, bad, x).astype(x.dtype) for x in (pk, pv))
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True, impl=impl))(
        q, pk_nan, pv_nan, sk, sv)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_small_batch_splits():
    args, kw, meta = make_case(40, b=2, tq=1, hq=8, hkv=1, d=128, p=4000, s=64,
                               dtype=jnp.bfloat16, suffix_lengths=[64, 0])
    for impl in ("shared", "flat"):
        out, lse = shared_prefix_attention(*args, **kw, return_lse=True, impl=impl)
        check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton_two_launch", "triton_overlap"])
def test_gpu_shared_variants_large_batch(path):
    b = 96
    sl = np.random.default_rng(5).integers(0, 257, size=b)
    sl[:2] = [0, 256]
    args, kw, meta = make_case(50, b=b, tq=1, hq=32, hkv=8, d=128, g=2, p=1500, s=256,
                               dtype=jnp.bfloat16, suffix_lengths=sl)
    plan = plan_shared_prefix(batch=b, tq=1, heads_q=32, heads_kv=8, head_dim=128, groups=2,
                              prefix_len=1500, suffix_len=256, dtype=jnp.bfloat16, path=path)
    out, lse = jax.jit(lambda *a: shared_prefix_attention(*a, **kw, return_lse=True,
                                                          plan=plan))(*args)
    check(out, lse, oracle(args, kw, meta), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["shared", "flat"])
@pytest.mark.parametrize("b,tq,hq,hkv,d,g,p,s", [(64, 1, 32, 8, 128, 0, 1024, 128),
                                                 (8, 16, 8, 1, 128, 0, 512, 96),
                                                 (12, 4, 16, 4, 64, 3, 300, 50)])
def test_gpu_kernel_backward_matches_reference(impl, b, tq, hq, hkv, d, g, p, s):
    """Compiled forward + flash backward kernels against autodiff of the pure-JAX reference
    (bf16 inputs, every input's gradient, with a cotangent on lse too)."""
    args, kw, _ = make_case(50 + tq, b=b, tq=tq, hq=hq, hkv=hkv, d=d, g=g, p=p, s=s,
                            dtype=jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(args[0].shape, np.float32))

    def loss(impl_):
        def f(*a):
            out, lse = shared_prefix_attention(*a, **kw, return_lse=True, impl=impl_)
            return (jnp.sum(out.astype(jnp.float32) * w)
                    + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))
    got = loss(impl)(*args)
    want = loss("reference")(*args)
    for a, w_ in zip(got, want):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_err(a, w_) < 2e-2, rel_err(a, w_)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret", "flat_interpret"])
def test_nan_past_the_lengths_every_impl(impl):
    """Prefix and suffix slots past their lengths may hold anything (NaN too): every impl,
    the pure-JAX reference (``auto`` off the GPU) included, gives the clean inputs' outputs and
    gradients."""
    args, kw, meta = make_case(31, b=3, tq=2, g=2, p=12, s=7, suffix_lengths=[7, 1, 0],
                               prefix_lengths=[9, 0])
    q, pk, pv, sk, sv = args
    ppad = (jnp.arange(12)[None, :] >= kw["prefix_lengths"][:, None])[:, :, None, None]
    spad = (jnp.arange(7)[None, :] >= kw["suffix_lengths"][:, None])[:, :, None, None]
    poisoned = (q, jnp.where(ppad, jnp.nan, pk), jnp.where(ppad, jnp.nan, pv),
                jnp.where(spad, jnp.nan, sk), jnp.where(spad, jnp.nan, sv))

    def loss(*a):
        out = shared_prefix_attention(*a, **kw, **IMPL_KW[impl])
        return jnp.sum(out.astype(jnp.float32) ** 2), out
    # One jitted program for the clean and the poisoned inputs (same shapes, other values).
    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, o1), g1 = run(*args)
    (_, o2), g2 = run(*poisoned)
    assert np.isfinite(np.asarray(o2)).all()
    assert rel_err(o2, o1) < 1e-6
    for a, b, pad in zip(g1, g2, (None, ppad, ppad, spad, spad)):
        b = b if pad is None else jnp.where(pad, 0.0, b)
        assert np.isfinite(np.asarray(b)).all()
        assert rel_err(b, a if pad is None else jnp.where(pad, 0.0, a)) < 1e-6


@pytest.mark.parametrize("p,s", [(0, 5), (6, 0)])
def test_reference_with_an_empty_prefix_or_suffix_axis(p, s):
    """A zero-length prefix or suffix axis: the reference (the path the kernels' error names)
    equals the oracle over the concatenation."""
    args, kw, meta = make_case(32, b=2, tq=1, p=max(p, 1), s=max(s, 1))
    q, pk, pv, sk, sv = args
    pk, pv, sk, sv = pk[:p], pv[:p], sk[:, :s], sv[:, :s]
    kw = dict(kw, suffix_lengths=jnp.minimum(kw["suffix_lengths"], s))
    out, lse = shared_prefix_attention(q, pk, pv, sk, sv, **kw, impl="reference", return_lse=True)
    b = q.shape[0]
    kc = jnp.concatenate([jnp.broadcast_to(pk[None], (b,) + pk.shape), sk], axis=1)
    vc = jnp.concatenate([jnp.broadcast_to(pv[None], (b,) + pv.shape), sv], axis=1)
    ref = ref_attention_jit(q, kc, vc, p + kw["suffix_lengths"])
    check(out, lse, ref, jnp.float32)
