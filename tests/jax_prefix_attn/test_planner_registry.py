"""The planner's registries of leaf modules: every leaf follows the protocol, every shape of a
random grid gets a leaf of each family whose ``why_not`` is ``None``, the planner picks the
cheapest of those (ties to the earlier in the registry), and a leaf's ``why_not`` agrees with
whether the planner can choose it and with whether a plan may force it; the same for the tree
schedules over random forests."""
import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_forest
from jax_prefix_attn import build_tree_metadata, plan_shared_prefix
from jax_prefix_attn.device import CPU, H100_PCIE, H100_SXM, H200, DeviceInfo
from jax_prefix_attn.leaves.base import (Leaf, Shapes, TreeLeaf, planning_part, supported, tiling_pairs,
                                         tuning)
from jax_prefix_attn.planner import (FLAT_PATHS, LEAVES, SHARED_PATHS, TREE_LEAVES, candidates,
                                     leaf_module, plan_tree_attention, tree_candidates, tree_leaf)
from jax_prefix_attn.tree_plan import SCHEDULES, TREE_IMPLS, ScheduleCosts, choose_schedules, tree_shapes

A100 = DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 108, 166912, "8.0")
DEVICES = {"h100": H100_SXM, "pcie": H100_PCIE, "h200": H200, "a100": A100, "cpu": CPU}


