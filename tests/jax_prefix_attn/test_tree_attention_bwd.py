"""Backward kernels of tree attention (pallas_kernels.tree_attention_bwd) and the gradients of
``tree_attention`` through them: kernels vs their dense reference, the reference vs float64
NumPy, end-to-end gradients vs the oracle's (autodiff of ``reference.attention`` over the
gathered contexts), NaN poison, grad of grad, the Triton lowering for CUDA; GPU: compiled."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, rel_err
from helpers import TREE_FORESTS as FORESTS
from helpers import poison_outside_tree, random_forest
from helpers import tree_inputs as make_inputs
from jax_prefix_attn import PrefixTree, build_tree_metadata, tree_attention
from jax_prefix_attn.tree_layout import pad_pool, q_sorted, row_tables
from jax_prefix_attn.tree_paths import schedule_forward
from pallas_kernels.tree_attention import CHUNK, NEVER, NTILES, ROW_START
from pallas_kernels.tree_attention_bwd import chunk_item_ranges, tree_grads, tree_grads_reference
from pallas_kernels.tree_attention_tiles import dkv_rows, dq_smem, dq_tile

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _sorted_case(tree, *, tq, hq, hkv, d, seed, dtype=jnp.float32, block_kv=128, chunks_per_item=None,
                 max_block_m=128):
    """Inputs of ``tree_grads`` in the sorted layout, with the merged statistics of the tree part
    alone (no suffix): ``lse`` from the forward, random ``d_out`` and ``dlse``."""
    q, kp, vp, _, _, _ = make_inputs(tree, tq=tq, hq=hq, hkv=hkv, d=d, smax=0, seed=seed, dtype=dtype)
    meta = build_tree_metadata(tree, tq=tq, group=hq // hkv, pool_size=kp.shape[0], block_kv=block_kv,
                               chunks_per_item=chunks_per_item, max_block_m=max_block_m, device=False)
    meta = jax.tree_util.tree_map(jnp.asarray, meta)
    scale = 0.7 / np.sqrt(d)
    rng = np.random.default_rng(seed + 100)
    do = jnp.asarray(rng.standard_normal(q.shape, np.float32).astype(dtype))
    dl = jnp.asarray(rng.standard_normal(q.shape[:3], np.float32))
    args, tables = _sorted_layout(q, kp, vp, do, dl, meta, scale=scale)
    sched = meta.flatten
    static = dict(group=hq // hkv, block_rows=sched.block_rows, block_kv=sched.block_kv, sm_scale=scale)
    return args, tables, static, (q, args[4], args[5], do, dl, meta, scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _sorted_layout(q, kp, vp, do, dl, meta, *, scale):
    """``(q, do, lse, delta, k_pool, v_pool)`` in the sorted-row layout (pool padded to the
    schedule's window) and the flatten schedule's tables, in one compiled program."""
    b, hkv = q.shape[0], kp.shape[1]
    g = q.shape[2] // hkv
    sl = jnp.zeros((b,), jnp.int32)
    sk = jnp.zeros((b, 0, hkv, q.shape[3]), q.dtype)
    out, lse = schedule_forward(q, meta, kp, vp, sk, sk, sl, scale=scale, schedule="flatten", backend="mirror")
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1) - dl
    key, lim = row_tables(meta, sl)
    stat = lambda x: q_sorted(x[..., None], meta, hkv)[..., 0]  # noqa: E731
    sched = meta.flatten
    kp, vp = pad_pool(kp, vp, sched.block_kv)
    args = (q_sorted(q, meta, hkv), q_sorted(do, meta, hkv), stat(lse), stat(delta), kp, vp)
    tables = (sched.items, sched.tok, sched.chunk_start, sched.parts, jnp.repeat(key, g), jnp.repeat(lim, g))
    return args, tables


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _reference(args, tables, meta, *, sm_scale):
    """tree_grads_reference on the same inputs (token tables and sorted rows, no items)."""
    items, tok, cs, parts, key, lim = tables
    return tree_grads_reference(*args, tok, cs, meta.sorted_rows, key, lim, n_rows=parts.shape[0],
                                sm_scale=sm_scale)


CASES = [  # (forest, tq, hq, hkv, d, dtype, block_kv, chunks_per_item)
    (dict(parents=[-1, 0, 0, 2, -1], starts=[40, 3, 90, 100, 130], lengths=[30, 5, 1, 20, 0],
          leaf_of_seq=[1, 3, 3, 2, 4]), 3, 4, 2, 16, jnp.float32, 16, 2),
    ("random0", 1, 8, 2, 32, jnp.float32, 32, None),
    ("random1", 2, 4, 4, 16, jnp.float32, 16, 1),
    ("random2", 1, 8, 1, 64, jnp.bfloat16, 32, None),
    ("random3", 4, 2, 1, 16, jnp.float32, 16, 4),
]


def _tree(spec, seed=0):
    if isinstance(spec, dict):
        return PrefixTree(**spec)
    i = int(spec[-1])
    return random_forest(np.random.default_rng(300 + i + seed), *FORESTS[i])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tree_grads_match_reference_interpret(case):
    spec, tq, hq, hkv, d, dtype, bkv, cpi = CASES[case]
    tree = _tree(spec)
    args, tables, static, extra = _sorted_case(tree, tq=tq, hq=hq, hkv=hkv, d=d, seed=case, dtype=dtype,
                                               block_kv=bkv, chunks_per_item=cpi)
    got = jax.jit(lambda *a: tree_grads(*a, **static, block_k=16, dq_block_k=bkv, interpret=True))(*args, *tables)
    want = _reference(args, tables, extra[5], sm_scale=static["sm_scale"])
    assert got[0].dtype == jnp.float32 and got[1].dtype == got[2].dtype == dtype
    for a, w in zip(got, want):
        assert a.shape == w.shape
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, w) < TOL[dtype], rel_err(a, w)


def test_reference_matches_float64_numpy():
    """The dense reference against the FlashAttention-2 gradient formulas in float64 NumPy over
    each sequence's explicitly gathered context (no tables, no kernels)."""
    tree = PrefixTree.from_nested([[9, [4, 2, 3], 5], 6], seqs_per_leaf=2)
    tq, hq, hkv, d = 2, 4, 2, 16
    args, tables, static, (q, kp, vp, do, dl, meta, scale) = _sorted_case(tree, tq=tq, hq=hq, hkv=hkv, d=d,
                                                                          seed=5, block_kv=16)
    dq, dk, dv = _reference(args, tables, meta, sm_scale=scale)
    g = hq // hkv
    b = tree.num_seqs
    dq = np.asarray(dq).reshape(b, tq, hq, d)
    q64, k64, v64, do64, dl64 = (np.asarray(x, np.float64) for x in (q, kp, vp, do, dl))
    dq_np = np.zeros_like(q64)
    dk_np = np.zeros_like(k64)
    dv_np = np.zeros_like(v64)
    for s in range(b):
        idx = np.asarray(tree.path_token_indices(s))
        n = idx.shape[0]
        for h in range(hq):
            kh = h // g
            sc = q64[s, :, h] @ k64[idx, kh].T * scale                       # [Tq, n]
            mask = np.arange(n)[None, :] <= np.arange(tq)[:, None] + n - tq
            sc = np.where(mask, sc, -np.inf)
            m = sc.max(-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            p = np.exp(sc - m)
            lsum = p.sum(-1, keepdims=True)
            p = np.where(lsum > 0, p / np.where(lsum > 0, lsum, 1), 0)
            o = p @ v64[idx, kh]
            delta = (do64[s, :, h] * o).sum(-1) - np.where(lsum[:, 0] > 0, dl64[s, :, h], 0)
            dp = do64[s, :, h] @ v64[idx, kh].T
            ds = p * (dp - delta[:, None])
            dq_np[s, :, h] = ds @ k64[idx, kh] * scale
            np.add.at(dk_np[:, kh], idx, ds.T @ q64[s, :, h] * scale)
            np.add.at(dv_np[:, kh], idx, p.T @ do64[s, :, h])
    assert rel_err(dq, dq_np) < 1e-5
    assert rel_err(np.asarray(dk)[: kp.shape[0]], dk_np) < 1e-5
    assert rel_err(np.asarray(dv)[: kp.shape[0]], dv_np) < 1e-5


def test_chunk_item_ranges_brute_force():
    for seed in range(4):
        tree = _tree(f"random{seed}", seed=7)
        for cpi in (1, 2, None):
            meta = build_tree_metadata(tree, tq=2, group=2, pool_size=tree.pool_extent + 3, block_kv=16,
                                       chunks_per_item=cpi, device=False)
            items, nc = meta.flatten.items, meta.flatten.tok.shape[0]
            first, count, tile = (np.asarray(x) for x in jax.jit(chunk_item_ranges, static_argnums=1)(
                jnp.asarray(items), nc))
            for c in range(nc):
                readers = [w for w in range(items.shape[0])
                           if items[w, NTILES] > 0 and items[w, CHUNK] <= c < items[w, CHUNK] + items[w, NTILES]]
                assert list(range(first[c], first[c] + count[c])) == readers, (seed, cpi, c)
                if readers:
                    assert tile[c] == c - items[readers[0], CHUNK]
                    # the layout the kernels' affine addressing relies on
                    br, cs = meta.flatten.block_rows, meta.flatten.chunk_start
                    rs = items[readers, ROW_START]
                    assert (rs == rs[0] + br * np.arange(len(readers))).all()
                    w0 = readers[0]
                    c0 = items[w0, CHUNK]
                    for t in range(items[w0, NTILES]):
                        assert cs[c0 + t] == cs[c0] + t * meta.flatten.block_kv
                else:  # padding chunks only
                    assert (np.asarray(meta.flatten.tok[c, 0]) == NEVER).all()


def test_tree_grads_ignore_tokens_outside_the_chunks():
    """NaN in every pool token no chunk holds changes no gradient (and gives them zero)."""
    tree = _tree(CASES[0][0])
    args, tables, static, _ = _sorted_case(tree, tq=3, hq=4, hkv=2, d=16, seed=3, block_kv=16,
                                           chunks_per_item=2)
    q, do, lse, delta, kp, vp = args
    used = np.zeros(kp.shape[0], bool)
    for s, n in zip(tree.starts, tree.lengths):
        used[s:s + n] = True
    kb = jnp.where(used[:, None, None], kp, jnp.nan)
    vb = jnp.where(used[:, None, None], vp, jnp.nan)
    f = jax.jit(lambda *a: tree_grads(*a, **static, interpret=True))
    clean = f(q, do, lse, delta, kp, vp, *tables)
    dirty = f(q, do, lse, delta, kb, vb, *tables)
    for a, w in zip(dirty, clean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    assert (np.asarray(clean[1])[~used] == 0).all() and (np.asarray(clean[2])[~used] == 0).all()


def test_tree_grads_lower_for_cuda():
    """The Triton lowering of both kernels on the CPU (catches primitives Pallas cannot lower)."""
    tree = _tree("random0")
    args, tables, static, _ = _sorted_case(tree, tq=1, hq=8, hkv=2, d=64, seed=1, dtype=jnp.bfloat16,
                                           block_kv=64)
    text = lower_for_cuda(lambda *a: tree_grads(*a, **static), *args, *tables)
    assert "tree_grads_dq" in text and "tree_grads_dkv" in text


def test_tree_grads_split_tiles_match_the_whole_tiles():
    """A small shared-memory budget: dK/dV steps of fewer query vectors than an item's, dQ rows
    over several programs and dQ steps of 32 of a chunk's 64 keys (and, smaller still, 16-column
    dQ slices) give the whole tiles' gradients; the split kernels lower for CUDA."""
    tree = PrefixTree.from_nested([[37, [20, 3, 9], 6], 25], seqs_per_leaf=3)
    args, tables, static, _ = _sorted_case(tree, tq=4, hq=8, hkv=2, d=16, seed=4, block_kv=64)
    block_m = static["block_rows"] * 4
    small = dq_smem(16, 32, 32, 16, jnp.float32)
    assert dkv_rows(block_m, 32, 16, jnp.float32, small) < block_m
    assert dq_tile(block_m, 64, 32, 16, jnp.float32, small) == (16, 32, 32) and block_m > 16
    tiny = 10000                      # dQ in 16-column slices as well
    assert dq_tile(block_m, 64, 32, 16, jnp.float32, tiny) == (16, 16, 16)
    f = jax.jit(lambda *a: (tree_grads(*a, **static, interpret=True),
                            tree_grads(*a, **static, interpret=True, smem_bytes=small),
                            tree_grads(*a, **static, interpret=True, smem_bytes=tiny)))
    whole, split, split16 = f(*args, *tables)
    for a, b, w in zip(split, split16, whole):
        assert np.isfinite(np.asarray(w)).all() and np.abs(np.asarray(w)).max() > 0
        assert rel_err(a, w) < 1e-6, rel_err(a, w)
        assert rel_err(b, w) < 1e-6, rel_err(b, w)
    text = lower_for_cuda(lambda *a: tree_grads(*a, **static, smem_bytes=small), *args, *tables)
    assert "tree_grads_dq" in text and "tree_grads_dkv" in text


def test_tree_grads_validation():
    tree = _tree(CASES[0][0])
    args, tables, static, _ = _sorted_case(tree, tq=1, hq=2, hkv=1, d=16, seed=0, block_kv=16)
    with pytest.raises(ValueError, match="block_k"):
        tree_grads(*args, *tables, **static, block_k=24, interpret=True)
    with pytest.raises(ValueError, match="dq_block_k"):
        tree_grads(*args, *tables, **static, dq_block_k=32, interpret=True)
    with pytest.raises(ValueError, match="delta_hm"):
        tree_grads(*args[:3], args[3][:, :-1], *args[4:], *tables, **static, interpret=True)


# ----------------------------------------------------------------------------- end to end


def _grad_fn(tree, inputs, impl, w_seed=42, **kw):
    """``jit(grad)`` of a random projection of ``(out, lse)`` with respect to ``(q, k_pool,
    v_pool, suffix_k, suffix_v)``."""
    q, kp, vp, sk, sv, sl = inputs
    rng = np.random.default_rng(w_seed)
    w_o = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3], np.float32))

    def f(q, kp, vp, sk, sv):
        o, l = tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl, return_lse=True, **kw)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * w_l)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))


