"""``bench/flat_decode_sweep.py`` on the CPU: its configurations (split counts whose splits all
hold keys, the planner's own leaf, the planned tiling first), the launch count read from
optimized HLO, the split rule it fits (with the device's tuned values it is the planner's
choice), and the script end to end in its smoke mode (tiny points, Pallas interpret mode),
resumed and stopped by its budget."""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import flat_decode_sweep as fds  # noqa: E402
from jax_prefix_attn import leaf_plans as lp  # noqa: E402
from jax_prefix_attn import plan_shared_prefix  # noqa: E402
from jax_prefix_attn.device import H100_PCIE, H100_SXM  # noqa: E402
from jax_prefix_attn.plans import Shapes  # noqa: E402

HLO = """HloModule jit_f, entry_computation_layout={(bf16[32,128]{1,0})->bf16[32,128]{1,0}}

%fused_computation (param_0: f32[5,32,128]) -> bf16[32,128] {
  %param_0 = f32[5,32,128]{2,1,0} parameter(0)
  %slice.1 = f32[1,32,128]{2,1,0} slice(%param_0), slice={[0:1], [0:32], [0:128]}
  ROOT %convert.1 = bf16[32,128]{1,0} convert(%slice.1)
}

%command_buffer (p0: bf16[32,128], p1: bf16[1024,8,128]) -> bf16[32,128] {
  %p0 = bf16[32,128]{1,0} parameter(0)
  %p1 = bf16[1024,8,128]{2,1,0} parameter(1)
  %custom-call.1 = (f32[5,32,128]{2,1,0}, f32[5,32]{1,0}) custom-call(%p0, %p1), custom_call_target="__gpu$xla.gpu.triton"
  %get-tuple-element.1 = f32[5,32,128]{2,1,0} get-tuple-element(%custom-call.1), index=0
  ROOT %fusion.1 = bf16[32,128]{1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_computation
}

ENTRY %main.9 (Arg_0.1: bf16[32,128], Arg_1.2: bf16[1024,8,128]) -> bf16[32,128] {
  %Arg_0.1 = bf16[32,128]{1,0} parameter(0)
  %Arg_1.2 = bf16[1024,8,128]{2,1,0} parameter(1)
  %constant.3 = s32[1]{0} constant({1024})
  %copy.2 = bf16[32,128]{1,0} copy(%Arg_0.1)
  %call.1 = bf16[32,128]{1,0} call(%copy.2, %Arg_1.2), to_apply=%command_buffer
  ROOT %bitcast.4 = bf16[32,128]{1,0} bitcast(%call.1)
}
"""


def test_launches_count_kernels_of_the_entry_and_its_command_buffers():
    # the copy, the Triton custom call and the merge fusion; nothing inside the fused computation
    assert fds.kernel_launches(HLO) == 3
    assert fds.kernel_launches(HLO.replace("%copy.2 = bf16[32,128]{1,0} copy(%Arg_0.1)",
                                           "%copy.2 = bf16[32,128]{1,0} bitcast(%Arg_0.1)")) == 2


def test_configurations_hold_keys_in_every_split_and_include_the_planned_leaf():
    pt = (32, 8, 128, 1, 1024, 64)
    todo = fds.configs([pt], fds.SPLITS, fds.tilings(H100_SXM), H100_SXM)
    leaf = plan_shared_prefix(batch=1, tq=1, heads_q=32, heads_kv=8, head_dim=128, groups=1,
                              prefix_len=1024, suffix_len=64, dtype=jnp.bfloat16, impl="flat",
                              device=H100_SXM).chunks[0].leaf
    assert [(n, t) for _, n, t, planned in todo if planned] == [(leaf.num_splits, leaf.tiling)]
    got = {(n, t.block_k) for _, n, t, planned in todo if not planned}
    # 1024 prefix keys in 128-key tiles hold at most 8 splits; 64-key tiles 16, 32-key tiles 32
    # (16 splits of 64-key tiles is the planned leaf)
    assert (leaf.num_splits, leaf.tiling.block_k) == (16, 64)
    assert got == ({(n, 128) for n in (1, 2, 4, 8)} | {(n, 64) for n in (1, 2, 4, 8)}
                   | {(n, 32) for n in (1, 2, 4, 8, 16, 32)})
    rule = [t == lp.flat_own_tiling(fds.point_shapes(pt), n) or planned for _, n, t, planned in todo]
    assert not any(rule[rule.index(False):])          # the planner's tiling of each count first
    assert sum(rule) == 6 and (16, 64) in {(n, t.block_k) for (_, n, t, _), r in zip(todo, rule) if r}
    # at most 8 programs per SM: B=32 x Hkv=8 programs take at most 4 splits
    big = fds.configs([(32, 8, 128, 32, 16384, 64)], fds.SPLITS, fds.tilings(H100_SXM), H100_SXM)
    assert max(n for _, n, _, planned in big if not planned) == 4


