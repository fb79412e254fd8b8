"""The per-part data files (``jax_prefix_attn/device_data/*.json``): each loads, validates and
names its source; a bad file raises ``ValueError`` naming the file and the key; the planning
code defines no device rates or tuned regions of its own, nor serves them under module names
(every reader takes them from a device's profile); an unknown GPU is planned with the nearest
profile and says so."""
import ast
import copy
import dataclasses
import fnmatch
import importlib
import json
import pathlib
import tomllib

import jax.numpy as jnp
import pytest

from jax_prefix_attn import leaf_plans, plan_shared_prefix
from jax_prefix_attn.device import H100_PCIE, H100_SXM, H200, DeviceInfo
from jax_prefix_attn.device_profile import (DeviceProfile, Tuning, data_files, device_profile,
                                            load_part, planning_profile, profiles,
                                            reference_profile)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jax_prefix_attn"
H200_FILE = PACKAGE / "device_data" / "h200.json"

# Module-level names of device rates and tuned regions, which no module defines or serves.
DEVICE_VALUE_NAMES = {
    "COPY_SHARE", "MMA_SHARE", "MMA_MGPU_SHARE", "L2_BW", "T_LAUNCH", "T_KEY", "T_KEY_FLAT",
    "SLOTS_PER_SM", "ROLE_PREFIX_FLOPS", "ROLE_TASK_S", "ROLE_STREAM_BPS", "COST_MODEL",
    "HEADS_KV", "HEAD_DIM", "KV_BYTES", "OVERLAP_BELOW_PROGRAMS", "LARGE_M_TILING", "FLAT_TILES",
    "FLAT_OWN_MIN_SPLIT_KEYS", "FLAT_OWN_MAX_SPLITS", "FLAT_OWN_MAX_CHUNK", "MGPU_MIN_CTAS",
    "MGPU_MIN_REAL_ROWS", "FEW_CTAS", "LONG_TILES", "SPLIT_WASTE", "MGPU_SUFFIX_SPLIT_BELOW",
    "ONE_LAUNCH_REGIONS", "ONE_LAUNCH_MIN_CTAS", "ONE_LAUNCH_MIN_GROUP", "JOINT_REGIONS",
    "JOINT_STAGES", "JOINT_SCHEDULE_BARRIER", "SPLIT_REGIONS", "SPLIT_GROUP", "SPLIT_MIN_ROWS",
    "DECODE_SUFFIX", "DECODE_SUFFIX_TILING", "ROW_SUFFIX", "H200_PROFILE", "PROFILES"}
# (FLAT_DECODE_MAX_TQ: the query count up to which the models' per-sequence attention takes the
# flat decode kernels, a bound of those kernels' use rather than a measured rate or region)
NOT_DEVICE_DATA = {"FLAT_DECODE_MAX_TQ"}
PLANNING = ["cost_model.py", "tree_cost.py", "device_profile.py", "planner.py", "tree_plan.py",
            "tree_schedule.py", "leaves/*.py"]


def test_every_data_file_loads_validates_and_names_its_source():
    files = data_files()
    assert any(f.name == "h200.json" for f in files)
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["source"].strip()
        profile = load_part(f)
        assert isinstance(profile, DeviceProfile) and isinstance(profile.tuning, Tuning)
        assert profiles()[profile.name] == profile
        hash(profile)                                   # hashable: a static planning input
        with pytest.raises(dataclasses.FrozenInstanceError):
            profile.copy_bytes_per_s = 1.0


def test_data_files_are_package_data():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["jax_prefix_attn"]
    for f in data_files():
        assert any(fnmatch.fnmatch(f"device_data/{f.name}", g) for g in globs), f.name


