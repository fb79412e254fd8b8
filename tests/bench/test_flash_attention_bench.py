"""``bench/flash_attention.py`` and ``bench/plot_flash_attention.py`` on the CPU, no kernels run:
the grids (counts, tokens, GQA heads), the FLOP formula, point slicing, the JSON written after
every point and resumed with a fake harness (programs, timing and checks of constructed
numbers), the budget, the stand-in xprof wheel, and the plot and table of a synthetic JSON."""
from __future__ import annotations

import json
import os
import sys
import time
import zipfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import flash_attention as fa  # noqa: E402
from bench import plot_flash_attention as pfa  # noqa: E402
from bench import pack_tokamax  # noqa: E402
from bench import flash_attention_sweep  # noqa: E402,F401  (imports cleanly)

K = 1024


def test_grids():
    core, full = fa.core_grid(), fa.full_grid()
    assert len(core) == 40 and len(full) == 198
    for grid in (core, full):
        assert len({p.key for p in grid}) == len(grid)
        for p in grid:
            assert p.b * p.t == p.tokens and p.tokens in (16 * K, 32 * K) and K <= p.t <= p.tokens
            assert p.hq == (32 if p.d <= 128 else 16) and p.hkv * p.group == p.hq
    assert set(core) <= set(full)
    assert {(p.d, p.group) for p in full} == {(d, g) for d in (64, 128, 256) for g in (1, 4, 8)}
    assert sorted({p.t for p in full if p.tokens == 32 * K}) == [t * K for t in (1, 2, 4, 8, 16, 32)]
    # head_dim 128 at 16K tokens: every T, G 1 and 8, causal and full, first in the list
    assert [(p.d, p.tokens) for p in core[:20]] == [(128, 16 * K)] * 20
    assert {(p.t, p.group, p.causal) for p in core[:20]} == {
        (t * K, g, c) for t in (1, 2, 4, 8, 16) for g in (1, 8) for c in (True, False)}
    p = fa.Point(32 * K, 32 * K, 256, 8, False)
    assert (p.b, p.hq, p.hkv, p.key) == (1, 16, 2, "N32768_T32768_D256_G8_full")
    assert p.describe()["hkv"] == 2 and p.scores_bytes() == 16 * (32 * K) ** 2 * 4


def test_flops():
    assert fa.fwd_flops(2, 1024, 32, 128, causal=False) == 4 * 2 * 32 * 1024 * 1024 * 128
    assert fa.fwd_flops(2, 1024, 32, 128, causal=True) == 2 * 2 * 32 * 1024 * 1024 * 128
    p = fa.Point(16 * K, 4 * K, 64, 4, True)
    assert p.flops("fwd") == fa.fwd_flops(4, 4 * K, 32, 64, True)
    assert p.flops("fwd_bwd") == 3.5 * p.flops("fwd")
    # GQA does not change the count; B x T fixed: flops grow with T
    assert fa.Point(16 * K, 4 * K, 64, 1, True).flops("fwd") == p.flops("fwd")
    assert fa.Point(16 * K, 8 * K, 64, 4, True).flops("fwd") == 2 * p.flops("fwd")


def test_select_points():
    pts = fa.core_grid()
    assert fa.select_points(pts, None) == pts
    assert fa.select_points(pts, "2:5") == pts[2:5]
    assert fa.select_points(pts, ":3") == pts[:3] and fa.select_points(pts, "38:") == pts[38:]
    assert fa.select_points(pts, "-2:") == pts[-2:]
    with pytest.raises(ValueError, match="i:j"):
        fa.select_points(pts, "3")
    assert fa.main(["--list", "--points", "5:7"])["points"] == [p.key for p in pts[5:7]]


def test_xla_skip_reason():
    small, large = fa.Point(16 * K, 1 * K, 128, 1, True), fa.Point(16 * K, 16 * K, 128, 1, True)
    assert fa._skip_reason(fa.Job(small, "xla", "fwd"), 8.0) is None
    assert "32 GiB" in fa._skip_reason(fa.Job(large, "xla", "fwd"), 8.0)
    assert fa._skip_reason(fa.Job(large, "cudnn", "fwd"), 8.0) is None


# ----------------------------------------------------------------------------------- fake harness
# Seconds per call per (contender, direction); a contender's forward output is the reference
# output plus its offset (rel_err = offset / 1 on an output of ones).
SECONDS = {("cudnn", "fwd"): 2e-3, ("cudnn", "fwd_bwd"): 8e-3, ("triton", "fwd"): 1e-3,
           ("triton", "fwd_bwd"): 10e-3, ("xla", "fwd"): 4e-3, ("xla", "fwd_bwd"): 16e-3}
OFFSET = {"cudnn": 0.0, "xla": 0.0, "triton": 0.01}


class FakeFn:
    def __init__(self, secs, out, fail=None):
        self.secs, self.out, self.fail = secs, out, fail

    def __call__(self, *args):
        return self.out