def _grads(tree, inputs, impl, w_seed=42, **kw):
    return _grad_fn(tree, inputs, impl, w_seed, **kw)(*inputs[:5])


def _traced_grads(tree, inputs, impl, **kw):
    """``(jaxpr text, gradients)`` of :func:`_grad_fn`'s program, traced once."""
    traced = _grad_fn(tree, inputs, impl, **kw).trace(*inputs[:5])
    return str(traced.jaxpr), traced.lower().compile()(*inputs[:5])


def _assert_grads_match(got, want):
    """Every gradient finite and within 1e-5 (relative) of the oracle's."""
    for a, w in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, w) < 1e-5, rel_err(a, w)


@pytest.mark.parametrize("seed,tq,hq,hkv,smax", [(0, 1, 4, 2, 9), (1, 3, 4, 1, 6), (2, 2, 2, 2, 0),
                                                 (3, 1, 8, 2, 40)])
def test_gradients_through_kernels_match_reference(seed, tq, hq, hkv, smax):
    tree = _tree(f"random{seed}", seed=11)
    inputs = make_inputs(tree, tq=tq, hq=hq, hkv=hkv, d=16, smax=smax, seed=seed)
    want = _grads(tree, inputs, "reference")
    got = _grads(tree, inputs, "flatten", interpret=True)
    _assert_grads_match(got, want)


