"""Tree metadata: schedules, padding buckets, pytree behaviour and the cost model's choices
(host-side; fast)."""
import dataclasses
import jax
import numpy as np
import pytest

from helpers import random_forest
from jax_prefix_attn import PrefixTree, TreeMetadata, build_tree_metadata
from jax_prefix_attn.device_profile import default_profile
from jax_prefix_attn.tree_cost import schedule_cost
from jax_prefix_attn.tree_metadata import root_bucket
from pallas_kernels.tree_attention import CHUNK, KV_START, LENGTH, NEVER, NTILES, OFF0, ROW_START, TIN, TOUT


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
                        off = p - (items[w, KV_START] - items[w, OFF0])
                        lo = items[w, OFF0] + t * c
                        ok = (lo <= off < min(lo + c, items[w, LENGTH])) and items[w, TIN] <= key < items[w, TOUT]
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
    for sms in (114, 132):
        assert (schedule_cost(m.flatten, group=4, sm_count=sms)
                < sum(schedule_cost(lv, group=4, sm_count=sms) for lv in m.levels))
    assert m.preferred == "flatten"


def test_schedule_cost_waves_follow_the_sm_count():
    """More program waves on a part with fewer SMs: the cost never drops when SMs are removed."""
    tree = PrefixTree.from_nested([[300, [40] * 6], [500, [30] * 70]])
    m = build_tree_metadata(tree, tq=1, group=4, pool_size=tree.pool_extent, device=False)
    for sched in [m.flatten, m.nodes] + list(m.levels):
        costs = [schedule_cost(sched, group=4, sm_count=n) for n in (1, 8, 114, 132)]
        assert costs == sorted(costs, reverse=True)
    assert schedule_cost(m.flatten, group=4, sm_count=1) > schedule_cost(m.flatten, group=4, sm_count=132)


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


def test_build_metadata_hybrid_mid_options():
    """``mid_tiling`` caps the hybrid schedule's tree-kernel tiles, ``mid_mode`` forces its mode."""
    tot = PrefixTree.from_nested([[150] + [[40] + [20] * 4 for _ in range(4)]])
    default = build_tree_metadata(tot, tq=1, group=4, pool_size=tot.pool_extent, device=False)
    assert default.mid.block_kv == 64
    wide = build_tree_metadata(tot, tq=1, group=4, pool_size=tot.pool_extent, mid_tiling=dict(block_kv=128),
                               device=False)
    assert wide.mid.block_kv == 128
    for mode in ("node", "flatten"):
        m = build_tree_metadata(tot, tq=1, group=4, pool_size=tot.pool_extent, mid_mode=mode, device=False)
        assert m.mid.mode == mode
    with pytest.raises(ValueError, match="mid_mode"):
        build_tree_metadata(tot, tq=1, group=4, pool_size=tot.pool_extent, mid_mode="levels")
    with pytest.raises(ValueError, match="mid_tiling"):
        build_tree_metadata(tot, tq=1, group=4, pool_size=tot.pool_extent, mid_tiling=dict(block_rows=8))


def test_cost_model_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        default_profile().tree_copy_bytes_per_s = 1.0


def test_root_bucket():
    assert [root_bucket(n) for n in (1, 17, 1000, 1024)] == [16, 32, 1024, 1024]
    assert root_bucket(1025) == 1152 and root_bucket(4000) == 4096 and root_bucket(5000) == 5120
    assert all(root_bucket(n) % 128 == 0 and n <= root_bucket(n) <= 1.125 * n for n in range(1025, 20000, 97))


def test_hybrid_cost_model_choices():
    """The hybrid schedule is preferred for tree-of-thought / APPS shapes, not when a few
    sequences each stream a very long exclusive node (one program per sequence and kv head in
    the suffix launch, where the flatten schedule splits it into chunks)."""
    tot = PrefixTree.from_nested([[1500] + [[200] + [200] * 10 for _ in range(10)]])
    apps = PrefixTree.from_nested([[2400, 500, 600, 700]], seqs_per_leaf=128)
    long_leaves = PrefixTree.from_nested([[100, 50000, 50000]])
    for tree, want in ((tot, True), (apps, True), (long_leaves, False)):
        meta = build_tree_metadata(tree, tq=1, group=4, pool_size=tree.pool_extent, device=False)
        assert meta.hybrid == want, tree
    assert build_tree_metadata(tot, tq=2, group=4, pool_size=tot.pool_extent, device=False).excl_span is None
