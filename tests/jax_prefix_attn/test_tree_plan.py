"""plan_tree_attention: the frozen TreePlan, its reason, what impl="auto" runs, and a random grid
of forests planned onto schedules the tree kernels take (CPU, no kernel compiled)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_forest
from helpers import tree_inputs as make_inputs
from jax_prefix_attn import PrefixTree, build_tree_metadata, tree_attention
from jax_prefix_attn.device import CPU, H100_SXM
from jax_prefix_attn.planner import FLAT_DECODE_MAX_TQ, TreePlan, plan_tree_attention, use_flat_decode
from jax_prefix_attn.tree_attention import auto_path
from jax_prefix_attn.tree_plan import (SCHEDULES, ScheduleCosts, choose_schedules, hybrid_unsupported_shapes,
                                       shallow_takes, single_level_takes)

# Two levels below one root, two sequences per leaf: tq == 1 metadata has a hybrid schedule.
TREE = PrefixTree.from_parents([-1, 0, 0, 1, 1], [300, 40, 40, 20, 20], [3, 3, 4, 4, 2, 2])


def _meta(tree, tq, group=4, **kw):
    return build_tree_metadata(tree, tq=tq, group=group, pool_size=int(sum(tree.lengths)) + 8, **kw)


def test_tree_plan_is_frozen_and_reason_names_the_competitors():
    meta = _meta(TREE, 1, device=False)
    plan = plan_tree_attention(meta, q_shape=(6, 1, 8, 64), dtype=jnp.bfloat16, suffix_len=16, platform="gpu")
    assert isinstance(plan, TreePlan) and plan.schedule in SCHEDULES
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schedule = "nodes"
    assert isinstance(plan.costs, ScheduleCosts) and math.isfinite(plan.costs.hybrid)
    for name in ("flatten", "levelwise", "hybrid"):
        assert f"{name} " in plan.reason and " us" in plan.reason, plan.reason
    assert plan.reason.startswith(plan.schedule)
    # Device metadata drops the host-only times; the reason says so and the choice is the same.
    dev_plan = plan_tree_attention(_meta(TREE, 1), q_shape=(6, 1, 8, 64), dtype=jnp.bfloat16, suffix_len=16,
                                   platform="gpu")
    assert dev_plan.costs is None and "device metadata" in dev_plan.reason
    assert dev_plan.schedule == plan.schedule


def test_choose_schedules_ties_and_metadata_agree():
    assert choose_schedules(ScheduleCosts(1.0, 1.0)) == ("levelwise", False)
    assert choose_schedules(ScheduleCosts(1.0, 2.0, 0.5)) == ("flatten", True)
    assert choose_schedules(ScheduleCosts(2.0, 1.0, 1.0)) == ("levelwise", False)
    meta = _meta(TREE, 1, device=False)
    assert choose_schedules(meta.costs) == (meta.preferred, meta.hybrid)


def test_forced_hybrid_raises_where_it_cannot_run():
    meta = _meta(TREE, 2, device=False)
    with pytest.raises(ValueError, match="impl='hybrid' cannot run"):
        plan_tree_attention(meta, q_shape=(6, 2, 8, 64), dtype=jnp.float32, suffix_len=16, impl="hybrid",
                            platform="gpu")
    plan = plan_tree_attention(meta, q_shape=(6, 2, 8, 64), dtype=jnp.float32, suffix_len=16, impl="nodes")
    assert plan.schedule == "nodes" and "forced" in plan.reason


@pytest.mark.parametrize("tq", [1, 3])
def test_auto_runs_the_planned_schedule(tq):
    """Off the GPU auto runs the mirror of the planned schedule: the same numbers as naming it."""
    args = make_inputs(TREE, tq=tq, hq=8, hkv=2, d=32, smax=8, seed=tq)
    q, kp, vp, sk, sv, sl = args
    plan = plan_tree_attention(_meta(TREE, tq, device=False), q_shape=q.shape, dtype=q.dtype,
                               suffix_len=sk.shape[1], platform="cpu")
    assert plan.schedule in ("flatten", "levelwise") and not plan.interpret
    assert auto_path(_meta(TREE, tq), q, sk, platform="cpu") == plan.schedule
    f = jax.jit(lambda impl, *a: tree_attention(a[0], TREE, *a[1:5], suffix_lengths=a[5], impl=impl,
                                                platform="cpu", return_lse=True), static_argnums=0)
    for got, want in zip(f("auto", *args), f(plan.schedule, *args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_random_grid_plans_schedules_the_kernels_take():
    rng = np.random.default_rng(7)
    seen = set()
    for _ in range(24):
        tree = random_forest(rng, int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)),
                             int(rng.choice([8, 60, 700])), seqs_per_leaf=(1, int(rng.integers(1, 5))))
        tq, group = int(rng.choice([1, 1, 2])), int(rng.choice([1, 4, 8]))
        meta = _meta(tree, tq, group, device=False)
        for d in (16, 64, 128):
            for dtype in (jnp.float32, jnp.bfloat16):
                for suffix_len, draft, platform in ((0, False, "gpu"), (32, False, "gpu"), (32, True, "gpu"),
                                                    (32, False, "cpu")):
                    q_shape = (tree.num_seqs, tq, 2 * meta.group, d)
                    plan = plan_tree_attention(meta, q_shape=q_shape, dtype=dtype, suffix_len=suffix_len,
                                               draft=draft, platform=platform)
                    seen.add(plan.schedule)
                    assert plan.reason.startswith(plan.schedule)
                    if plan.schedule == "hybrid":
                        assert hybrid_unsupported_shapes(meta, q_shape, dtype) is None and not draft
                    elif plan.schedule == "single_level":
                        assert single_level_takes(meta, q_shape, dtype, suffix_len)
                    elif plan.schedule == "shallow":
                        assert shallow_takes(meta, q_shape, dtype)
                    else:
                        assert plan.schedule == meta.preferred
    assert {"flatten", "levelwise", "single_level"} <= seen, seen


def test_use_flat_decode_asks_the_device_and_shapes():
    q = (4, 1, 8, 64)
    assert use_flat_decode(q, jnp.bfloat16, 128, device=H100_SXM)
    assert use_flat_decode((4, FLAT_DECODE_MAX_TQ, 8, 64), jnp.bfloat16, 128, device=H100_SXM)
    assert not use_flat_decode((4, FLAT_DECODE_MAX_TQ + 1, 8, 64), jnp.bfloat16, 128, device=H100_SXM)
    assert not use_flat_decode(q, jnp.bfloat16, 128, impl="reference", device=H100_SXM)
    assert not use_flat_decode(q, jnp.bfloat16, 128, device=CPU)
    assert not use_flat_decode(q, jnp.bfloat16, 0, device=H100_SXM)