def _bad(tmp_path, edit):
    doc = copy.deepcopy(json.loads(H200_FILE.read_text()))
    edit(doc)
    path = tmp_path / "part.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit, key", [
    (lambda d: d["profile"].update(hbm_bytes_per_s=3e12), "profile.hbm_bytes_per_s"),
    (lambda d: d["tuning"].update(overlap_programs=2048), "tuning.overlap_programs"),
    (lambda d: d.update(notes="x"), "notes"),
    (lambda d: d["profile"].pop("launch_s"), "profile.launch_s"),
    (lambda d: d["tuning"].pop("split_regions"), "tuning.split_regions"),
    (lambda d: d.pop("source"), "source"),
    (lambda d: d["tuning"]["flat_tiles"][0].pop("block_k"), "tuning.flat_tiles[0].block_k"),
    (lambda d: d["tuning"]["joint_regions"][1].update(min_group="8"),
     "tuning.joint_regions[1].min_group"),
    (lambda d: d["profile"].update(copy_bytes_per_s="2.74e12"), "profile.copy_bytes_per_s"),
    (lambda d: d["profile"].update(sm_count=13.5), "profile.sm_count"),
    (lambda d: d["tuning"].update(joint_schedule_barrier=0), "tuning.joint_schedule_barrier"),
    (lambda d: d["tuning"].update(mgpu_min_real_rows=75), "tuning.mgpu_min_real_rows"),
    (lambda d: d["tuning"]["split_regions"][0].update(prefix=[8192, 4096]),
     "tuning.split_regions[0].prefix"),
    (lambda d: d.update(source=""), "source"),
])
def test_a_bad_data_file_names_the_file_and_the_key(tmp_path, edit, key):
    path = _bad(tmp_path, edit)
    with pytest.raises(ValueError, match="part.json") as e:
        load_part(path)
    assert f": {key}: " in str(e.value)


def _module_level_names(path: pathlib.Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)
    return names


def test_no_module_defines_device_rates_or_tuned_regions():
    for path in sorted(PACKAGE.rglob("*.py")):
        found = _module_level_names(path) & DEVICE_VALUE_NAMES
        assert not found, f"{path.relative_to(ROOT)} defines {sorted(found)}"
    # nor any other module-level number in the planning code (rates, thresholds, tiles)
    for pattern in PLANNING:
        for path in sorted(PACKAGE.glob(pattern)):
            for node in ast.parse(path.read_text()).body:
                targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
                names = {n.id for t in targets if t is not None for n in ast.walk(t)
                         if isinstance(n, ast.Name)}
                if (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
                        and not names <= NOT_DEVICE_DATA):
                    consts = [n for n in ast.walk(node.value) if isinstance(n, ast.Constant)
                              and type(n.value) in (int, float) and n.value not in (0, 1)]
                    assert not consts, f"{path.relative_to(ROOT)}:{node.lineno} sets a number"


def test_unknown_gpu_takes_the_nearest_profile_and_says_so():
    h200, note = device_profile(H200)
    assert note == "" and h200.name == "H200"
    unknown = DeviceInfo("gpu", "NVIDIA H20", 78, 232448, "9.0")
    profile, note = device_profile(unknown)
    assert profile is h200 and "'NVIDIA H20'" in note and "H200 profile" in note
    plan = plan_shared_prefix(batch=64, tq=1, heads_q=32, heads_kv=8, head_dim=128, groups=1,
                              prefix_len=4096, suffix_len=128, dtype=jnp.bfloat16, device=unknown)
    assert plan.reason.endswith(f"; {note}") and note.count("\n") == 0
    # the cost functions see the device's own SM count and shared memory
    assert planning_profile(unknown).sm_count == 78
    assert planning_profile(H100_PCIE).sm_count == H100_PCIE.sm_count
    assert planning_profile(H100_SXM).copy_bytes_per_s == h200.copy_bytes_per_s


def test_no_module_serves_device_values_under_module_names():
    """Every reader takes a device's value from its profile (``leaves.base.tuning(dev)``, ...):
    no module holds a device value as a module-level name, and none serves names lazily (a
    module-level ``__getattr__``)."""
    for name in ("device_profile", "planner", "leaf_plans", "leaves.base", "leaves.flat_own",
                 "leaves.triton_prefix"):
        module = importlib.import_module(f"jax_prefix_attn.{name}")
        served = sorted(n for n in DEVICE_VALUE_NAMES if hasattr(module, n))
        assert not served, f"jax_prefix_attn.{name} serves {served}"
    for path in sorted(PACKAGE.rglob("*.py")):
        lazy = [n.lineno for n in ast.parse(path.read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
        assert not lazy, f"{path.relative_to(ROOT)}:{lazy[0]} defines a module __getattr__"


def test_tiling_readers_give_the_devices_own_data():
    t = profiles()["H200"].tuning
    assert leaf_plans.tuning(H200) is t
    assert dataclasses.astuple(leaf_plans.decode_suffix_tiling(H200)) == t.decode_suffix_tiling
    assert [(b, dataclasses.astuple(x)) for b, x in leaf_plans.flat_tilings(H200)] == \
        [(b, x) for b, x in t.flat_tiles]
    assert reference_profile() is profiles()["H200"]
