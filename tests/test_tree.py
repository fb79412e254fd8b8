"""PrefixTree construction, validation and device metadata (host-side; fast)."""
import jax
import numpy as np
import pytest

from jax_prefix_attn import PrefixTree
from jax_prefix_attn.tree import (CHUNK, KV_START, NEVER, NTILES, ROW_START, TreeMetadata,
                                  build_tree_metadata, schedule_cost)


def random_forest(rng, n_trees, max_depth, max_branch, max_len, seqs_per_leaf=(1, 3)):
    """Random forest as a parent list (nodes shuffled so parents may follow children)."""
    parents, lengths = [], []

    def grow(parent, depth):
        me = len(parents)
        parents.append(parent)
        lengths.append(int(rng.integers(1, max_len + 1)))
        if depth + 1 < max_depth:
            for _ in range(int(rng.integers(0, max_branch + 1))):
                grow(me, depth + 1)

    for _ in range(n_trees):
        grow(-1, 0)
    n = len(parents)
    perm = rng.permutation(n)                 # new index of old node i is inv[i]
    inv = np.argsort(perm)
    parents = [(-1 if parents[o] < 0 else int(inv[parents[o]])) for o in perm]
    lengths = [lengths[o] for o in perm]
    has_child = np.zeros(n, bool)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    leaf_of_seq = []
    for u in range(n):
        if not has_child[u]:
            leaf_of_seq += [u] * int(rng.integers(seqs_per_leaf[0], seqs_per_leaf[1] + 1))
        elif rng.random() < 0.2:  # sequences may also hang from inner nodes
            leaf_of_seq.append(u)
    leaf_of_seq = list(rng.permutation(leaf_of_seq))
    return PrefixTree.from_parents(parents, lengths, leaf_of_seq)


def test_from_nested_layout_and_paths():
    t = PrefixTree.from_nested([[10, [3, 1, 2], 4], 7], seqs_per_leaf=2)
    # Depth-first layout: root(10) a(3) a1(1) a2(2) b(4) | root2(7)
    assert t.parents == (-1, 0, 1, 1, 0, -1)
    assert t.lengths == (10, 3, 1, 2, 4, 7)
    assert t.starts == (0, 10, 13, 14, 16, 20)
    assert t.leaf_of_seq == (2, 2, 3, 3, 4, 4, 5, 5)
    assert t.path(2) == [0, 1, 3]
    np.testing.assert_array_equal(t.path_token_indices(2), list(range(0, 13)) + [14, 15])
    np.testing.assert_array_equal(t.info["seq_path_len"], [14, 14, 15, 15, 14, 14, 7, 7])
    assert t.pool_extent == 27
    assert hash(t) == hash(PrefixTree.from_nested([[10, [3, 1, 2], 4], 7], seqs_per_leaf=2))


