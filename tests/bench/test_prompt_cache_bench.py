"""``bench/prompt_cache.py`` on the CPU: the ``--smoke`` run (tiny random model, modules encoded
with it, both tiers) writes the documented JSON and plot, resumes without redoing finished
points; the target checks from constructed records."""
from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import prompt_cache as pc  # noqa: E402


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prompt_cache") / "prompt_cache_cpu.json")
    res = pc.main(["--smoke", "--out", out])
    with open(out) as f:
        return out, res, json.load(f)


def test_smoke_json_and_plot(smoke_run):
    out, res, data = smoke_run
    assert res["counts"]["measured"] == 3 and res["counts"]["errors"] == 0, res
    assert data["benchmark"] == "prompt_cache" and data["fixed"]["smoke"] is True and data["device_info"]["device"]
    run = data["runs"][-1]
    assert set(run["rates"]) == {"matmul_flops", "copy_bw_Bps", "h2d_bw_Bps"} and min(run["rates"].values()) > 0
    assert len(run["targets"]["lines"]) == 3
    pts = data["points"]
    assert [(p["cached"], p["new"], p["batch"]) for p in pts] == [(48, 8, 1), (96, 8, 1), (48, 8, 2)]
    for p in pts:
        assert p["status"] == "ok" and p["kv_source"] == "encode" and p["modules"] == 2
        assert p["tiers"] == ["cached_device", "cached_host"]
        for path in pc.PATHS:
            reps = p[path]["reps_ms"]
            assert len(reps) == 3 and min(reps) > 0
            assert p[path]["median_ms"] == statistics.median(reps) and p[path]["min_ms"] == min(reps)
            assert p["floor_ms"][path] > 0
        for tier in p["tiers"]:
            assert p[f"speedup_{tier}"] == pytest.approx(p["prefill"]["median_ms"] / p[tier]["median_ms"])
            assert 0 <= p["first_token_equal_fraction"][tier] <= 1
        assert p["cached_tokens"] == p["cached"] and p["prefill_tokens_per_prompt"] == p["cached"] + p["new"]
        assert p["kv_bytes"] == p["cached"] * p["kv_bytes_per_token"]
        # the packed storage: K/V, 9 index bytes per token and 8 bytes per row offset (2 modules)
        assert p["stored_bytes_per_token"] == pytest.approx(p["kv_bytes_per_token"] + 9 + 8 * 3 / p["cached"])
        assert p["stored_bytes_per_token"] < p["file_bytes_per_token"] < p["stored_bytes_per_token"] + 4096 / 48
    with open(os.path.splitext(out)[0] + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_smoke_rerun_skips_finished_points_and_plot_only(smoke_run, tmp_path):
    out, _, data = smoke_run
    copy = str(tmp_path / "pc.json")
    with open(copy, "w") as f:
        json.dump(data, f)
    again = pc.main(["--smoke", "--out", copy])
    assert again["counts"]["skipped_existing"] == 3 and again["counts"]["measured"] == 0
    os.remove(os.path.splitext(copy)[0] + ".png")
    assert pc.main(["--smoke", "--out", copy, "--plot-only"])["plot"] == os.path.splitext(copy)[0] + ".png"
    assert os.path.exists(os.path.splitext(copy)[0] + ".png")


def test_targets_from_constructed_points():
    def point(part, cached, new, prefill, device, host=None):
        p = {"part": part, "model": pc.PART_MODELS[part], "cached": cached, "new": new, "batch": 1, "status": "ok",
             "prefill": {"median_ms": prefill}, "cached_device": {"median_ms": device},
             "speedup_cached_device": prefill / device, "tiers": ["cached_device"]}
        if host is not None:
            p.update(cached_host={"median_ms": host}, speedup_cached_host=prefill / host,
                     tiers=["cached_device", "cached_host"])
        return p

    pts = [point("llama8b", 8192, 64, 240.0, 12.0, 150.0), point("llama8b", 1024, 64, 40.0, 8.0, 12.0),
           point("smollm2", 2048, 64, 3000.0, 100.0)]
    t = pc.targets({"points": pts})
    got = {(c["part"], c["tier"]): (c["speedup"], c["met"]) for c in t["checks"]}
    assert got == {("llama8b", "cached_device"): (20.0, True), ("llama8b", "cached_host"): (1.6, False),
                   ("smollm2", "cached_device"): (30.0, True)}
    assert sum("NOT met" in line for line in t["lines"]) == 1 and len(t["lines"]) == 6


@pytest.mark.gpu
def test_gpu_prompt_cache_tiny(tmp_path):
    """Llama-3.1-8B layer shapes, one layer, random and encoded module K/V: both tiers timed."""
    out = str(tmp_path / "pc.json")
    res = pc.main(["--part", "llama8b", "--layers", "1", "--cached", "1024", "--new", "64", "--out", out])
    assert res["counts"]["measured"] == 1, res
    res = pc.main(["--part", "llama8b", "--layers", "1", "--cached", "512", "--new", "32", "--modules", "1",
                   "--kv", "encode", "--out", str(tmp_path / "enc.json")])
    assert res["counts"]["measured"] == 1, res
    with open(out) as f:
        p = json.load(f)["points"][0]
    assert p["status"] == "ok" and p["tiers"] == ["cached_device", "cached_host"] and p["kv_source"] == "random"
    assert p["file_bytes_per_token"] > p["stored_bytes_per_token"] > p["kv_bytes_per_token"] == 2 * 8 * 128 * 2
    with open(tmp_path / "enc.json") as f:
        q = json.load(f)["points"][0]
    assert q["status"] == "ok" and q["kv_source"] == "encode" and q["encode_s"] > 0
    assert set(q["first_token_equal_fraction"]) == {"cached_device", "cached_host"}