def fake_harness(compiled: list, fail: dict | None = None) -> fa.Harness:
    fail = fail or {}

    def compile_(jobs):
        compiled.extend(jobs)
        out = {}
        for j in jobs:
            if j.contender == fa.INPUTS:
                out[j] = fa.Program(fn=FakeFn(0, (np.ones(4),) * 4), lower_s=0.0, compile_s=0.0)
            elif (j.contender, j.direction) in fail:
                out[j] = fa.Program(fn=FakeFn(0, None, fail=fail[j.contender, j.direction]), lower_s=0.1,
                                    compile_s=0.2)
            else:
                out[j] = fa.Program(fn=FakeFn(SECONDS[j.contender, j.direction], np.ones(4) + OFFSET[j.contender]),
                                    lower_s=0.1, compile_s=0.2)
        return out

    def time_(fn, sets):
        if fn.fail:
            raise fn.fail
        return fn.secs

    return fa.Harness(compile=compile_, time=time_,
                      rel_err=lambda out, ref: float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_json_written_per_point_and_resumed(tmp_path):
    out = str(tmp_path / "fa.json")
    argv = ["--out", out, "--contenders", "triton,cudnn,xla", "--batch-points", "2", "--commit", "abc123"]
    compiled = []
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB")
    res = fa.main(argv + ["--points", "0:3"], harness=fake_harness(compiled, {("xla", "fwd_bwd"): oom}))
    assert res["counts"] == {"measured": 3, "skipped_existing": 0, "not_started_budget": 0}
    # batches of 2 points: per point the input generator and 3 contenders x 2 directions
    assert len(compiled) == 3 * 7 and sum(j.contender == fa.INPUTS for j in compiled) == 3
    doc = _load(out)
    assert doc["benchmark"] == "flash_attention" and doc["schema"] == fa.SCHEMA and doc["dtype"] == "bfloat16"
    run = doc["runs"][0]
    assert run["device"]["device"] and run["versions"]["jax"] and "jaxlib" in run["versions"]
    assert run["commit"] and run["commit_source"] in ("git", "argument")
    assert run["grid"] == "core" and run["points_slice"] == "0:3" and "--points 0:3" in run["argv"]
    assert run["counts"]["measured"] == 3 and run["wall_s"] >= 0
    pts = doc["points"]
    grid = fa.core_grid()
    assert [p["key"] for p in pts] == [p.key for p in grid[:3]]
    p0, point = pts[0], grid[0]
    assert (p0["b"], p0["t"], p0["hq"], p0["hkv"], p0["d"], p0["run"]) == (16, K, 32, 32, 128, 0)
    r = p0["results"]
    assert list(r) == ["triton", "cudnn", "xla"]
    assert r["triton"]["fwd"]["ms"] == pytest.approx(1.0)
    assert r["triton"]["fwd"]["tflops"] == pytest.approx(point.flops("fwd") / 1e-3 / 1e12)
    assert r["triton"]["fwd_bwd"]["tflops"] == pytest.approx(3.5 * point.flops("fwd") / 10e-3 / 1e12)
    assert r["triton"]["fwd"]["vs_cudnn"] == pytest.approx(2.0)
    assert r["triton"]["fwd_bwd"]["vs_cudnn"] == pytest.approx(0.8)
    assert r["cudnn"]["fwd"]["vs_cudnn"] == pytest.approx(1.0)
    assert r["xla"]["fwd"]["vs_cudnn"] == pytest.approx(0.5)
    assert r["xla"]["fwd_bwd"]["oom"] is True and "RESOURCE_EXHAUSTED" in r["xla"]["fwd_bwd"]["error"]
    assert r["triton"]["fwd"]["compile_s"] == 0.2
    assert p0["check"]["ref"] == "cudnn"
    assert p0["check"]["rel_err"] == {"triton": pytest.approx(0.01), "xla": 0.0}

    # resumed over a larger slice: only the new points are compiled and measured
    compiled.clear()
    res = fa.main(argv + ["--points", "0:5", "--resume"], harness=fake_harness(compiled))
    assert res["counts"] == {"measured": 2, "skipped_existing": 3, "not_started_budget": 0}
    assert {j.point.key for j in compiled} == {p.key for p in grid[3:5]}
    doc2 = _load(out)
    assert doc2["points"][:3] == pts and [p["run"] for p in doc2["points"]] == [0, 0, 0, 1, 1]
    assert len(doc2["runs"]) == 2 and doc2["runs"][1]["points_slice"] == "0:5"

    # without --resume an existing file is kept: the run refuses
    with pytest.raises(FileExistsError, match="--resume"):
        fa.main(argv + ["--points", "4:5"], harness=fake_harness([]))
    assert _load(out) == doc2


def test_resume_refuses_other_files(tmp_path):
    out = tmp_path / "old.json"
    out.write_text(json.dumps({"device": {}, "runs": []}))
    with pytest.raises(ValueError, match="cannot resume"):
        fa.main(["--out", str(out), "--resume", "--points", "0:1", "--contenders", "cudnn"], harness=fake_harness([]))
    out.unlink()
    fa.ResultStore(str(out), {"device": {"device": "H200"}}, resume=False).save()
    with pytest.raises(ValueError, match="measured on"):
        fa.ResultStore(str(out), {"device": {"device": "H100"}}, resume=True)


def test_errors_and_skips_recorded(tmp_path):
    store = fa.ResultStore(str(tmp_path / "e.json"), {"device": {"device": "cpu"}}, resume=False)
    point = fa.core_grid()[0]
    ones = FakeFn(0, (np.ones(4),) * 4)
    progs = {fa.Job(point, fa.INPUTS): fa.Program(fn=ones, lower_s=0, compile_s=0),
             fa.Job(point, "cudnn", "fwd"): fa.Program(error="lower: RuntimeError: cuDNN is not detected."),
             fa.Job(point, "cudnn", "fwd_bwd"): fa.Program(error="lower: RuntimeError: cuDNN is not detected."),
             fa.Job(point, "xla", "fwd"): fa.Program(skipped="too large"),
             fa.Job(point, "xla", "fwd_bwd"): fa.Program(skipped="too large")}
    h = fake_harness([])
    rec = fa.measure_point(point, progs, ["cudnn", "xla"], h)
    assert rec["results"]["cudnn"]["fwd"] == {"error": "lower: RuntimeError: cuDNN is not detected."}
    assert rec["results"]["xla"]["fwd_bwd"] == {"skipped": "too large"}
    assert rec["check"] == {"ref": None}
    store.add(rec)
    assert _load(str(tmp_path / "e.json"))["points"][0]["key"] == point.key


def test_budget_stops_before_new_points(tmp_path):
    store = fa.ResultStore(str(tmp_path / "b.json"), {"device": {"device": "cpu"}}, resume=False)
    compiled = []
    pts = fa.core_grid()[:3]
    counts = fa.run_grid(pts, store, ["cudnn"], fake_harness(compiled), fa.Budget(0.0, time.monotonic() - 1),
                         batch_points=2, log=lambda msg: None)
    assert counts == {"measured": 0, "skipped_existing": 0, "not_started_budget": 3}
    assert compiled == [] and store.doc["points"] == []
    counts = fa.run_grid(pts, store, ["cudnn"], fake_harness(compiled), fa.Budget(None, time.monotonic()),
                         batch_points=2, log=lambda msg: None)
    assert counts["measured"] == 3


def test_xprof_stub_wheel(tmp_path):
    path = pack_tokamax.write_xprof_stub(str(tmp_path))
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        assert "xprof/cli/tools/get_kernel_stats_tool.py" in names
        record = z.read("xprof-0.0.0.dist-info/RECORD").decode()
    assert all(n in record for n in names)
    assert any(w.startswith("tokamax==") for w in pack_tokamax.TOKAMAX_WHEELS)


def _synthetic_doc():
    pts = []
    for d, g in ((64, 1), (128, 8)):
        for t in (1024, 2048):
            for causal in (True, False):
                p = fa.Point(16 * K, t, d, g, causal)
                res = {"cudnn": {"fwd": {"tflops": 400.0, "ms": 1.0, "vs_cudnn": 1.0},
                                 "fwd_bwd": {"tflops": 300.0, "ms": 4.0, "vs_cudnn": 1.0}},
                       "triton": {"fwd": {"tflops": 350.0, "ms": 1.1, "vs_cudnn": 0.9},
                                  "fwd_bwd": {"error": "compile: boom"}},
                       "xla": {"fwd": {"skipped": "too large"}, "fwd_bwd": {"error": "x", "oom": True}}}
                pts.append(dict(p.describe(), results=res, check={"ref": "cudnn"}))
    return {"benchmark": "flash_attention", "schema": fa.SCHEMA, "points": pts,
            "runs": [{"device": {"device": "NVIDIA H200"}, "versions": {"jax": "0.11.2"}, "commit": "abc",
                      "contenders": ["triton", "cudnn", "xla"]}]}


def test_plot_and_table(tmp_path):
    doc = _synthetic_doc()
    assert pfa.panels(doc) == [(64, 1, 16 * K), (128, 8, 16 * K)]
    assert pfa.series(doc, (64, 1, 16 * K), "triton", "fwd", True) == [(1024, 350.0), (2048, 350.0)]
    assert pfa.series(doc, (64, 1, 16 * K), "triton", "fwd_bwd", True) == []
    table = pfa.table_md(doc)
    assert "| N16384_T1024_D64_G1_causal | fwd | 350 (0.90) | 400 (1.00) | skip |" in table
    assert "| N16384_T1024_D64_G1_causal | fwd_bwd | err | 300 (1.00) | X |" in table
    pytest.importorskip("matplotlib")
    path = tmp_path / "fa.json"
    path.write_text(json.dumps(doc))
    png = pfa.main([str(path)])
    assert png == str(tmp_path / "fa.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