@pytest.mark.parametrize("dev", [H100_SXM, H100_PCIE])
def test_split_rule_with_the_tuned_values_is_the_planners_and_its_bounds_hold(dev):
    for b, hq, hkv, p, s in [(1, 32, 8, 1024, 64), (1, 8, 1, 16384, 64), (8, 8, 1, 4000, 1),
                             (16, 32, 8, 1024, 64), (32, 8, 1, 4096, 64), (512, 32, 8, 4096, 128)]:
        shapes = Shapes(b, 1, hq, hkv, 128, 1, p, s, "bfloat16")
        plan = plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=128, groups=1,
                                  prefix_len=p, suffix_len=s, dtype=jnp.bfloat16, path="flat_own",
                                  device=dev)
        assert plan.chunks[0].leaf == lp.flat_own_leaf(shapes, dev)
        tiles = sorted(t.block_k for _, t in lp.flat_tilings(dev))
        for keys in fds.RULE_KEYS:
            for cap in fds.RULE_MAX:
                leaf = lp.flat_own_leaf(shapes, dev, min_split_keys=keys, max_splits=cap)
                m = leaf.num_splits
                assert 1 <= m <= max(1, -(-(p + s) // keys)) and (cap is None or m <= cap)
                assert b * hkv * m <= max(b * hkv, 2 * dev.sm_count + b * hkv)   # two per SM
                # no key tile longer than a split's keys (down to the shortest tile)
                assert m == 1 or leaf.tiling.block_k <= max(tiles[0], -(-(p + s) // m))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sweep") / "flat_decode_sweep_cpu.json")
    return out, fds.main(["--smoke", "--out", out, "--commit", "abc123"])


def test_smoke_run_records_every_configuration(smoke):
    out, doc = smoke
    with open(out) as f:
        assert json.load(f) == json.loads(json.dumps(doc))
    run = doc["runs"][0]
    assert doc["commit"] == run["commit"] == "abc123" and run["versions"]["jax"] == jax.__version__
    assert doc["info"]["device"] and run["budget_s"] > 0 and "not_started_budget" not in run
    assert set(doc["harness"]) == {"1x4x16", "2x4x16"} and min(doc["harness"].values()) > 0
    keys = [r["key"] for r in doc["results"]]
    want = [fds.config_key(pt, n, t) for pt, n, t, _ in fds.configs(
        [(4, 2, 16, b, 40, 8) for b in (1, 2)], (2,), fds.tilings(H100_SXM)[-1:], H100_SXM)]
    assert sorted(keys) == sorted(want) and len(keys) == 4
    for r in doc["results"]:
        assert r["status"] == "ok", r
        assert r["us"] > 0 and r["us_net"] == pytest.approx(r["us"] - doc["harness"][f"{r['batch']}x4x16"])
        assert r["maxabs_vs_reference"] < 2e-2 and r["empty_splits"] == 0
    summary = doc["summary"]
    for key, pnt in summary["points"].items():
        rs = [r for r in doc["results"] if r["point"] == key]
        assert pnt["best_us"] == min(r["us"] for r in rs)
        assert pnt["planned_over_best"] == pytest.approx(pnt["planned_us"] / pnt["best_us"])
        assert pnt["planned_over_best"] >= 1
    fits = summary["rule_fit"]
    assert len(fits) == len(fds.RULE_KEYS) * len(fds.RULE_MAX) and sum(f["current"] for f in fits) == 1
    assert summary["recommended"] == fits[0] and all(f["geomean_over_best"] >= 1 for f in fits)


def test_resume_keeps_results_and_a_spent_budget_starts_nothing(smoke, tmp_path):
    out, doc = smoke
    again = fds.main(["--smoke", "--resume", "--out", out])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "run"} for r in rs]  # noqa: E731
    assert strip(again["results"]) == strip(doc["results"]) and len(again["runs"]) == 2
    fresh = fds.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "none.json")])
    assert fresh["results"] == [] and len(fresh["runs"][0]["not_started_budget"]) == 4
    assert fresh["summary"]["points"] == {} and fresh["summary"]["recommended"] is None


@pytest.mark.gpu
def test_gpu_sweep_of_one_point(tmp_path):
    doc = fds.main(["--batches", "1", "--prefixes", "1024", "--heads", "32/8", "--splits", "1", "4",
                    "--out", str(tmp_path / "s.json")])
    assert doc["results"] and all(r["status"] == "ok" for r in doc["results"]), doc["results"]
    for r in doc["results"]:
        assert r["maxabs_vs_reference"] < 2e-2 and r["us"] > 0
    one = {r["launches"] for r in doc["results"] if r["splits"] == 1}
    split = {r["launches"] for r in doc["results"] if r["splits"] > 1}
    assert len(one) == 1 and min(one) >= 1 and split == {min(one) + 1}   # + one merge fusion
