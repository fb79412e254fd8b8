"""mla_attention: the absorbed MLA decomposition against a float64 NumPy oracle of the
non-absorbed equations (the notes' sections 3.2 and 3.2.1), grouped prefixes, ragged and
poisoned caches, the clamp rule, gradients against the concatenated-softmax form, validation."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_prefix_attn as jpa


def make_case(seed, *, b=3, tq=2, h=3, r=24, dr=8, dn=5, dv=7, p=11, s=6, g=0,
              suffix_lengths=None, prefix_lengths=None, seq_to_prefix=None, dtype=jnp.float32):
    """Random absorbed inputs plus the up-projections they come from.

    Returns ``(args, kw, full)``: ``mla_attention(*args, **kw)``; ``full`` holds the
    non-absorbed queries ``q_nope [B, Tq, H, Dn]`` and ``W_UK [H, R, Dn]``, ``W_UV [H, R, Dv]``
    (float64) with ``q_nope_absorbed = q_nope @ W_UK^T`` per head."""
    rng = np.random.default_rng(seed)
    w_uk = rng.standard_normal((h, r, dn)) / np.sqrt(r)
    w_uv = rng.standard_normal((h, r, dv)) / np.sqrt(r)
    q_nope = rng.standard_normal((b, tq, h, dn))
    q_abs = np.einsum("bthn,hrn->bthr", q_nope, w_uk)
    q_rope = rng.standard_normal((b, tq, h, dr))
    lead = (p,) if g == 0 else (g, p)
    pc, pk = rng.standard_normal(lead + (r,)), rng.standard_normal(lead + (dr,))
    sc, sk = rng.standard_normal((b, s, r)), rng.standard_normal((b, s, dr))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = tuple(cast(x) for x in (q_abs, q_rope, pc, pk, sc, sk))
    kw = {"suffix_lengths": jnp.asarray(rng.integers(0, s + 1, b) if suffix_lengths is None
                                        else suffix_lengths, jnp.int32)}
    if g:
        kw["prefix_lengths"] = jnp.asarray(rng.integers(0, p + 1, g) if prefix_lengths is None
                                           else prefix_lengths, jnp.int32)
        kw["seq_to_prefix"] = jnp.asarray(rng.integers(0, g, b) if seq_to_prefix is None
                                          else seq_to_prefix, jnp.int32)
    full = {"q_nope": q_nope, "w_uk": w_uk, "w_uv": w_uv}
    return args, kw, full


def oracle(args, kw, full, scale):
    """float64 NumPy, non-absorbed: for sequence ``b`` and head ``h``, keys
    ``K_h = [C W_UK_h ; k_rope]`` and values ``V_h = C W_UV_h`` over ``C = [prefix[:pl];
    suffix[:sl]]``, queries ``[q_nope_h ; q_rope_h]``, causal bottom-right.  Returns
    ``(out [B, Tq, H, Dv], lse [B, Tq, H])``."""
    _, q_rope, pc, pk, sc, sk = (np.asarray(x, np.float64) for x in args)
    q_nope, w_uk, w_uv = full["q_nope"], full["w_uk"], full["w_uv"]
    b, tq, h, _ = q_rope.shape
    if pc.ndim == 2:
        pc, pk = pc[None], pk[None]
    s2p = np.asarray(kw.get("seq_to_prefix", np.zeros(b, np.int64)))
    plens = np.asarray(kw.get("prefix_lengths", np.full(pc.shape[0], pc.shape[1])))
    slens = np.asarray(kw["suffix_lengths"])
    out = np.zeros((b, tq, h, w_uv.shape[2]))
    lse = np.full((b, tq, h), -np.inf)
    for i in range(b):
        gi, pl, sl = s2p[i], plens[s2p[i]], slens[i]
        c = np.concatenate([pc[gi, :pl], sc[i, :sl]])               # [L, R]
        kr = np.concatenate([pk[gi, :pl], sk[i, :sl]])              # [L, Dr]
        n = len(c)
        for hh in range(h):
            k = np.concatenate([c @ w_uk[hh], kr], axis=1)          # [L, Dn + Dr]
            v = c @ w_uv[hh]                                        # [L, Dv]
            for t in range(tq):
                q = np.concatenate([q_nope[i, t, hh], q_rope[i, t, hh]])
                vis = np.arange(n) <= t + n - tq
                if not vis.any():
                    continue
                z = scale * (k[vis] @ q)
                m = z.max()
                e = np.exp(z - m)
                out[i, t, hh] = e @ v[vis] / e.sum()
                lse[i, t, hh] = m + np.log(e.sum())
    return out, lse


def up_v(out_latent, full):
    """Apply ``W_UV`` per head to the latent-space output: ``[B, Tq, H, R] -> [B, Tq, H, Dv]``."""
    return np.einsum("bthr,hrv->bthv", np.asarray(out_latent, np.float64), full["w_uv"])


def assert_matches(out, lse, ref, atol=2e-5):
    ref_out, ref_lse = ref
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=atol)


SCALE = 0.3


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("g", [0, 3])
def test_absorbed_matches_non_absorbed_oracle(tq, g):
    args, kw, full = make_case(7 * tq + g, b=5, tq=tq, g=g, suffix_lengths=[0, 6, 2, 1, 4])
    out, lse = jpa.mla_attention(*args, **kw, sm_scale=SCALE, return_lse=True)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    assert lse.shape == args[0].shape[:3] and lse.dtype == jnp.float32
    assert_matches(up_v(out, full), lse, oracle(args, kw, full, SCALE))


def test_odd_shapes_default_scale_and_latent_output():
    args, kw, full = make_case(3, b=1, tq=5, h=1, r=13, dr=3, dn=9, dv=1, p=1, s=7,
                               suffix_lengths=[7])
    out, lse = jpa.mla_attention(*args, **kw, return_lse=True)
    scale = 1.0 / np.sqrt(13 + 3)
    assert_matches(up_v(out, full), lse, oracle(args, kw, full, scale))
    # the latent output itself is sum_j p_j c_j: with W_UV = identity the oracle's V is c
    full_id = dict(full, w_uv=np.eye(13)[None])
    np.testing.assert_allclose(out, oracle(args, kw, full_id, scale)[0], rtol=1e-4, atol=2e-5)
    assert np.asarray(jpa.mla_attention(*args, **kw)).shape == (1, 5, 1, 13)


def test_grouped_prefixes_ragged_and_empty_rows():
    # group 2 has an empty prefix; sequence 3 (group 2, suffix 0) sees nothing at all
    args, kw, full = make_case(11, b=4, tq=2, g=3, prefix_lengths=[11, 4, 0],
                               seq_to_prefix=[1, 0, 2, 2], suffix_lengths=[3, 0, 1, 0])
    out, lse = jpa.mla_attention(*args, **kw, sm_scale=SCALE, return_lse=True)
    assert_matches(up_v(out, full), lse, oracle(args, kw, full, SCALE))
    assert bool(jnp.all(lse[3] == -jnp.inf)) and bool(jnp.all(out[3] == 0))
    # sequence 2's first query falls before its only token: empty too (suffix 1 < Tq 2)
    assert bool(jnp.all(lse[2, 0] == -jnp.inf)) and bool(jnp.all(jnp.isfinite(lse[2, 1])))


def test_nan_past_lengths_has_no_effect_and_nan_seen_propagates():
    args, kw, full = make_case(5, b=3, tq=2, g=2, p=9, s=6, prefix_lengths=[5, 9],
                               seq_to_prefix=[0, 1, 0], suffix_lengths=[2, 6, 4])
    q, qr, pc, pk, sc, sk = args
    pc_bad = pc.at[0, 5:].set(jnp.nan)
    pk_bad = pk.at[0, 5:].set(jnp.nan)
    sc_bad = sc.at[0, 2:].set(jnp.nan).at[2, 4:].set(jnp.inf)
    sk_bad = sk.at[0, 2:].set(jnp.nan).at[2, 4:].set(jnp.nan)
    poisoned = (q, qr, pc_bad, pk_bad, sc_bad, sk_bad)
    out, lse = jpa.mla_attention(*poisoned, **kw, sm_scale=SCALE, return_lse=True)
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(jnp.isfinite(lse)))
    assert_matches(up_v(out, full), lse, oracle(args, kw, full, SCALE))
    # gradients see no poison either
    grads = jax.grad(lambda *a: jnp.sum(jpa.mla_attention(*a, **kw, sm_scale=SCALE)),
                     argnums=(0, 1, 2, 3, 4, 5))(*poisoned)
    assert all(bool(jnp.all(jnp.isfinite(gr))) for gr in grads)
    # a NaN inside sequence 1's visible suffix: its rows are NaN (out and lse), the others not
    out, lse = jpa.mla_attention(q, qr, pc, pk, sc.at[1, 0, 3].set(jnp.nan), sk, **kw,
                                 sm_scale=SCALE, return_lse=True)
    assert bool(jnp.all(jnp.isnan(lse[1]))) and bool(jnp.all(jnp.isnan(out[1])))
    assert bool(jnp.all(jnp.isfinite(lse[jnp.array([0, 2])])))
    # a NaN query row: that row only
    out, lse = jpa.mla_attention(q.at[2, 1, 0, 0].set(jnp.nan), qr, pc, pk, sc, sk, **kw,
                                 sm_scale=SCALE, return_lse=True)
    assert bool(jnp.isnan(lse[2, 1, 0])) and int(jnp.sum(jnp.isnan(lse))) == 1


def test_traced_lengths_are_clamped_and_checked():
    args, kw, full = make_case(9, b=3, tq=1, g=2, p=8, s=5)
    f = jax.jit(functools.partial(jpa.mla_attention, sm_scale=SCALE, return_lse=True))
    wild = dict(suffix_lengths=jnp.array([-3, 9, 2], jnp.int32),
                prefix_lengths=jnp.array([100, -1], jnp.int32),
                seq_to_prefix=jnp.array([5, -2, 1], jnp.int32))
    clamped = dict(suffix_lengths=jnp.array([0, 5, 2], jnp.int32),
                   prefix_lengths=jnp.array([8, 0], jnp.int32),
                   seq_to_prefix=jnp.array([1, 0, 1], jnp.int32))
    out_w, lse_w = f(*args, **wild)
    out_c, lse_c = f(*args, **clamped)
    np.testing.assert_array_equal(np.asarray(out_w), np.asarray(out_c))
    np.testing.assert_array_equal(np.asarray(lse_w), np.asarray(lse_c))
    assert_matches(up_v(out_c, full), lse_c, oracle(args, clamped, full, SCALE))
    checked = checkify.checkify(functools.partial(jpa.mla_attention, sm_scale=SCALE,
                                                  check_ranges=True),
                                errors=checkify.user_checks)
    err, _ = jax.jit(checked)(*args, **wild)
    assert err.get() is not None and "out of range" in err.get()
    err, _ = jax.jit(checked)(*args, **clamped)
    assert err.get() is None


def test_bfloat16_inputs():
    args, kw, full = make_case(13, b=2, tq=1, g=0, dtype=jnp.bfloat16)
    out, lse = jpa.mla_attention(*args, **kw, sm_scale=SCALE, return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    args32 = tuple(a.astype(jnp.float32) for a in args)
    out32, lse32 = jpa.mla_attention(*args32, **kw, sm_scale=SCALE, return_lse=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), out32, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, lse32, atol=1e-5)


def concat_form(q, qr, pc, pk, sc, sk, s2p, plens, slens, scale):
    """One softmax over each sequence's concatenated ``[prefix; suffix]`` cache (float32),
    with the visibility mask written out: the independent form for the gradients."""
    b, tq = q.shape[:2]
    p, s = pc.shape[1], sc.shape[1]
    c = jnp.concatenate([pc[s2p], sc], axis=1)                       # [B, P + S, R]
    kr = jnp.concatenate([pk[s2p], sk], axis=1)
    j = jnp.arange(p + s)
    pl, sl = plens[s2p][:, None], slens[:, None]
    pos = jnp.where(j < p, j, j - p + pl)                            # [B, P + S] position
    valid = jnp.where(j < p, j < pl, (j - p) < sl)
    n = (pl + sl)[:, :, None]
    t = jnp.arange(tq)[None, :, None]
    vis = valid[:, None, :] & (pos[:, None, :] <= t + n - tq)         # [B, Tq, P + S]
    hi = jax.lax.Precision.HIGHEST
    z = scale * (jnp.einsum("bqhr,bkr->bhqk", q, c, precision=hi)
                 + jnp.einsum("bqhd,bkd->bhqk", qr, kr, precision=hi))
    z = jnp.where(vis[:, None], z, -jnp.inf)
    lse = jax.nn.logsumexp(z, axis=-1)
    pr = jnp.exp(z - lse[..., None])
    out = jnp.einsum("bhqk,bkr->bqhr", pr, c, precision=hi)
    return out, jnp.transpose(lse, (0, 2, 1))


@pytest.mark.parametrize("g", [0, 2])
def test_gradients_match_concatenated_softmax(g):
    args, kw, _ = make_case(21 + g, b=3, tq=2, g=g, p=7, s=5, suffix_lengths=[5, 2, 3])
    s2p = kw.get("seq_to_prefix", jnp.zeros(3, jnp.int32))
    plens = kw.get("prefix_lengths", jnp.full((1,), 7, jnp.int32))
    if g:  # every row sees at least one token (logsumexp of nothing has no gradient)
        plens = jnp.maximum(plens, 1)
        kw = dict(kw, prefix_lengths=plens)
    rng = np.random.default_rng(0)
    w_out = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal(args[0].shape[:3]), jnp.float32)

    def loss_mla(*a):
        out, lse = jpa.mla_attention(*a, **kw, sm_scale=SCALE, return_lse=True)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    def loss_concat(q, qr, pc, pk, sc, sk):
        pc, pk = (pc[None], pk[None]) if pc.ndim == 2 else (pc, pk)
        out, lse = concat_form(q, qr, pc, pk, sc, sk, s2p, plens, kw["suffix_lengths"], SCALE)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    argnums = (0, 1, 2, 3, 4, 5)
    got = jax.jit(jax.grad(loss_mla, argnums))(*args)
    want = jax.jit(jax.grad(loss_concat, argnums))(*args)
    for name, a, b_ in zip(("q_nope", "q_rope", "prefix_latent", "prefix_rope_k",
                            "suffix_latent", "suffix_rope_k"), got, want):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-4, err_msg=name)
    # a directional finite difference of the loss (float32, central)
    d = tuple(jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in args)
    eps = 1e-2
    loss_jit = jax.jit(loss_mla)      # one compiled program for both points
    plus = loss_jit(*(a + eps * v for a, v in zip(args, d)))
    minus = loss_jit(*(a - eps * v for a, v in zip(args, d)))
    fd = (plus - minus) / (2 * eps)
    lin = sum(jnp.sum(gr * v) for gr, v in zip(got, d))
    np.testing.assert_allclose(fd, lin, rtol=2e-2, atol=2e-2)


def test_under_jit_dynamic_lengths_no_retrace():
    args, kw, full = make_case(17, b=2, tq=1, g=0, s=6)
    traces = []

    @jax.jit
    def f(*a, lengths):
        traces.append(1)
        return jpa.mla_attention(*a, suffix_lengths=lengths, sm_scale=SCALE, return_lse=True)

    for sl in ([0, 6], [3, 1]):
        kw2 = {"suffix_lengths": jnp.asarray(sl, jnp.int32)}
        out, lse = f(*args, lengths=kw2["suffix_lengths"])
        assert_matches(up_v(out, full), lse, oracle(args, kw2, full, SCALE))
    assert len(traces) == 1


# --------------------------------------------------------------------------- validation

def _base():
    args, kw, _ = make_case(1, b=2, tq=1, g=0, p=4, s=3, suffix_lengths=[1, 2])
    return list(args), kw


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda a, k: a.__setitem__(0, a[0][0]), ValueError, ("q_nope_absorbed", "rank 4")),
    (lambda a, k: a.__setitem__(1, a[1][:, :, :1]), ValueError, ("q_rope", "[batch, seq_q, heads]")),
    (lambda a, k: a.__setitem__(1, a[1].astype(jnp.bfloat16)), TypeError, ("q_rope", "bfloat16")),
    (lambda a, k: a.__setitem__(2, a[2][:, :5]), ValueError, ("prefix_latent", "kv_lora_rank R=24")),
    (lambda a, k: a.__setitem__(3, a[3][:, :2]), ValueError, ("prefix_rope_k", "rope_dim Dr=8")),
    (lambda a, k: a.__setitem__(3, a[3][:3]), ValueError, ("prefix_latent", "prefix_rope_k", "leading")),
    (lambda a, k: a.__setitem__(2, a[2][None, None]), ValueError, ("prefix_latent", "rank 2 or 3")),
    (lambda a, k: a.__setitem__(4, a[4][0]), ValueError, ("suffix_latent", "rank 3")),
    (lambda a, k: a.__setitem__(4, a[4].astype(jnp.float16)), TypeError, ("suffix_latent", "float16")),
    (lambda a, k: (a.__setitem__(4, a[4][:1]), a.__setitem__(5, a[5][:1])), ValueError,
     ("suffix_latent", "batch size 2")),
    (lambda a, k: a.__setitem__(5, a[5].astype(jnp.int32)), TypeError, ("suffix_rope_k", "floating")),
    (lambda a, k: k.__setitem__("suffix_lengths", jnp.array([1, 4], jnp.int32)), ValueError,
     ("suffix_lengths", "<= 3", "4")),
    (lambda a, k: k.__setitem__("suffix_lengths", jnp.array([1.0, 2.0])), TypeError,
     ("suffix_lengths", "integer")),
    (lambda a, k: k.__setitem__("prefix_lengths", jnp.array([5], jnp.int32)), ValueError,
     ("prefix_lengths", "<= 4")),
    (lambda a, k: k.__setitem__("seq_to_prefix", jnp.array([0, 1], jnp.int32)), ValueError,
     ("seq_to_prefix", "[0, 1)")),
    (lambda a, k: k.__setitem__("sm_scale", -1.0), ValueError, ("sm_scale", "-1.0")),
    (lambda a, k: k.__setitem__("return_lse", 1), TypeError, ("return_lse", "bool")),
    (lambda a, k: a.__setitem__(0, "q"), TypeError, ("q_nope_absorbed", "array")),
])
def test_validation_errors(mutate, exc, words):
    args, kw = _base()
    mutate(args, kw)
    with pytest.raises(exc) as e:
        jpa.mla_attention(*args, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_groups_need_seq_to_prefix():
    args, kw, _ = make_case(2, b=2, g=2)
    del kw["seq_to_prefix"]
    with pytest.raises(ValueError, match="seq_to_prefix .* required .* G=2"):
        jpa.mla_attention(*args, **kw)


# --------------------------------------------------------------------------- impl="mgpu"

def test_mgpu_kernels_in_cpu_interpreter_match_oracle():
    """``impl="mgpu"``: the Mosaic GPU prefix and suffix kernels in the CPU interpreter, merged
    through the LSE (bfloat16; ``R = 128``, ``Dr = 64``, the smallest widths they take), against
    the non-absorbed oracle.  ``Tq = 3``, prefix length 40 of 64 and NaN past every length, the
    suffix lengths traced: ``[70, 5]`` (70 clamped to the capacity 64) runs the kernels; ``[64,
    1]`` (a first query that sees only part of the prefix) takes the reference branch."""
    args, kw, full = make_case(31, b=2, tq=3, h=2, r=128, dr=64, dn=16, dv=8, p=64, s=64,
                               dtype=jnp.bfloat16)
    q, qr, pc, pk, sc, sk = args
    pc, pk = pc.at[40:].set(jnp.nan), pk.at[40:].set(jnp.nan)
    f = jax.jit(lambda sl, *a: jpa.mla_attention(
        *a, suffix_lengths=sl, prefix_lengths=jnp.array([40], jnp.int32), sm_scale=SCALE,
        return_lse=True, impl="mgpu", interpret=True))
    for sl, clamped in (([70, 5], [64, 5]), ([64, 1], [64, 1])):
        poisoned = (q, qr, pc, pk, sc.at[1, clamped[1]:].set(jnp.nan),
                    sk.at[1, clamped[1]:].set(jnp.nan))
        out, lse = f(jnp.array(sl, jnp.int32), *poisoned)
        assert out.dtype == jnp.bfloat16 and lse.shape == (2, 3, 2)
        kw = {"suffix_lengths": np.array(clamped), "prefix_lengths": np.array([40])}
        ref_out, ref_lse = oracle(poisoned, kw, full, SCALE)
        got = up_v(np.asarray(out, np.float32), full)
        assert np.linalg.norm(got - ref_out) / np.linalg.norm(ref_out) < 2e-2
        np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2, rtol=0)


def test_mgpu_rejects_what_the_kernels_cannot_run():
    args, kw, _ = make_case(3, b=2, tq=1, h=2, r=128, dr=64, p=64, s=64)
    with pytest.raises(ValueError, match="impl='mgpu'.*bfloat16 or float16.*impl='reference'"):
        jpa.mla_attention(*args, **kw, impl="mgpu")
    args, kw, _ = make_case(3, b=3, tq=1, h=2, r=128, dr=64, p=64, s=64, g=2,
                            dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"equally many sequences \(batch 3 .* G=2"):
        jpa.mla_attention(*args, **kw, impl="mgpu")
    with pytest.raises(ValueError, match="impl must be one of"):
        jpa.mla_attention(*args, **kw, impl="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("b,tq,h,p,s", [
    (64, 1, 16, 4096, 512),      # DeepSeek-V2-Lite heads
    (8, 1, 128, 2048, 1000),     # DeepSeek-V3 heads, S padded to whole tiles
    (16, 3, 16, 1000, 300)])     # Tq = 3, every suffix length >= Tq - 1: the kernels' branch
def test_gpu_mgpu_matches_reference(b, tq, h, p, s):
    r, dr = 512, 64
    rng = np.random.default_rng(b + p)
    shapes = ((b, tq, h, r), (b, tq, h, dr), (p, r), (p, dr), (b, s, r), (b, s, dr))
    args = tuple(jnp.asarray(rng.standard_normal(x), jnp.bfloat16) for x in shapes)
    sl = rng.integers(tq - 1, s + 1, b)
    sl[:2] = (tq - 1, s)
    kw = dict(suffix_lengths=jnp.asarray(sl, jnp.int32), sm_scale=192 ** -0.5, return_lse=True,
              prefix_lengths=jnp.array([p - 37], jnp.int32))
    out, lse = jpa.mla_attention(*args, **kw, impl="mgpu")
    ref_out, ref_lse = jpa.mla_attention(*args, **kw)
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=0)


def test_mgpu_prefix_groups_and_gradients_in_cpu_interpreter():
    """``impl="mgpu"`` with ``G = 2`` prefix groups (bfloat16, ``R = 128``, ``Dr = 64``) in the
    CPU interpreter, against the non-absorbed oracle: the kernels alone
    (:func:`jax_prefix_attn.mla_kernels.kernel_parts`, one launch of the prefix kernel per group)
    on the contiguous layout; then ``mla_attention`` under ``jax.value_and_grad`` with
    ``seq_to_prefix`` traced, once contiguous (kernels) and once not (the reference branch),
    values against the oracle and gradients of a loss of ``out`` and ``lse`` against the
    reference's (the kernel path's backward differentiates the reference)."""
    from jax_prefix_attn.mla_kernels import kernel_parts
    args, kw, full = make_case(41, b=2, tq=1, h=2, r=128, dr=64, dn=16, dv=8, p=64, s=64, g=2,
                               dtype=jnp.bfloat16, suffix_lengths=[64, 0])
    p_len, s_len = jnp.array([40, 64], jnp.int32), jnp.array([64, 0], jnp.int32)
    out, lse = jax.jit(lambda *a: kernel_parts(*a, p_len, s_len, SCALE, True, 132))(*args)
    want_out, want_lse = oracle(args, dict(kw, seq_to_prefix=np.array([0, 1]),
                                           prefix_lengths=p_len), full, SCALE)
    got = up_v(np.asarray(out, np.float32), full)
    assert np.linalg.norm(got - want_out) / np.linalg.norm(want_out) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-2, rtol=0)

    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal(args[0].shape[:3]), jnp.float32)

    def loss(impl, s2p, *a):
        out, lse = jpa.mla_attention(*a, suffix_lengths=s_len, prefix_lengths=p_len,
                                     seq_to_prefix=s2p, sm_scale=SCALE, return_lse=True,
                                     impl=impl, interpret=True)
        return (jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)), (out, lse)

    argnums = tuple(range(1, 7))
    run = {impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums, has_aux=True))
           for impl in ("mgpu", "reference")}
    for s2p in ([0, 1], [1, 0]):
        s2p = jnp.array(s2p, jnp.int32)
        (_, (out, lse)), got = run["mgpu"](s2p, *args)
        _, want = run["reference"](s2p, *args)
        ref_out, ref_lse = oracle(args, dict(kw, seq_to_prefix=np.asarray(s2p),
                                             prefix_lengths=p_len), full, SCALE)
        assert np.linalg.norm(up_v(np.asarray(out, np.float32), full) - ref_out) \
            / np.linalg.norm(ref_out) < 2e-2
        np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-2, rtol=0)
        for name, a, b_ in zip(("q_nope", "q_rope", "prefix_latent", "prefix_rope_k",
                                "suffix_latent", "suffix_rope_k"), got, want):
            assert a.dtype == jnp.bfloat16, name
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32),
                                       rtol=2e-2, atol=2e-2, err_msg=name)


def test_auto_takes_the_kernels_on_hopper_where_they_run():
    from jax_prefix_attn.device import CPU, H200, DeviceInfo
    from jax_prefix_attn.mla_kernels import auto_impl
    a100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
    bf = jnp.zeros((4, 1, 16, 512), jnp.bfloat16), jnp.zeros((4, 1, 16, 64), jnp.bfloat16)
    one, two = jnp.zeros((1, 4096, 512), jnp.bfloat16), jnp.zeros((2, 4096, 512), jnp.bfloat16)
    suffix = jnp.zeros((4, 256, 512), jnp.bfloat16)
    assert auto_impl(*bf, one, suffix, H200)[0] == "mgpu"
    assert auto_impl(*bf, two, suffix, H200)[0] == "mgpu"
    assert auto_impl(*bf, jnp.zeros((3, 4096, 512), jnp.bfloat16), suffix, H200) == (
        "reference", "the Mosaic GPU kernels need prefix groups of equally many sequences "
                     "(batch 4 is not a multiple of G=3 prefix groups)")
    f32 = tuple(x.astype(jnp.float32) for x in bf)
    assert auto_impl(*f32, one.astype(jnp.float32), suffix.astype(jnp.float32), H200)[0] == \
        "reference"
    for dev in (CPU, a100):
        impl, why = auto_impl(*bf, one, suffix, dev)
        assert impl == "reference" and "compute capability 9.0+" in why


@pytest.mark.gpu
def test_gpu_auto_prefix_groups_and_gradients():
    """On an H200, ``impl="auto"`` (the kernels) at DeepSeek-V2-Lite widths with 4 prompts of 16
    samples each (the contiguous group layout), against the reference: values, and gradients of
    a loss of ``out`` and ``lse`` in one program."""
    b, g, tq, h, r, dr, p, s = 64, 4, 1, 16, 512, 64, 2048, 256
    rng = np.random.default_rng(5)
    shapes = ((b, tq, h, r), (b, tq, h, dr), (g, p, r), (g, p, dr), (b, s, r), (b, s, dr))
    args = tuple(jnp.asarray(rng.standard_normal(x) * 0.5, jnp.bfloat16) for x in shapes)
    kw = dict(suffix_lengths=jnp.asarray(rng.integers(0, s + 1, b), jnp.int32),
              prefix_lengths=jnp.array([p, p - 100, 1, 777], jnp.int32),
              seq_to_prefix=jnp.arange(b, dtype=jnp.int32) // (b // g), sm_scale=192 ** -0.5,
              return_lse=True)
    w_out = jnp.asarray(rng.standard_normal((b, tq, h, r)), jnp.float32)

    def loss(impl, *a):
        out, lse = jpa.mla_attention(*a, **kw, impl=impl)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse), (out, lse)

    @jax.jit
    def run(*a):
        grad = lambda impl: jax.grad(functools.partial(loss, impl), range(6), has_aux=True)  # noqa: E731
        return grad("auto")(*a), grad("reference")(*a)

    (got, (out, lse)), (want, (ref_out, ref_lse)) = run(*args)
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 2e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=0)
    for a, b_ in zip(got, want):
        a, b_ = np.asarray(a, np.float32), np.asarray(b_, np.float32)
        assert np.linalg.norm(a - b_) / np.linalg.norm(b_) < 2e-2


def test_kernel_path_with_groups_lowers_for_cuda_under_grad():
    """``impl="mgpu"`` with 4 prefix groups at DeepSeek-V2-Lite widths, under
    ``jax.value_and_grad``: lowers for CUDA on the CPU (the per-group prefix launches inside
    ``lax.map``, the suffix kernel, the reference branch and the reference's backward)."""
    from helpers import lower_for_cuda
    s = jax.ShapeDtypeStruct
    b, g, h, r, dr, p, sc = 8, 4, 16, 512, 64, 1024, 128
    avals = (s((b, 1, h, r), jnp.bfloat16), s((b, 1, h, dr), jnp.bfloat16),
             s((g, p, r), jnp.bfloat16), s((g, p, dr), jnp.bfloat16),
             s((b, sc, r), jnp.bfloat16), s((b, sc, dr), jnp.bfloat16))

    def loss(*a):
        out = jpa.mla_attention(*a, suffix_lengths=jnp.full((b,), 100, jnp.int32),
                                prefix_lengths=jnp.full((g,), 900, jnp.int32),
                                seq_to_prefix=jnp.arange(b, dtype=jnp.int32) // 2, impl="mgpu")
        return jnp.sum(out.astype(jnp.float32))

    text = lower_for_cuda(jax.value_and_grad(loss, argnums=tuple(range(6))), *avals)
    assert text.count("mosaic_gpu") >= 2
