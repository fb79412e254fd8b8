"""The shared-prefix backward on the Mosaic GPU flash backward kernels (``backward="mgpu"``,
jax_prefix_attn/mgpu_grads.py), in Mosaic GPU's CPU interpreter against autodiff of the
reference in float32: contiguous groups, groups in another order (rows permuted), groups of
unequal sizes (a loop over copies of the prefix), rows inside the prefix (short suffixes) with
and without a cotangent, rows that see no key; the plan's
refusals; CUDA lowering of the gradient program (a batch the groups do not divide too); on an
H200 at training sizes (one prefix too)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, make_case, rel_err
from jax_prefix_attn import plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H200, DeviceInfo

BF16 = jnp.bfloat16
A100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")


def _grads(args, kw, call, w, row_weight):
    """Gradients of ``sum(out * w * row_weight) + 0.1 * sum(lse * row_weight)`` (``row_weight
    [B, Tq]``: zero rows carry no cotangent) for every input."""
    def f(*a):
        out, lse = shared_prefix_attention(*a, **kw, return_lse=True, **call)
        rw = row_weight[:, :, None]
        return (jnp.sum(out.astype(jnp.float32) * w * rw[..., None])
                + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * rw))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(*args)


def _check(seed, *, b, tq, hq, hkv, d, g, p, s, suffix_lengths, prefix_lengths=None, s2p=None,
           padding_loss=True, interpret=True):
    args, kw, _ = make_case(seed, b=b, tq=tq, hq=hq, hkv=hkv, d=d, g=g, p=p, s=s, dtype=BF16,
                            suffix_lengths=suffix_lengths, prefix_lengths=prefix_lengths)
    if s2p is not None:
        kw["seq_to_prefix"] = jnp.asarray(s2p, jnp.int32)
    shapes = dict(batch=b, tq=tq, heads_q=hq, heads_kv=hkv, head_dim=d, groups=max(g, 1),
                  prefix_len=p, suffix_len=s, dtype=BF16)
    mgpu = plan_shared_prefix(**shapes, impl="shared", interpret=interpret, backward="mgpu")
    assert mgpu.backward.mode == "mgpu"
    w = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(args[0].shape, np.float32))
    sl = np.asarray(suffix_lengths)
    inside = np.arange(tq)[None, :] < (tq - sl)[:, None]          # rows that sit in the prefix
    row_weight = jnp.asarray(np.where(inside & (not padding_loss), 0.0, 1.0), jnp.float32)
    got = _grads(args, kw, dict(plan=mgpu, interpret=interpret), w, row_weight)
    f32_args = tuple(x.astype(jnp.float32) for x in args)
    want = _grads(f32_args, kw, dict(impl="reference"), w, row_weight)
    for name, a, w_ in zip(("q", "prefix_k", "prefix_v", "suffix_k", "suffix_v"), got, want):
        assert a.dtype == BF16, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        assert rel_err(a, w_) < 2e-2, (name, rel_err(a, w_))


@pytest.mark.parametrize("case", [
    # two contiguous groups of 2 (the folded prefix call), ragged prefixes, GQA 2, suffixes
    # shorter than Tq: rows inside the prefix with a cotangent (the head/tail split)
    dict(b=4, tq=4, hq=2, hkv=1, d=64, g=2, p=29, s=6, suffix_lengths=[6, 1, 4, 0],
         prefix_lengths=[29, 11], s2p=[0, 0, 1, 1]),
    # groups of unequal sizes (two sequences per call in a loop) with rows inside the prefix
    # that carry a cotangent (the head/tail split); a prefix shorter than Tq (no head) and an
    # empty one, whose sequence with no suffix has rows that see no key (lse = -inf, grad 0)
    dict(b=4, tq=5, hq=2, hkv=1, d=64, g=2, p=12, s=4, suffix_lengths=[4, 0, 2, 3],
         prefix_lengths=[3, 0], s2p=[0, 1, 0, 0]),
    # three groups of two in another order (the rows permuted into contiguous groups), GQA 1,
    # head_dim 48 (zero-padded), the rows inside the prefix without a cotangent
    dict(b=6, tq=3, hq=2, hkv=2, d=48, g=3, p=16, s=3, suffix_lengths=[3, 1, 0, 3, 2, 3],
         prefix_lengths=[16, 9, 5], s2p=[2, 0, 1, 1, 2, 0], padding_loss=False),
])
def test_mgpu_backward_in_cpu_interpreter_matches_reference(case):
    _check(len(case) * 7 + case["b"], **case)


def test_mgpu_backward_plan_refuses_what_it_cannot_run():
    base = dict(batch=4, tq=8, heads_q=8, heads_kv=2, head_dim=128, groups=1, prefix_len=256,
                suffix_len=64, dtype=BF16, impl="shared")
    plan = plan_shared_prefix(**base, device=H200, backward="mgpu")
    assert plan.backward.mode == "mgpu"
    with pytest.raises(ValueError, match="backward='mgpu'.*bfloat16 or float16"):
        plan_shared_prefix(**dict(base, dtype=jnp.float32), device=H200, backward="mgpu")
    with pytest.raises(ValueError, match="backward='mgpu'.*compute capability 9.0"):
        plan_shared_prefix(**base, device=A100, backward="mgpu")
    with pytest.raises(ValueError, match="backward='mgpu'.*head_dim"):
        plan_shared_prefix(**dict(base, head_dim=512), device=H200, backward="mgpu")


@pytest.mark.parametrize("b,g", [(4, 2), (3, 2)])
def test_mgpu_backward_lowers_for_cuda(b, g):
    """The gradient program of ``backward="mgpu"`` (suffix, folded or per-sequence prefix, the
    branch of the rows inside the prefix) lowers for CUDA on the CPU with no Triton backward
    kernel: Mosaic GPU's layout and transfer inference at a training shape."""
    tq, hq, hkv, d, p, s = 128, 8, 2, 128, 512, 128
    plan = plan_shared_prefix(batch=b, tq=tq, heads_q=hq, heads_kv=hkv, head_dim=d, groups=g,
                              prefix_len=p, suffix_len=s, dtype=BF16, impl="shared", device=H200,
                              backward="mgpu")
    sd = jax.ShapeDtypeStruct
    q, pk, sk = sd((b, tq, hq, d), BF16), sd((g, p, hkv, d), BF16), sd((b, s, hkv, d), BF16)
    lens = dict(suffix_lengths=jnp.full((b,), s, jnp.int32), prefix_lengths=jnp.full((g,), p, jnp.int32),
                seq_to_prefix=jnp.arange(b, dtype=jnp.int32) % g)

    def loss(q, pk, pv, sk, sv):
        return jnp.sum(shared_prefix_attention(q, pk, pv, sk, sv, **lens, plan=plan).astype(jnp.float32))
    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, pk, pk, sk, sk)
    assert text.count("mosaic_gpu") >= 6       # dQ and dK/dV of the suffix and prefix calls
    for name in ("prefix_bwd", "suffix_bwd", "flash_attention_bwd"):   # no Triton backward
        assert name not in text, name


