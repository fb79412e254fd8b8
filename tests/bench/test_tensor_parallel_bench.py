"""``bench/tensor_parallel.py`` on 4 CPU devices: its 70B part in smoke mode (tiny model) with
the overlapped step (``--overlap-chunks 1 2``), the shared and flat layouts and the planner's
mesh (``auto``) records every point with its split, roofline and collectives; an existing
result file is refused without ``--resume``, which keeps it; the full grid's memory prediction
at 80 layers on 2 H200s."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import tensor_parallel as tpb  # noqa: E402

SMOKE = ["--smoke", "--gpus", "4", "--part", "70b", "--batches", "8", "--overlap-chunks", "1", "2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp") / "tp.json")
    result = tpb.main(SMOKE + ["--out", out, "--commit", "abc123"])
    with open(out) as f:
        return out, result, json.load(f)


def test_smoke_records_overlap_layouts_auto_and_roofline(smoke):
    out, result, doc = smoke
    assert result["counts"]["measured"] == 6 and result["counts"]["errors"] == 0
    points = doc["points"]
    assert {(p["mode"], p["layout"], p["overlap_chunks"]) for p in points} == {
        ("tp", "shared", 1), ("tp", "flat", 1), ("tp", "shared", 2), ("tp", "flat", 2),
        ("auto", "shared", 1), ("auto", "flat", 1)}
    for p in points:
        assert p["status"] == "ok" and p["commit"] == "abc123", p
        assert p["roofline_ms"] > 0 and p["roofline_bytes_per_step"] > 0 and p["copy_bw_Bps"] > 0
        assert p["tp"] * p["dp"] == 4
    for p in points:
        if p["mode"] == "tp":
            assert (p["tp"], p["dp"]) == (4, 1) and p["allreduce_ms"] > 0
            assert p["allreduce_floor_ms"] == p["collective_ms_per_step_est"]
            assert ("allreduce_chunk_ms" in p) == (p["overlap_chunks"] == 2)
        else:
            assert (p["tp"], p["dp"]) == (p["plan_tp"], p["plan_dp"])
            assert p["plan_reason"].startswith(f"tensor_parallel={p['tp']} x data_parallel={p['dp']}")
            if p["tp"] == 4:     # the planner took tp 4: the explicit point's numbers are reused
                assert p["measured_as"] == "tp"
    assert doc["runs"][-1]["commit"] == "abc123"
    assert any("overlap 2" in line for line in doc["runs"][-1]["targets"]["lines"])


def test_existing_file_needs_resume_which_keeps_it(smoke, tmp_path):
    out, _, doc = smoke
    with pytest.raises(SystemExit, match="exists: pass --resume"):
        tpb.main(SMOKE + ["--out", out])
    again = tpb.main(SMOKE + ["--out", out, "--resume"])
    assert again["counts"]["skipped_existing"] == 6 and again["counts"]["measured"] == 0
    fresh = tpb.main(SMOKE + ["--out", str(tmp_path / "none.json"), "--budget-s", "0"])
    assert fresh["counts"]["not_started_budget"] == 6


def test_bad_overlap_chunks_are_refused(capsys):
    with pytest.raises(SystemExit):
        tpb.parse_args(["--smoke", "--overlap-chunks", "0"])
    assert "CollectiveMatmul.overlap_chunks must be an int >= 1" in capsys.readouterr().err


def test_70b_grid_on_two_h200s_at_80_layers():
    """What fits at 80 layers on tp 2 under a 129 GiB limit: every shared point; flat only at
    P=1K with B <= 256."""
    args = tpb.parse_args(["--part", "70b", "--modes", "tp", "--mem-limit-gb", "129"])
    assert args.layers_70b == 80
    bench = tpb.Bench(args)
    plan = tpb.plan_points(args)
    assert len(plan) == 12 and {p["layout"] for p in plan} == {"shared", "flat"}
    fits = {(p["batch"], p["prefix"], p["layout"]) for p in plan if bench.predict_oom(p) is None}
    assert fits == {(b, p, "shared") for b in (64, 256, 1024) for p in (1024, 16256)} | {
        (64, 1024, "flat"), (256, 1024, "flat")}