def test_gradients_with_overlapping_spans():
    """Two nodes' spans may share pool tokens (a child whose span overlaps its root's, a second
    root reusing the first one's tokens): the backward sums their gradients there (the gather
    path, ``disjoint``, would keep only one), equal to the reference's gradients."""
    for spec in (dict(parents=[-1, 0], starts=[4, 0], lengths=[8, 8], leaf_of_seq=[1]),
                 dict(parents=[-1, 0, 0, -1], starts=[0, 20, 25, 10], lengths=[30, 10, 9, 14],
                      leaf_of_seq=[1, 2, 2, 3, 0])):
        tree = PrefixTree(**spec)
        assert tree.spans_overlap
        inputs = make_inputs(tree, tq=2, hq=4, hkv=2, d=16, smax=5, seed=21)
        want = _grads(tree, inputs, "reference")
        got = _grads(tree, inputs, "flatten", interpret=True)
        _assert_grads_match(got, want)


def test_spans_overlap_and_the_two_pool_reductions_agree():
    """``PrefixTree.spans_overlap`` against a brute-force count, and on a tree without overlap
    the gather (``disjoint=True``) and the scatter-add give the same gradients."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        starts, lengths = rng.integers(0, 12, n), rng.integers(0, 5, n)
        cover = np.zeros(20, int)
        for s0, ln in zip(starts, lengths):
            cover[s0:s0 + ln] += 1
        tree = PrefixTree([-1] * n, starts, lengths, list(range(n)))
        assert tree.spans_overlap == bool((cover > 1).any())
    tree = _tree("random1")
    assert not tree.spans_overlap
    args, tables, static, _ = _sorted_case(tree, tq=2, hq=4, hkv=2, d=16, seed=3, block_kv=16)
    run = lambda disjoint: jax.jit(lambda *a: tree_grads(  # noqa: E731
        *a, **static, interpret=True, disjoint=disjoint))(*args, *tables)
    for a, b in zip(run(True), run(False)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_draft_token_tree_gradients_through_kernels():
    """Speculative-decoding draft trees: the tree part through the kernels, the draft-masked suffix
    part through its pure-JAX state with the merge's weights; equal to the reference's gradients."""
    tree = PrefixTree.from_nested([[21, 6, [4, 3]]], seqs_per_leaf=2)
    q, kp, vp, sk, sv, _ = make_inputs(tree, tq=5, hq=4, hkv=2, d=16, smax=9, seed=12)
    sl = jnp.array([5, 9, 7, 6], jnp.int32)
    parents = jnp.asarray([-1, 0, 0, 1, -1])
    inputs = (q, kp, vp, sk, sv, sl)
    want = _grads(tree, inputs, "reference", draft_parents=parents)
    text, got = _traced_grads(tree, inputs, "flatten", interpret=True, draft_parents=parents)
    _assert_grads_match(got, want)
    assert "tree_grads_dkv" in text


def test_gradients_with_nan_poison_and_empty_rows_interpret():
    """A root of length 0, a sequence that sees nothing (zero gradient), NaN in every pool token
    outside the spans and every suffix token past the lengths: the same gradients as clean."""
    tree = PrefixTree(parents=[-1, 0, -1], starts=[0, 3, 10], lengths=[0, 4, 0], leaf_of_seq=[1, 1, 2, 0])
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=4, seed=4, extra_pool=20)
    sl = jnp.array([2, 4, 0, 3], jnp.int32)
    (kb, vb, skb, svb), used = poison_outside_tree(tree, kp, vp, sk, sv, sl)
    want = _grads(tree, (q, kp, vp, sk, sv, sl), "reference")
    got = _grads(tree, (q, kb, vb, skb, svb, sl), "flatten", interpret=True)
    for a, w in zip(got, want):
        a = np.asarray(a)
        assert np.isfinite(a[used] if a.shape[0] == kp.shape[0] else a).all()
    assert rel_err(got[0], want[0]) < 1e-5 and (np.asarray(got[0][2]) == 0).all()
    for i in (1, 2):
        assert rel_err(np.asarray(got[i])[used], np.asarray(want[i])[used]) < 1e-5


def test_kernel_backward_is_used_and_mirror_backward():
    tree = _tree("random1", seed=2)
    inputs = make_inputs(tree, tq=2, hq=4, hkv=2, d=16, smax=5, seed=8)
    text, kern = _traced_grads(tree, inputs, "flatten", interpret=True)
    assert "tree_grads_dkv" in text and "tree_grads_dq" in text
    text, mirror = _traced_grads(tree, inputs, "flatten", interpret=True, backward="mirror")
    assert "tree_grads_dkv" not in text
    for a, w in zip(kern, mirror):
        assert rel_err(a, w) < 1e-5
    with pytest.raises(ValueError, match="backward"):
        _grads(tree, inputs, "flatten", interpret=True, backward="bogus")


def test_grad_of_grad_through_kernel_backward():
    tree = PrefixTree.from_nested([[9, [4, 2, 3], 5], 6], seqs_per_leaf=2)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=2, hq=2, hkv=1, d=16, smax=4, seed=6)

    def gg(impl, interpret=False):
        def inner(q, kp):
            return jnp.sum(tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl,
                                          interpret=interpret) ** 2)

        def outer(q, kp):
            gq, gk = jax.grad(inner, argnums=(0, 1))(q, kp)
            return jnp.sum(gq * q) + jnp.sum(jnp.sin(gk))
        return jax.jit(jax.grad(outer, argnums=(0, 1)))(q, kp)

    for a, w in zip(gg("flatten", interpret=True), gg("reference")):
        assert rel_err(a, w) < 1e-5, rel_err(a, w)


# ----------------------------------------------------------------------------- GPU (compiled Pallas)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_tree_grads_match_reference(dtype):
    for case in range(1, len(CASES)):
        spec, tq, hq, hkv, d, _, bkv, cpi = CASES[case]
        tree = _tree(spec)
        args, tables, static, extra = _sorted_case(tree, tq=tq, hq=hq, hkv=hkv, d=max(d, 64), seed=case,
                                                   dtype=dtype, block_kv=max(bkv, 64), chunks_per_item=cpi)
        got = jax.jit(lambda *a: tree_grads(*a, **static))(*args, *tables)
        want = _reference(args, tables, extra[5], sm_scale=static["sm_scale"])
        for a, w in zip(got, want):
            assert np.isfinite(np.asarray(a)).all()
            assert rel_err(a, w) < TOL[dtype], (case, rel_err(a, w))


@pytest.mark.gpu
def test_gpu_tree_gradients_every_schedule():
    """Compiled forward (each schedule) + kernel backward vs the oracle's gradients (bf16, Llama
    heads), on an APPS-like tree, a tree-of-thought-like one and ``Tq = 4``."""
    rng = np.random.default_rng(5)
    for forest, per_leaf, smax, tq in (([[700] + [int(x) for x in rng.integers(30, 200, 6)]], 12, 130, 1),
                                       ([[600] + [[int(x)] + [int(y) for y in rng.integers(50, 300, 4)]
                                                  for x in rng.integers(50, 300, 3)]], 1, 64, 1),
                                       ([[300, [40, 20, 7], 90]], 3, 33, 4)):
        tree = PrefixTree.from_nested(forest, seqs_per_leaf=per_leaf)
        inputs = make_inputs(tree, tq=tq, hq=32, hkv=8, d=128, smax=smax, seed=2, dtype=jnp.bfloat16)
        want = _grads(tree, inputs, "reference")
        for impl in ("flatten", "levelwise", "nodes") + (("hybrid",) if tq == 1 else ()):
            got = _grads(tree, inputs, impl)
            for a, w in zip(got, want):
                assert np.isfinite(np.asarray(a, np.float32)).all()
                assert rel_err(a, w) < 2e-2, (impl, rel_err(a, w))


@pytest.mark.gpu
def test_gpu_draft_tree_gradients():
    """Compiled: a speculative token tree of 8 drafts over a two-level tree (bf16, Llama heads)."""
    tree = PrefixTree.from_nested([[500, 130, [70, 40, 20]]], seqs_per_leaf=4)
    q, kp, vp, sk, sv, _ = make_inputs(tree, tq=8, hq=32, hkv=8, d=128, smax=40, seed=3, dtype=jnp.bfloat16)
    sl = jnp.asarray(np.random.default_rng(3).integers(8, 41, tree.num_seqs), jnp.int32)
    parents = jnp.asarray([-1, 0, 0, 1, 1, 2, -1, 6])
    inputs = (q, kp, vp, sk, sv, sl)
    want = _grads(tree, inputs, "reference", draft_parents=parents)
    got = _grads(tree, inputs, "flatten", draft_parents=parents)
    for a, w in zip(got, want):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        assert rel_err(a, w) < 2e-2, rel_err(a, w)


def test_gpu_lowering_of_the_gradient_has_no_xla_loops():
    """The GPU program of a tree gradient (lowered for CUDA on the CPU) is the five Pallas kernels
    plus loop-free XLA glue: a ``while`` there (e.g. ``jnp.searchsorted``'s default binary
    search) would run as many small dependent device steps per call."""
    import re
    tree = PrefixTree.from_nested([[400, 70, [90, 30, 50]]], seqs_per_leaf=4)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=8, hkv=2, d=64, smax=60, seed=1, dtype=jnp.bfloat16)
    f = lambda q, kp, vp, sk, sv: jnp.sum(tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,  # noqa: E731
                                                         impl="flatten", platform="gpu").astype(jnp.float32))
    text = lower_for_cuda(jax.grad(f, argnums=(0, 1, 2, 3, 4)), q, kp, vp, sk, sv)
    assert "tree_grads_dkv" in text and "tree_grads_dq" in text
    assert not re.findall(r"stablehlo\.while", text)