@pytest.mark.gpu
@pytest.mark.parametrize("g,s2p", [(1, None), (4, "contiguous"), (4, "shuffled")])
def test_gpu_mgpu_backward_matches_reference(g, s2p):
    """H200, bf16, GRPO-like shapes (B=16, Tq=256 completion rows, P=1024, ragged suffixes so
    some rows sit in the prefix): ``backward="mgpu"`` against autodiff of the reference, every
    input's gradient, a cotangent on lse too."""
    b, tq, hq, hkv, d, p, s = 16, 256, 16, 4, 128, 1024, 256
    rng = np.random.default_rng(g)
    order = np.repeat(np.arange(g), b // g)
    if s2p == "shuffled":
        rng.shuffle(order)
    _check(40 + g, b=b, tq=tq, hq=hq, hkv=hkv, d=d, g=0 if g == 1 else g, p=p, s=s,
           suffix_lengths=rng.integers(tq // 2, s + 1, size=b),
           prefix_lengths=None if g == 1 else rng.integers(p // 2, p + 1, size=g),
           s2p=None if g == 1 else order, interpret=False)


def test_auto_backward_takes_mgpu_from_the_profiles_query_rows():
    """``backward="auto"`` (the default): Mosaic GPU on Hopper from the profile's
    ``mgpu_backward_min_tq`` query rows, compiled, shapes it takes; the Triton kernels below
    that, in interpret mode, off Hopper, in float32; a reference plan keeps ``"kernels"``."""
    from jax_prefix_attn.device_profile import device_profile
    min_tq = device_profile(H200)[0].tuning.mgpu_backward_min_tq
    base = dict(batch=8, heads_q=8, heads_kv=2, head_dim=128, groups=2, prefix_len=1024,
                suffix_len=512, dtype=BF16, impl="shared", device=H200)
    mode = lambda **kw: plan_shared_prefix(**dict(base, **kw)).backward.mode  # noqa: E731
    assert mode(tq=min_tq) == "mgpu" and mode(tq=2 * min_tq, suffix_len=2 * min_tq) == "mgpu"
    assert mode(tq=min_tq - 1) == "kernels"
    assert mode(tq=min_tq, interpret=True) == "kernels"
    assert mode(tq=min_tq, device=A100) == "kernels"
    assert mode(tq=min_tq, dtype=jnp.float32) == "kernels"
    assert mode(tq=min_tq, impl="reference") == "kernels"
    assert mode(tq=min_tq, backward="kernels") == "kernels"


def test_plans_differ_only_in_the_backward():
    base = dict(batch=2, tq=4, heads_q=4, heads_kv=2, head_dim=64, groups=1, prefix_len=64,
                suffix_len=8, dtype=BF16, impl="shared", device=H200)
    a, k = plan_shared_prefix(**base, backward="mgpu"), plan_shared_prefix(**base)
    assert dataclasses.replace(a, backward=k.backward) == k


def test_backward_argument_or_a_plan_not_both():
    """``shared_prefix_attention(backward=...)`` plans with that backward; given a plan too, it
    refuses anything but the default."""
    args, kw, _ = make_case(5, b=2, tq=2, hq=4, hkv=2, d=16, g=0, p=8, s=3, dtype=BF16)
    plan = plan_shared_prefix(batch=2, tq=2, heads_q=4, heads_kv=2, head_dim=16, groups=1,
                              prefix_len=8, suffix_len=3, dtype=BF16, impl="reference")
    with pytest.raises(ValueError, match="pass backward= or plan="):
        shared_prefix_attention(*args, **kw, plan=plan, backward="mgpu")
    with pytest.raises(ValueError, match="backward must be one of"):
        shared_prefix_attention(*args, **kw, backward="nope")
    shared_prefix_attention(*args, **kw, impl="reference", backward="mgpu")   # reference: accepted

