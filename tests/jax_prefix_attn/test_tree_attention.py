"""tree_attention vs reference.attention over explicitly concatenated paths (CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from helpers import TREE_FORESTS as FORESTS
from helpers import concat_oracle, poison_outside_tree, random_forest
from helpers import tree_inputs as make_inputs
from jax_prefix_attn import PrefixTree, build_tree_metadata, tree_attention
from jax_prefix_attn.tree_attention import auto_path, use_shallow
from jax_prefix_attn.tree_metadata import SHALLOW_MAX_TOKENS
from jax_prefix_attn.tree_paths import shallow_attention, single_level_attention


def run(tree, args, impl, **kw):
    q, kp, vp, sk, sv, sl = args
    f = jax.jit(lambda q, kp, vp, sk, sv, sl: tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,
                                                             impl=impl, return_lse=True, **kw))
    return f(q, kp, vp, sk, sv, sl)


def check_close(out, lse, ref_out, ref_lse, tol):
    assert not np.any(np.isnan(np.asarray(out, np.float32)))
    assert not np.any(np.isnan(np.asarray(lse)))
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
    fin = np.isfinite(np.asarray(ref_lse))
    assert rel_err(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < tol


# (n_trees, max_depth, max_branch, max_len): depth 1-4, branching 1-16, lengths 1-700.
FORESTS = [(3, 1, 0, 700), (2, 2, 16, 30), (2, 3, 4, 200), (1, 4, 2, 90)]


@pytest.mark.parametrize("seed, tq", [(0, 1), (1, 4), (2, 1), (3, 4)])
def test_parity_random_forests(seed, tq):
    rng = np.random.default_rng(100 + seed)
    n_trees, depth, branch, max_len = FORESTS[seed]
    tree = random_forest(rng, n_trees, depth, branch, max_len)
    args = make_inputs(tree, tq=tq, hq=4, hkv=2, d=16, smax=9, seed=seed)
    ref_out, ref_lse = concat_oracle(tree, *args)
    impls = [("flatten", False), ("levelwise", False)] if seed in (1, 2) else [("flatten", False)]
    if tq == 1:  # the Pallas kernels in interpret mode: tree partials, then the decode suffix
        impls.append(("flatten", True))  # kernel merging them in its epilogue
    f = jax.jit(lambda q, kp, vp, sk, sv, sl: [tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl,
                                                              interpret=interpret, return_lse=True)
                                               for impl, interpret in impls])  # one program
    for out, lse in f(*args):
        check_close(out, lse, ref_out, ref_lse, 1e-5)


def test_length_one_nodes_and_block_size_16():
    # Speculative-style: long root, many single-token leaves, chunk boundaries inside nodes.
    tree = PrefixTree.from_nested([[37] + [1] * 12, [5, 1, [1, 1, 1]]])
    args = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=3, seed=3)
    ref_out, ref_lse = concat_oracle(tree, *args)
    q, kp, vp, sk, sv, sl = args
    meta = build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0], block_kv=16, chunks_per_item=4)
    assert dict(build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0], block_kv=16, chunks_per_item=4,
                                    device=False).flatten.stats)["chunks_per_item"] == 4
    for impl in ("flatten", "nodes"):
        out, lse = jax.jit(lambda q, m, kp, vp, sk, sv, sl, impl=impl: tree_attention(
            q, m, kp, vp, sk, sv, suffix_lengths=sl, impl=impl, return_lse=True))(q, meta, kp, vp, sk, sv, sl)
        check_close(out, lse, ref_out, ref_lse, 1e-5)


def test_pallas_interpret_kernels_flatten_and_node_mode_with_nan_poison():
    tree = PrefixTree(parents=[-1, 0, 0, 2, -1], starts=[40, 3, 90, 100, 130], lengths=[30, 5, 1, 20, 0],
                      leaf_of_seq=[1, 3, 3, 2, 4])
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=4, hq=4, hkv=2, d=16, smax=6, seed=11, extra_pool=9)
    ref_out, ref_lse = concat_oracle(tree, q, kp, vp, sk, sv, sl)
    bad, _ = poison_outside_tree(tree, kp, vp, sk, sv, sl)
    meta16 = build_tree_metadata(tree, tq=4, group=2, pool_size=kp.shape[0], block_kv=16, chunks_per_item=2)
    out, lse = jax.jit(lambda m, q, kp, vp, sk, sv, sl: tree_attention(
        q, m, kp, vp, sk, sv, suffix_lengths=sl, impl="flatten", interpret=True, return_lse=True))(meta16, q, *bad, sl)
    check_close(out, lse, ref_out, ref_lse, 1e-5)
    meta = build_tree_metadata(tree, tq=4, group=2, pool_size=kp.shape[0])
    out, lse = jax.jit(lambda m, q, kp, vp, sk, sv, sl: tree_attention(
        q, m, kp, vp, sk, sv, suffix_lengths=sl, sm_scale=0.25, impl="levelwise", interpret=True,
        return_lse=True))(meta, q, *bad, sl)
    check_close(out, lse, ref_out, ref_lse, 1e-5)


def test_hydragen_apps_shape():
    """Few-shot root shared by all, 8 problems, 16 samples each (Hydragen section 4.4)."""
    rng = np.random.default_rng(0)
    problems = [int(x) for x in rng.integers(5, 40, size=8)]
    tree = PrefixTree.from_nested([[96] + problems], seqs_per_leaf=16)
    assert tree.num_seqs == 128 and tree.num_nodes == 9
    args = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=8, seed=5)
    ref_out, ref_lse = concat_oracle(tree, *args)
    out, lse = run(tree, args, "auto")
    check_close(out, lse, ref_out, ref_lse, 1e-5)


def test_single_level_forest_through_shared_prefix_path():
    tree = PrefixTree(parents=[-1, -1], starts=[30, 2], lengths=[17, 25], leaf_of_seq=[0, 1, 1, 0, 1])
    args = make_inputs(tree, tq=2, hq=4, hkv=2, d=16, smax=5, seed=8)
    ref_out, ref_lse = concat_oracle(tree, *args)
    q, kp, vp, sk, sv, sl = args
    meta = build_tree_metadata(tree, tq=2, group=2, pool_size=kp.shape[0])
    assert meta.single_level and meta.root_pad == 32
    out, lse = jax.jit(lambda m, *a: single_level_attention(a[0], m, *a[1:], scale=0.25, shared_impl="reference"))(
        meta, q, kp, vp, sk, sv, sl)
    check_close(out, lse, ref_out, ref_lse, 1e-5)


def draft_oracle(tree, q, kp, vp, sk, sv, sl, parents_bt):
    """numpy oracle for draft token trees: query t sees the path, the committed suffix and its own
    ancestors (and itself) among the last Tq suffix tokens."""
    q, kp, vp, sk, sv = (np.asarray(x, np.float64) for x in (q, kp, vp, sk, sv))
    b, tq, hq, d = q.shape
    g = hq // kp.shape[1]
    outs = np.zeros_like(q)
    for i in range(b):
        idx = tree.path_token_indices(i)
        s = int(sl[i])
        k = np.concatenate([kp[idx], sk[i, :s]])
        v = np.concatenate([vp[idx], sv[i, :s]])
        first = k.shape[0] - tq
        for t in range(tq):
            anc, u = set(), t
            while u != -1:
                anc.add(u)
                u = int(parents_bt[i][u])
            vis = np.array([j < first or (j - first) in anc for j in range(k.shape[0])])
            for h in range(hq):
                sc = k[vis, h // g] @ q[i, t, h] / np.sqrt(d)
                p = np.exp(sc - sc.max())
                outs[i, t, h] = (p / p.sum()) @ v[vis, h // g]
    return outs


def test_draft_token_trees_for_speculative_decoding():
    tree = PrefixTree.from_nested([[21, 6, [4, 3]]], seqs_per_leaf=2)
    q, kp, vp, sk, sv, _ = make_inputs(tree, tq=5, hq=4, hkv=2, d=16, smax=9, seed=12)
    sl = jnp.array([5, 9, 7, 6], jnp.int32)
    parents = np.array([-1, 0, 0, 1, -1])                     # two branches from the context
    want = draft_oracle(tree, q, kp, vp, sk, sv, sl, np.broadcast_to(parents, (4, 5)))
    f = jax.jit(lambda q, kp, vp, sk, sv, sl, dp: [tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,
                                                                  impl=impl, draft_parents=dp)
                                                   for impl in ("flatten", "reference")])
    for out in f(q, kp, vp, sk, sv, sl, jnp.asarray(parents)):
        assert rel_err(out, want) < 1e-5
    # A chain of drafts is ordinary causal decoding.
    chain = jnp.asarray([[-1, 0, 1, 2, 3]] * 4)
    out_chain = f(q, kp, vp, sk, sv, sl, chain)[0]
    assert rel_err(out_chain, concat_oracle(tree, q, kp, vp, sk, sv, sl)[0]) < 1e-5
    g = jax.jit(jax.grad(lambda q: jnp.sum(tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,
                                                          impl="flatten", draft_parents=jnp.asarray(parents)))))(q)
    assert np.all(np.isfinite(np.asarray(g)))
    with pytest.raises(ValueError, match="earlier draft"):
        tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, draft_parents=[-1, 0, 3, 1, -1])
    with pytest.raises(ValueError, match="suffix_lengths must be >= 5"):
        tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl - 1, draft_parents=parents)
    with pytest.raises(ValueError, match="draft_parents must have shape"):
        tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, draft_parents=parents[:3])


def test_bf16_and_sm_scale():
    tree = PrefixTree.from_nested([[50, [20, 3, 4], 9], [30, 2]], seqs_per_leaf=2)
    args = make_inputs(tree, tq=4, hq=8, hkv=2, d=32, smax=10, seed=2, dtype=jnp.bfloat16)
    q, kp, vp, sk, sv, sl = args
    ref_out, ref_lse = concat_oracle(tree, *args)
    out, lse = run(tree, args, "levelwise", sm_scale=0.3)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref_s, ref_ls = concat_oracle(tree, *args, sm_scale=0.3)
    check_close(out, lse, ref_s, ref_ls, 2e-2)
    assert rel_err(ref_s, ref_out) > 1e-2  # the scale matters


def test_gradients_match_reference():
    tree = PrefixTree.from_nested([[9, [4, 2, 3], 5], 6], seqs_per_leaf=2)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=2, hq=4, hkv=2, d=16, smax=5, seed=9)
    rng = np.random.default_rng(42)
    w_o = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3], np.float32))

    def loss(impl):
        def f(q, kp, vp, sk, sv):
            o, l = tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl, return_lse=True)
            return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * w_l), (o, l)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, kp, vp, sk, sv)

    g_ref, (o_ref, l_ref) = loss("reference")
    check_close(o_ref, l_ref, *concat_oracle(tree, q, kp, vp, sk, sv, sl), 1e-5)  # the gather path itself
    g, (o, l) = loss("levelwise")
    check_close(o, l, o_ref, l_ref, 1e-5)
    for a, r in zip(g, g_ref):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, r) < 1e-5


def test_jit_with_metadata_argument_no_retrace_when_suffix_grows():
    tree = PrefixTree.from_nested([[20, 5, [6, 2, 1]]], seqs_per_leaf=3)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=6, seed=1)
    meta = build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0])
    traces = []

    @jax.jit
    def step(meta, q, sl):
        traces.append(1)
        return tree_attention(q, meta, kp, vp, sk, sv, suffix_lengths=sl, impl="flatten")

    for s in range(3):
        lens = jnp.minimum(sl + s, 6)
        out = step(meta, q, lens)
        ref_out, _ = concat_oracle(tree, q, kp, vp, sk, sv, lens, lmax=64)
        assert rel_err(out, ref_out) < 1e-5
    assert len(traces) == 1


def test_empty_rows_and_nan_poison_outside_spans():
    # Root of length 0 and a sequence with no suffix: it sees nothing (lse -inf, out 0).
    tree = PrefixTree(parents=[-1, 0, -1], starts=[0, 3, 10], lengths=[0, 4, 0], leaf_of_seq=[1, 1, 2, 0])
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=4, seed=4, extra_pool=20)
    sl = jnp.array([2, 4, 0, 3], jnp.int32)
    ref_out, ref_lse = concat_oracle(tree, q, kp, vp, sk, sv, sl)
    assert not np.isfinite(ref_lse[2]).any()
    (kp_bad, vp_bad, sk_bad, sv_bad), used = poison_outside_tree(tree, kp, vp, sk, sv, sl)

    def f(q, kp, vp):
        o, l = tree_attention(q, tree, kp, vp, sk_bad, sv_bad, suffix_lengths=sl, impl="flatten", return_lse=True)
        return jnp.sum(o), (o, l)
    g, (out, lse) = jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, kp_bad, vp_bad)
    check_close(out, lse, ref_out, ref_lse, 1e-5)
    assert np.all(np.asarray(out[2]) == 0)
    assert np.all(np.isfinite(np.asarray(g[0])))
    assert np.all(np.isfinite(np.asarray(g[1])[used])) and np.all(np.isfinite(np.asarray(g[2])[used]))
    assert np.all(np.asarray(g[0][2]) == 0)


def test_error_paths():
    tree = PrefixTree.from_nested([[6, 2, 3]], seqs_per_leaf=2)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=2, hkv=1, d=16, smax=3, seed=0)
    call = lambda **kw: tree_attention(**{**dict(q=q, tree=tree, k_pool=kp, v_pool=vp, suffix_k=sk,  # noqa: E731
                                                 suffix_v=sv, suffix_lengths=sl), **kw})
    with pytest.raises(ValueError, match="impl"):
        call(impl="fast")
    with pytest.raises(ValueError, match="batch 3"):
        call(q=jnp.zeros((3, 1, 2, 16)))
    with pytest.raises(ValueError, match="outside the pool"):
        call(k_pool=kp[:10], v_pool=vp[:10])
    with pytest.raises(ValueError, match="k_pool and v_pool"):
        call(v_pool=vp[:-1])
    with pytest.raises(TypeError, match="v_pool"):
        call(v_pool=vp.astype(jnp.bfloat16))
    kp2 = jnp.zeros((kp.shape[0], 2, 16))
    sk2 = jnp.zeros((4, 3, 2, 16))
    with pytest.raises(ValueError, match="heads_q must be a multiple"):
        call(q=jnp.zeros((4, 1, 3, 16)), k_pool=kp2, v_pool=kp2, suffix_k=sk2, suffix_v=sk2)
    with pytest.raises(ValueError, match="suffix_lengths must be <= 3"):
        call(suffix_lengths=jnp.array([1, 2, 4, 0], jnp.int32))
    with pytest.raises(ValueError, match="suffix_k must have batch"):
        call(suffix_k=sk[:2], suffix_v=sv[:2])
    with pytest.raises(TypeError, match="tree must be"):
        call(tree=[0, 1])
    meta = build_tree_metadata(tree, tq=2, group=2, pool_size=kp.shape[0])
    with pytest.raises(ValueError, match="rebuild"):
        call(tree=meta)
    with pytest.raises(TypeError, match="PrefixTree"):
        call(tree=build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0]), impl="reference")
    with pytest.raises(ValueError, match="rank 4"):
        call(q=q[0])


# ----------------------------------------------------------------------------- GPU (compiled Pallas)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol, tq, seeds", [(jnp.float32, 1e-5, 4, (0, 1, 2, 3)),
                                                    (jnp.float32, 1e-5, 1, (2,)),
                                                    (jnp.bfloat16, 2e-2, 1, (0, 1, 2, 3)),
                                                    (jnp.bfloat16, 2e-2, 4, (1,))])
def test_gpu_parity_random_forests(dtype, tol, tq, seeds):
    for seed in seeds:
        rng = np.random.default_rng(200 + seed)
        tree = random_forest(rng, *FORESTS[seed])
        args = make_inputs(tree, tq=tq, hq=8, hkv=2, d=64, smax=37, seed=seed, dtype=dtype)
        ref_out, ref_lse = concat_oracle(tree, *args)
        q, kp, vp, sk, sv, sl = args
        f = jax.jit(lambda q, kp, vp, sk, sv, sl: [tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,
                                                                  impl=impl, return_lse=True)
                                                   for impl in ("flatten", "levelwise", "nodes")
                                                   + (("hybrid",) if tq == 1 else ())])
        for out, lse in f(*args):
            check_close(out, lse, ref_out, ref_lse, tol)


@pytest.mark.gpu
def test_gpu_llama_heads_apps_like_and_speculative():
    rng = np.random.default_rng(3)
    for forest, per_leaf, smax in (([[700] + [int(x) for x in rng.integers(30, 200, 6)]], 24, 130),
                                   ([[1500] + [1] * 64], 1, 0),                # shallow (auto)
                                   ([[1000] + [1] * 20 + [[3, 2, 5]]], 3, 40),   # shallow + suffix
                                   ([[1500] + [[int(x)] + [int(y) for y in rng.integers(50, 300, 8)]
                                               for x in rng.integers(50, 300, 5)]], 1, 64)):  # ToT-like
        tree = PrefixTree.from_nested(forest, seqs_per_leaf=per_leaf)
        args = make_inputs(tree, tq=1, hq=32, hkv=8, d=128, smax=smax, seed=1, dtype=jnp.bfloat16)
        ref_out, ref_lse = concat_oracle(tree, *args)
        for impl in ("flatten", "levelwise", "nodes", "hybrid", "auto"):
            out, lse = run(tree, args, impl)
            check_close(out, lse, ref_out, ref_lse, 2e-2)


@pytest.mark.gpu
def test_gpu_nan_poison_outside_spans():
    tree = PrefixTree(parents=[-1, 0, 0], starts=[200, 5, 140], lengths=[100, 33, 1],
                      leaf_of_seq=[1, 1, 2, 0])
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=2, hq=4, hkv=2, d=64, smax=40, seed=4, extra_pool=50)
    ref_out, ref_lse = concat_oracle(tree, q, kp, vp, sk, sv, sl)
    bad, _ = poison_outside_tree(tree, kp, vp, sk, sv, sl)
    for impl in ("flatten", "levelwise"):
        out, lse = run(tree, (q, *bad, sl), impl)
        check_close(out, lse, ref_out, ref_lse, 1e-5)


@pytest.mark.parametrize("smax", [0, 7])
def test_shallow_path_in_interpret_mode(smax):
    """Speculative-style forest (two roots, single-token and short leaves, several sequences on
    some): roots through the shared-prefix path, path tokens below the roots gathered per sequence,
    the real suffix merged by the decode suffix kernel; against the concatenation oracle."""
    tree = PrefixTree.from_nested([[70] + [1] * 6 + [[2, 1, 3]], [40, 5, 1]], seqs_per_leaf=2)
    args = make_inputs(tree, tq=1, hq=4, hkv=2, d=16, smax=smax, seed=21)
    q, kp, vp, sk, sv, sl = args
    meta = build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0])
    assert not meta.single_level and meta.shallow_pad == 16 and use_shallow(meta, q)
    below = np.asarray(meta.shallow_len)
    assert below.max() == 5 and below.min() == 1        # [2, 1, 3]: a 2-token node with leaves 1 and 3
    for i in range(tree.num_seqs):                      # gathered indices are the path below the root
        root_len = tree.lengths[tree.path(i)[0]]
        np.testing.assert_array_equal(np.asarray(meta.shallow_idx)[i, :below[i]],
                                      tree.path_token_indices(i)[root_len:])
    ref_out, ref_lse = concat_oracle(tree, *args)
    out, lse = jax.jit(lambda q, kp, vp, sk, sv, sl: shallow_attention(
        q, jax.tree_util.tree_map(jnp.asarray, meta), kp, vp, sk, sv, sl, scale=16 ** -0.5,
        shared_impl="shared", interpret=True))(*args)
    check_close(out, lse, ref_out, ref_lse, 1e-5)
    # not shallow: a path with more than SHALLOW_MAX_TOKENS tokens below its root
    deep = PrefixTree.from_nested([[30, [SHALLOW_MAX_TOKENS, 1], 2]])
    assert build_tree_metadata(deep, tq=1, group=2, pool_size=deep.pool_extent).shallow_pad == 0


HYBRID_FORESTS = [
    # tree-of-thought-like: one root, 2 levels of branching, one sequence per leaf
    ([[50, [20, 9, 30], [11, 40, 1, 7]]], 1),
    # APPS-like: root, problems with several samples each (no exclusive node)
    ([[60, 13, 25, 8]], 3),
    # two roots (no root launch), mixed: shared inner nodes, exclusive leaves, length-1 nodes
    ([[33, [5, 1, 17], 2], [21, 1, [4, 12]]], 1),
]


@pytest.mark.parametrize("case", range(len(HYBRID_FORESTS)))
@pytest.mark.parametrize("smax", [0, 9])
def test_hybrid_schedule_in_interpret_mode_with_nan_poison(case, smax):
    """Root through the shared path's prefix kernel, other shared nodes through the tree kernel,
    each sequence's exclusive node streamed in place by the decode suffix kernel with its suffix;
    NaN everywhere no sequence may look."""
    forest, per_leaf = HYBRID_FORESTS[case]
    tree = PrefixTree.from_nested(forest, seqs_per_leaf=per_leaf)
    if case == 2:  # also a sequence attached to a shared inner node (node 1)
        tree = PrefixTree(parents=tree.parents, starts=tree.starts, lengths=tree.lengths,
                          leaf_of_seq=list(tree.leaf_of_seq) + [1])
    args = make_inputs(tree, tq=1, hq=4, hkv=2, d=16, smax=smax, seed=30 + case)
    q, kp, vp, sk, sv, sl = args
    meta = build_tree_metadata(tree, tq=1, group=2, pool_size=kp.shape[0], device=False)
    leaf = np.asarray(tree.leaf_of_seq)
    info = tree.info
    count = np.array([np.sum((info["tin"][leaf] >= info["tin"][u]) & (info["tin"][leaf] < info["tout"][u]))
                      for u in range(tree.num_nodes)])
    for b in range(tree.num_seqs):                   # excl_span: the attachment node iff only b reads it
        u = leaf[b]
        want = (tree.starts[u], tree.lengths[u]) if count[u] == 1 else (0, 0)
        assert tuple(np.asarray(meta.excl_span)[b]) == want
    assert meta.hybrid_root == (case != 2)
    ref_out, ref_lse = concat_oracle(tree, *args)
    bad, _ = poison_outside_tree(tree, kp, vp, sk, sv, sl)
    out, lse = run(tree, (q, *bad, sl), "hybrid", interpret=True)
    check_close(out, lse, ref_out, ref_lse, 1e-5)
    if case == 0:  # gradients (custom_vjp: the flatten mirror) match the oracle's
        def loss(impl, interpret=False):
            def f(q, kp, vp, sk, sv):
                o = tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl, interpret=interpret)
                return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
            return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, kp, vp, sk, sv)
        for g, r in zip(loss("hybrid", True), loss("reference")):
            assert rel_err(g, r) < 1e-5


def test_hybrid_errors():
    tree = PrefixTree.from_nested([[10, 3, 4]])
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=2, hq=4, hkv=2, d=16, smax=3, seed=1)
    with pytest.raises(ValueError, match="seq_q == 1"):
        tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl="hybrid", interpret=True)
    with pytest.raises(ValueError, match="needs a GPU"):
        tree_attention(q[:, :1], tree, kp, vp, sk, sv, suffix_lengths=sl, impl="hybrid", platform="cpu")


@pytest.mark.parametrize("flash_fallback", [False, True])
def test_shallow_path_gradients_interpret(flash_fallback):
    """The shallow decode path (roots through shared-prefix attention, the rest merged by the
    decode suffix kernel) is differentiable: its suffix merge has a kernel backward (the suffix
    part with the merged statistics, the incoming state through the merge weights; the flash
    backward when the rows exceed one tile: 256 query heads per kv head, whose roots then go
    through the shared-prefix reference), equal to the reference path's gradients.  (One
    sequence per leaf with 256 heads: the interpreted flash backward's time grows with B.)"""
    from pallas_kernels.suffix_attention_bwd import suffix_grads_supported
    hq, hkv = (256, 1) if flash_fallback else (4, 2)
    assert suffix_grads_supported(1, hq, hkv, 16) != flash_fallback
    tree = PrefixTree.from_nested([[9, [4, 2, 3], 5], 6], seqs_per_leaf=1 if flash_fallback else 2)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=hq, hkv=hkv, d=16, smax=5, seed=9)
    sl = sl.at[0].set(0)  # a sequence without suffix keys
    meta = build_tree_metadata(tree, tq=1, group=hq // hkv, pool_size=kp.shape[0])
    assert meta.shallow_pad > 0
    rng = np.random.default_rng(3)
    w_o = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3], np.float32))

    def loss(run):
        def f(q, kp, vp, sk, sv):
            o, l = run(q, kp, vp, sk, sv)
            return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * w_l)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, kp, vp, sk, sv)

    shared_impl = "reference" if flash_fallback else "shared"
    got = loss(lambda *a: shallow_attention(a[0], meta, *a[1:], sl, scale=0.25, shared_impl=shared_impl,
                                            interpret=True))
    want = loss(lambda *a: tree_attention(a[0], tree, *a[1:], suffix_lengths=sl, sm_scale=0.25,
                                          impl="reference", return_lse=True))
    for a, r in zip(got, want):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, r) < 1e-5, rel_err(a, r)


@pytest.mark.gpu
def test_gpu_auto_gradients_shallow_tree():
    """On the GPU ``impl="auto"`` takes the shallow path for this decode step; its gradients (the
    suffix merge's kernel backward) match the reference path's."""
    tree = PrefixTree.from_nested([[300, [4, 2, 3], 5], 200], seqs_per_leaf=8)
    q, kp, vp, sk, sv, sl = make_inputs(tree, tq=1, hq=32, hkv=8, d=128, smax=64, seed=4)
    meta = build_tree_metadata(tree, tq=1, group=4, pool_size=kp.shape[0])
    assert auto_path(meta, q, sk) == "shallow"
    w = jax.random.normal(jax.random.PRNGKey(5), q.shape)

    def grads(impl):
        def f(q, kp, vp, sk, sv):
            return jnp.sum(tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl,
                                          impl=impl) * w)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, kp, vp, sk, sv)
    for a, r in zip(grads("auto"), grads("reference")):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_err(a, r) < 1e-4, rel_err(a, r)