def _grid(n: int, seed: int = 0) -> list:
    """``n`` random shapes; half in the Mosaic GPU decode region's form (one prefix, ``Tq = 1``,
    whole 128-key prefix tiles), where most leaves' regions lie."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        hkv, group = (int(rng.choice([1, 2, 4, 8])) for _ in range(2))
        d = int(rng.choice([64, 96, 128]))
        dtype = str(rng.choice(["bfloat16", "float16", "float32"], p=[0.6, 0.3, 0.1]))
        if rng.random() < 0.5:
            b = int(rng.choice([32, 64, 128, 256, 512, 1024, 2048]))
            p = int(rng.choice([1024, 2048, 4096, 8192, 16384, 128 * int(rng.integers(1, 129))]))
            s = int(rng.choice([64, 128, 256, 1024, 64 * int(rng.integers(1, 17))]))
            tq, groups = 1, 1
        else:
            groups = int(rng.integers(1, 5)) if rng.random() < 0.4 else 1
            b = max(groups, int(np.exp(rng.uniform(0, np.log(2048)))))
            tq = int(rng.choice([1, 1, 2, 3, 4, 40]))
            p = int(np.exp(rng.uniform(0, np.log(16384))))
            s = int(np.exp(rng.uniform(0, np.log(1024))))
        shapes.append(Shapes(b, tq, hkv * group, hkv, d, groups, p, s, dtype))
    return shapes


GRID = _grid(1500) + [Shapes(4, 1, 8, 8, 128, 1, 100, 0, "bfloat16"),
                      Shapes(64, 1, 32, 8, 128, 1, 4096, 128, "int8")]


def _plan(s: Shapes, dev, **kw):
    return plan_shared_prefix(batch=s.batch, tq=s.tq, heads_q=s.heads_q, heads_kv=s.heads_kv,
                              head_dim=s.head_dim, groups=s.groups, prefix_len=s.prefix_len,
                              suffix_len=s.suffix_len, dtype=s.dtype, device=dev, **kw)


def test_registry_holds_every_leaf_once_and_each_follows_the_protocol():
    paths = [leaf.PATH for leaf in LEAVES]
    assert sorted(paths) == sorted(SHARED_PATHS + FLAT_PATHS)
    for leaf in LEAVES:
        assert isinstance(leaf, Leaf), leaf.__name__
        assert leaf.PLAN.path == leaf.PATH
        assert leaf.FAMILY == ("flat" if leaf.PATH in FLAT_PATHS else "shared")


@pytest.mark.parametrize("dev_name", sorted(DEVICES))
@pytest.mark.parametrize("interpret", [False, True])
def test_every_shape_gets_a_leaf_and_why_not_agrees_with_the_planner(dev_name, interpret):
    dev = DEVICES[dev_name]
    chosen = set()
    for s in GRID:
        if supported(s) is not None:
            assert all(leaf.why_not(s, dev, interpret) is not None for leaf in LEAVES)
            continue
        why = {leaf.PATH: leaf.why_not(s, dev, interpret) for leaf in LEAVES}
        for family in ("shared", "flat"):
            found = candidates(s, dev, family, interpret)
            assert found, (s, family)
            assert [leaf.PATH for leaf in found] == [
                leaf.PATH for leaf in LEAVES if leaf.FAMILY == family and why[leaf.PATH] is None]
            tdev = planning_part(dev)
            best = min(range(len(found)), key=lambda i: (found[i].seconds(s, tdev, interpret), i))
            plan = _plan(s, dev, impl=family, interpret=interpret)
            # the whole-call leaf is the cheapest candidate; its chunks' leaves accept their
            # own shapes
            assert plan.path == found[best].PATH, (s, family)
            assert why[plan.path] is None
            for c in plan.chunks:
                s_c = dataclasses.replace(s, tq=c.stop - c.start)
                assert leaf_module(c.leaf).why_not(s_c, dev, interpret) is None, (s_c, c.leaf)
            chosen.add(plan.path)
        for leaf in LEAVES:
            # a leaf the planner may choose is one a plan may force
            if why[leaf.PATH] is None:
                assert leaf.unsupported(s, dev, interpret) is None
                assert _plan(s, dev, path=leaf.PATH, interpret=interpret).path == leaf.PATH
    if dev.mosaic_gpu_ok and not interpret:
        # every leaf with a measured region on the part (a data file may list none for a leaf,
        # which then runs only when forced)
        t = tuning(dev)
        unmeasured = {path for path, regions in (("mgpu_stream_two_launch", t.stream_two_launch_regions),
                                                  ("flat_mgpu_stream", t.flat_stream_regions))
                      if not regions}
        assert chosen == set(SHARED_PATHS + FLAT_PATHS) - unmeasured, chosen
    else:
        assert not any(p.startswith("mgpu") for p in chosen), chosen


def test_executor_dispatches_each_leaf_plan_to_its_module():
    for leaf in LEAVES:
        s = Shapes(256, 1, 32, 8, 128, 1, 4096, 128, "bfloat16")
        plan = _plan(s, H100_SXM, path=leaf.PATH, interpret=True)
        assert {leaf_module(c.leaf) for c in plan.chunks} == {leaf}
        assert all(type(c.leaf) is leaf.PLAN for c in plan.chunks)


def test_reason_names_the_choice_and_a_stand_in_profile():
    s = Shapes(256, 1, 32, 8, 128, 1, 4096, 128, "bfloat16")
    plan = _plan(s, H200)
    assert plan.reason.startswith(f"{plan.path}: least modelled time") and "flat_own" in plan.reason
    assert "profile" not in plan.reason                      # the H200 has a measured profile
    assert "planned with the H200 profile" in _plan(s, A100, impl="shared").reason
    assert _plan(s, H200, path="flat_rows").reason.startswith("path='flat_rows' forced")
    assert _plan(s, CPU).reason == "impl='auto' on cpu: no GPU kernels"


def test_tree_registry_holds_every_schedule_once_and_each_follows_the_protocol():
    paths = [leaf.PATH for leaf in TREE_LEAVES]
    assert sorted(paths + ["reference"]) == sorted(SCHEDULES)
    assert set(TREE_IMPLS) - {"auto", "reference"} <= set(paths)
    costs = ScheduleCosts(flatten=2e-6, levelwise=3e-6, hybrid=1e-6)
    for leaf in TREE_LEAVES:
        assert isinstance(leaf, TreeLeaf), leaf.__name__
        assert leaf.FAMILY == "tree" and leaf.PLAN.path == leaf.PATH and tree_leaf(leaf.PATH) is leaf
        assert dataclasses.is_dataclass(leaf.PLAN) and leaf.PLAN.__dataclass_params__.frozen
        # priced leaves read their time from the metadata's ScheduleCosts; the others lead the
        # registry (they win wherever they accept the shapes) or are never auto-chosen
        assert (leaf.seconds(costs) is not None) == leaf.PRICED
        assert leaf.PRICED or leaf.MIRROR or leaf.PREFERENCE
    priced = [i for i, leaf in enumerate(TREE_LEAVES) if leaf.PRICED]
    preferring = [i for i, leaf in enumerate(TREE_LEAVES) if leaf.PREFERENCE]
    assert max(preferring) < min(priced)
    assert choose_schedules(costs) == ("flatten", True)


def _forests(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tree = random_forest(rng, int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)),
                             int(rng.choice([6, 40, 300])), seqs_per_leaf=(1, int(rng.integers(1, 5))))
        out.append((tree, int(rng.choice([1, 1, 2])), int(rng.choice([1, 4]))))
    return out


def test_every_forest_gets_a_tree_leaf_and_the_plan_is_the_cheapest_candidate():
    seen = set()
    for tree, tq, group in _forests(16, 3):
        meta = build_tree_metadata(tree, tq=tq, group=group, pool_size=int(sum(tree.lengths)) + 8,
                                   device=False)
        assert choose_schedules(meta.costs) == (meta.preferred, meta.hybrid)
        for d, dtype in ((64, jnp.bfloat16), (16, jnp.float32), (8, jnp.bfloat16)):
            for suffix_len, draft, platform in ((0, False, "gpu"), (32, False, "gpu"), (32, True, "gpu"),
                                                (32, False, "cpu")):
                q_shape = (tree.num_seqs, tq, 2 * meta.group, d)
                s = tree_shapes(q_shape, dtype, suffix_len, draft)
                found = tree_candidates(meta, s, platform)
                assert found and {"levelwise", "flatten"} <= {leaf.PATH for leaf in found}
                plan = plan_tree_attention(meta, q_shape=q_shape, dtype=dtype, suffix_len=suffix_len,
                                           draft=draft, platform=platform)
                leaf = tree_leaf(plan.schedule)
                assert leaf.why_not(meta, s, platform, False) is None
                assert leaf.unsupported(meta, s, platform, plan.interpret) is None
                assert plan.tiling == tiling_pairs(leaf.build(meta)) and plan.reason.startswith(leaf.PATH)
                if not found[0].PRICED:
                    assert leaf is found[0]
                else:   # the cheapest priced candidate by the metadata's times, ties to the registry
                    cost = [c.seconds(meta.costs) for c in found if c.PRICED]
                    best = min(range(len(cost)), key=lambda i: (cost[i], i))
                    assert leaf is [c for c in found if c.PRICED][best] and math.isfinite(cost[best])
                seen.add(plan.schedule)
    assert {"flatten", "levelwise", "single_level", "shallow", "hybrid"} <= seen, seen