def test_from_parents_parent_after_child_and_explicit_starts():
    # node 0's parent is node 2 (listed later): fine.
    t = PrefixTree(parents=[2, 2, -1], starts=[100, 5, 0], lengths=[3, 4, 5], leaf_of_seq=[0, 1, 1])
    assert t.path(0) == [2, 0]
    np.testing.assert_array_equal(t.path_token_indices(0), [0, 1, 2, 3, 4, 100, 101, 102])
    t2 = PrefixTree.from_parents([2, 2, -1], [3, 4, 5])
    assert t2.starts == (5, 8, 0)            # depth-first: 2, 0, 1
    assert sorted(t2.leaf_of_seq) == [0, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(parents=[1, 0], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[0]), "cycle"),
    (dict(parents=[1, 2, 0, -1], starts=[0] * 4, lengths=[1] * 4, leaf_of_seq=[3]), "cycle"),
    (dict(parents=[0], starts=[0], lengths=[1], leaf_of_seq=[0]), "own parent"),
    (dict(parents=[-1, 5], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[1]), "missing parent"),
    (dict(parents=[-1, -2], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[1]), "missing parent"),
    (dict(parents=[-1, 0, 0], starts=[0, 1, 2], lengths=[1, 1, 1], leaf_of_seq=[1]), "no sequence beneath"),
    (dict(parents=[-1], starts=[0], lengths=[-1], leaf_of_seq=[0]), "lengths must be >= 0"),
    (dict(parents=[-1], starts=[-3], lengths=[1], leaf_of_seq=[0]), "starts must be >= 0"),
    (dict(parents=[-1], starts=[0], lengths=[1], leaf_of_seq=[]), "at least one sequence"),
    (dict(parents=[-1], starts=[0], lengths=[1], leaf_of_seq=[1]), "not a node index"),
    (dict(parents=[-1, 0], starts=[0], lengths=[1, 1], leaf_of_seq=[1]), "same length"),
    (dict(parents=[], starts=[], lengths=[], leaf_of_seq=[0]), "at least one node"),
    (dict(parents=[[-1]], starts=[0], lengths=[1], leaf_of_seq=[0]), "one-dimensional"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefixTree(**kwargs)


def test_type_errors_and_nested_errors():
    with pytest.raises(TypeError, match="parents"):
        PrefixTree(parents=[-1.5], starts=[0], lengths=[1], leaf_of_seq=[0])
    with pytest.raises(ValueError, match="forest"):
        PrefixTree.from_nested([])
    with pytest.raises(ValueError, match=r"forest\[0\]\[1\]"):
        PrefixTree.from_nested([[4, "x"]])
    with pytest.raises(ValueError, match="seqs_per_leaf"):
        PrefixTree.from_nested([3], seqs_per_leaf=0)
    t = PrefixTree.from_nested([[4, 2]])
    with pytest.raises(ValueError, match=r"span \[4, 6\) lies outside the pool"):
        t.check_pool(5)
    with pytest.raises(AttributeError):
        t.parents = (0,)


def _simulate_cover(tree: PrefixTree, meta: TreeMetadata, sched, tq: int, pool: int):
    """Host replay of a schedule: for each (row, pool token) count how often it is seen."""
    items = np.asarray(sched.items)
    tok = np.asarray(sched.tok)
    parts = np.asarray(sched.parts)
    row_key = np.asarray(meta.row_key)
    sorted_rows = np.asarray(meta.sorted_rows)
    c, br = sched.block_kv, sched.block_rows
    n_rows = tree.num_seqs * tq
    seen = np.zeros((n_rows, max(pool, c)), np.int64)
    slot_seen = {}
    for w in range(items.shape[0]):
        for i in range(br):
            sr = items[w, ROW_START] + i
            if sr >= n_rows:
                continue
            key = row_key[sr]
            orow = sorted_rows[sr]
            hits = []
            for t in range(items[w, NTILES]):
                if sched.mode == "flatten":
                    start = int(np.asarray(sched.chunk_start)[items[w, CHUNK] + t])
                else:
                    start = min(items[w, KV_START] + t * c, max(pool, c) - c)
                for j in range(c):
                    p = start + j
                    if sched.mode == "flatten":
                        ok = tok[items[w, CHUNK] + t, 0, j] <= key < tok[items[w, CHUNK] + t, 1, j]
                    else:
                        off = p - (items[w, KV_START] - items[w, 7])
                        lo = items[w, 7] + t * c
                        ok = (lo <= off < min(lo + c, items[w, 6])) and items[w, 3] <= key < items[w, 4]
                    if ok:
                        hits.append(p)
            if hits:
                slot_seen[w * br + i] = orow
                for p in hits:
                    seen[orow, p] += 1
    # Every slot with visible tokens must be in its row's parts, and nowhere else.
    for slot, orow in slot_seen.items():
        assert slot in parts[orow], (slot, orow)
    return seen


@pytest.mark.parametrize("seed", [0, 1])
def test_metadata_schedules_cover_each_path_exactly_once(seed):
    rng = np.random.default_rng(seed)
    tree = random_forest(rng, n_trees=2, max_depth=3, max_branch=3, max_len=40)
    tq = 2
    pool = tree.pool_extent + 5
    meta = build_tree_metadata(tree, tq=tq, group=2, pool_size=pool, block_kv=16, chunks_per_item=2)
    expect = np.zeros((tree.num_seqs * tq, max(pool, 16)), np.int64)
    for b in range(tree.num_seqs):
        for t in range(tq):
            expect[b * tq + t, tree.path_token_indices(b)] = 1
    for sched in [meta.flatten, meta.nodes]:
        np.testing.assert_array_equal(_simulate_cover(tree, meta, sched, tq, pool), expect)
    total = sum(_simulate_cover(tree, meta, lv, tq, pool) for lv in meta.levels)
    np.testing.assert_array_equal(total, expect)


def test_metadata_is_a_pytree_and_buckets_bound_shapes():
    t1 = PrefixTree.from_nested([[300, 20, 30, 25]], seqs_per_leaf=4)
    t2 = PrefixTree.from_nested([[290, 21, 33, 24]], seqs_per_leaf=4)
    m1 = build_tree_metadata(t1, tq=1, group=4, pool_size=400)
    m2 = build_tree_metadata(t2, tq=1, group=4, pool_size=400)
    leaves, treedef = jax.tree_util.tree_flatten(m1)
    m1b = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(m1b, TreeMetadata) and m1b.preferred == m1.preferred
    for a, b in zip(leaves, jax.tree_util.tree_leaves(m1b)):
        np.testing.assert_array_equal(a, b)
    # Similar trees land in the same buckets: same structure, same shapes (no recompilation).
    assert jax.tree_util.tree_structure(m2) == treedef
    assert [x.shape for x in jax.tree_util.tree_leaves(m2)] == [x.shape for x in leaves]
    for sched in [m1.flatten, m1.nodes, *m1.levels]:
        w = sched.items.shape[0]
        assert w & (w - 1) == 0 and w >= 8
        assert sched.parts.shape[1] & (sched.parts.shape[1] - 1) == 0
        assert np.all(np.asarray(sched.items)[:, 0] >= 0)
    assert m1.flatten.tok.shape[0] & (m1.flatten.tok.shape[0] - 1) == 0
    # Cached: the same tree shape builds once.
    assert build_tree_metadata(t1, tq=1, group=4, pool_size=400, device=False) is \
        build_tree_metadata(t1, tq=1, group=4, pool_size=400, device=False)
    assert isinstance(m1.flatten.items, jax.Array)
    # Padding chunk tokens are never visible.
    assert int(np.asarray(m1.flatten.tok)[-1, 0, -1]) == NEVER


def test_metadata_flows_through_jit_unchanged():
    t = PrefixTree.from_nested([[50, 7, [9, 1, 1]]], seqs_per_leaf=2)
    m = build_tree_metadata(t, tq=1, group=1, pool_size=t.pool_extent)
    out = jax.jit(lambda mm: mm)(m)
    for a, b in zip(jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(out)):
        np.testing.assert_array_equal(a, b)
    assert out.num_seqs == m.num_seqs and out.flatten.mode == "flatten"


def test_cost_model_prefers_flatten_for_unbalanced_speculative_tree():
    spec = PrefixTree.from_nested([[5000] + [1] * 64])
    m = build_tree_metadata(spec, tq=1, group=4, pool_size=spec.pool_extent, device=False)
    assert schedule_cost(m.flatten, group=4) < sum(schedule_cost(lv, group=4) for lv in m.levels)
    assert m.preferred == "flatten"


def test_build_metadata_argument_errors():
    t = PrefixTree.from_nested([[8, 2]])
    with pytest.raises(ValueError, match="block_kv"):
        build_tree_metadata(t, tq=1, group=1, pool_size=10, block_kv=24)
    with pytest.raises(ValueError, match="tq"):
        build_tree_metadata(t, tq=0, group=1, pool_size=10)
    with pytest.raises(ValueError, match="outside the pool"):
        build_tree_metadata(t, tq=1, group=1, pool_size=9)
    with pytest.raises(TypeError, match="PrefixTree"):
        build_tree_metadata([0], tq=1, group=1, pool_size=9)
    assert np.asarray(build_tree_metadata(t, tq=1, group=1, pool_size=10).row_key).dtype == np.int32
