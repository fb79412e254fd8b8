"""Smoke tests of the end-to-end benchmark scripts (bench/e2e_decode.py, long_document.py,
two_level.py, plots.py) and of bench/shared_prefix.py (kernels in interpret mode) on CPU with
tiny random models: they run, write the documented JSON, resume without redoing finished
points, record out-of-memory points as "X", and the tables, plots and target ratios are
regenerated from the JSON alone."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# faster XLA:CPU compiles for the subprocesses (the numbers are not measurements anyway): the
# runs are dominated by compiling small programs, and the legacy fusion emitters compile
# interpret-mode kernels about 3x faster than the MLIR ones
FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
            "--xla_cpu_use_fusion_emitters=false")

SMOKE_ARGS = {
    "e2e_decode": ["--part", "gqa", "--batches", "2", "--prefixes", "8"],
    "long_document": ["--questions", "2", "--backends", "shared", "flat"],
    "two_level": [],
}


def _run_smoke_scripts(d):
    """Run the three scripts' smoke modes into ``d`` (in parallel subprocesses); return the logs."""
    env = dict(os.environ, XLA_FLAGS=FAST_XLA, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    procs = {}
    for name, extra in SMOKE_ARGS.items():
        cmd = [sys.executable, os.path.join(ROOT, "bench", f"{name}.py"), "--smoke", "--out",
               str(d / f"{name}_cpu.json")] + extra
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    logs = {name: p.communicate(timeout=600)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} failed:\n{logs[name][-4000:]}"
    return logs


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The three scripts' smoke outputs, in a directory of this module's own (tests rewrite them).

    The scripts run once per pytest run: under pytest-xdist the first worker to get here runs
    them into pytest's shared base temporary directory (under a file lock) and every worker
    copies the results."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = shared / "bench_smoke_outputs"
    with open(shared / "bench_smoke_outputs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "logs.json").exists():
            cache.mkdir(exist_ok=True)
            logs = _run_smoke_scripts(cache)
            (cache / "logs.json").write_text(json.dumps(logs))
    d = tmp_path_factory.mktemp("bench_results")
    outs = {}
    for name in SMOKE_ARGS:
        outs[name] = str(d / f"{name}_cpu.json")
        shutil.copyfile(cache / f"{name}_cpu.json", outs[name])
    return {"dir": d, "outs": outs, "logs": json.loads((cache / "logs.json").read_text())}


def _load(path):
    with open(path) as f:
        return json.load(f)


def _check_header(data, benchmark):
    assert data["benchmark"] == benchmark
    assert data["schema"] == 1
    assert data["device_info"]["device"] and data["device_info"]["jax"]
    assert data["fixed"]["smoke"] is True
    assert len(data["runs"]) >= 1 and "settings" in data["runs"][0] and "jax" in data["runs"][0]


def test_e2e_decode_json(smoke_runs):
    data = _load(smoke_runs["outs"]["e2e_decode"])
    _check_header(data, "e2e_decode")
    pts = data["points"]
    assert sorted((p["backend"], p["prefix"]) for p in pts) == [("flat", 8), ("none", None), ("shared", 8)]
    for p in pts:
        assert p["status"] == "ok", p
        assert p["part"] == "gqa" and p["model"] == "llama3.1-8b" and p["layers"] == 1 and p["batch"] == 2
        assert p["gen_tokens"] == data["fixed"]["gen_tokens"] == 8
        assert len(p["t1_s"]) == 3 and len(p["tk_s"]) == (1 if p["backend"] == "flat" else 2)
        assert all(t > 0 for t in p["t1_s"] + p["tk_s"])
        assert p["decode_s"] == pytest.approx(statistics.median(p["tk_s"]) - statistics.median(p["t1_s"]))
        assert p["logits_finite"] is True
        if p["timing_valid"]:
            assert p["tokens_per_s"] == pytest.approx(2 * 7 / p["decode_s"])
        else:
            assert p["tokens_per_s"] is None
    # identical cache contents: flat's first-step logits equal shared's (float32 smoke model)
    flat = next(p for p in pts if p["backend"] == "flat")
    assert flat["rel_err_first_logits_vs_shared"] < 1e-5
    _check_roofline(pts, "step_ms", 1.0, lambda p: (p["batch"],))
    assert "targets" in data["runs"][-1]


def test_long_document_json(smoke_runs):
    data = _load(smoke_runs["outs"]["long_document"])
    _check_header(data, "long_document")
    pts = data["points"]
    assert sorted(p["backend"] for p in pts) == ["flat", "shared"]
    for p in pts:
        assert p["status"] == "ok" and p["questions"] == 2 and p["model"] == "yi-6b-200k"
        assert p["all_answers_full_length"] is True
        assert len(p["times_s"]) == 2 and p["time_s"] > 0
        assert p["tokens_per_s"] == pytest.approx(2 * data["fixed"]["answer_tokens"] / p["time_s"])
        assert 2 * 3 <= p["question_tokens"] <= 2 * 5
    assert data["runs"][-1]["doc_prefill_s_excluded"] > 0
    _check_roofline(pts, "time_s", 1e3, lambda p: (p["questions"],))


def _check_roofline(pts, time_key, scale, group):
    """Shared / flat points carry one layer's attention floor and the run's rates; where their
    group's ``none`` point was timed, roofline = none + layers x floor."""
    nones = {group(p): p for p in pts if p["backend"] == "none"}
    for p in pts:
        if p["backend"] == "none":
            continue
        assert p["attn_floor_ms_per_layer"] > 0 and p["copy_bw_Bps"] > 0 and p["matmul_flops"] > 0
        none = nones.get(group(p))
        if none is None or p.get(time_key) is None or none.get(time_key) is None:
            assert "roofline_ms" not in p
            continue
        roof = none[time_key] * scale + p["layers"] * p["attn_floor_ms_per_layer"]
        assert p["roofline_ms"] == pytest.approx(roof)
        assert p["roofline_fraction"] == pytest.approx(roof / (p[time_key] * scale))
        assert p["measured_over_roofline"] == pytest.approx(p[time_key] * scale / roof)


def test_two_level_json(smoke_runs):
    data = _load(smoke_runs["outs"]["two_level"])
    _check_header(data, "two_level")
    pts = {(p["method"], p["problems"]): p for p in data["points"]}
    assert set(pts) == {("single", 1), ("tree", 1), ("tree", 2)}
    assert pts[("single", 1)]["role"] == pts[("tree", 1)]["role"] == "equal_batch"
    assert pts[("tree", 2)]["role"] == "larger_batch"
    samples = data["fixed"]["samples"]
    for (method, prob), p in pts.items():
        assert p["status"] == "ok" and p["all_full_length"] is True
        assert p["batch"] == prob * samples
        assert p["per_problem_s"] == pytest.approx(p["total_s"] / prob)
        assert len(p["problem_tokens"]) == prob and all(6 <= n <= 12 for n in p["problem_tokens"])
    assert data["runs"][-1]["p_equal_p_large"] == [1, 2]
    assert data["runs"][-1]["counts"]["measured"] == 3


def test_rerun_skips_finished_points_and_redoes_missing(smoke_runs):
    from bench import e2e_decode  # noqa: PLC0415
    out = smoke_runs["outs"]["e2e_decode"]
    argv = ["--smoke", "--out", out] + SMOKE_ARGS["e2e_decode"]
    before = _load(out)
    res = e2e_decode.main(argv)
    assert res["counts"]["measured"] == 0 and res["counts"]["skipped_existing"] == 3
    after = _load(out)
    assert after["points"] == before["points"] and len(after["runs"]) == len(before["runs"]) + 1
    # a run cut off before the "none" point: only that point is measured again
    after["points"] = [p for p in after["points"] if p["backend"] != "none"]
    with open(out, "w") as f:
        json.dump(after, f)
    res = e2e_decode.main(argv)
    assert res["counts"]["measured"] == 1 and res["counts"]["skipped_existing"] == 2
    final = _load(out)
    assert sorted(p["backend"] for p in final["points"]) == ["flat", "none", "shared"]
    # measured fields unchanged; the roofline fields are derived again against the new none point
    derived = ("roofline_ms", "measured_over_roofline", "roofline_fraction", "shared_over_none_time")
    strip = lambda ps: [{k: v for k, v in p.items() if k not in derived} for p in ps]  # noqa: E731
    assert strip(p for p in final["points"] if p["backend"] != "none") == strip(after["points"])


def test_mismatched_settings_refused(smoke_runs):
    from bench import e2e_decode  # noqa: PLC0415
    out = smoke_runs["outs"]["e2e_decode"]
    n = len(_load(out)["runs"])
    with pytest.raises(ValueError, match="fixed settings"):
        e2e_decode.main(["--smoke", "--out", out, "--gen-tokens", "5"] + SMOKE_ARGS["e2e_decode"])
    assert len(_load(out)["runs"]) == n


def test_predicted_out_of_memory_is_recorded_as_x(tmp_path):
    from bench import e2e_decode, long_document, plots  # noqa: PLC0415
    out = str(tmp_path / "e2e_decode_cpu.json")
    res = e2e_decode.main(["--smoke", "--out", out, "--mem-limit-gb", "0.001", "--part", "mha"])
    assert res["counts"] == {"measured": 0, "skipped_existing": 0, "oom": 3, "errors": 0, "not_started_budget": 0}
    data = _load(out)
    assert all(p["status"] == "oom" and p["oom"].startswith("predicted") for p in data["points"])
    # a rerun does not retry out-of-memory points
    assert e2e_decode.main(["--smoke", "--out", out, "--mem-limit-gb", "0.001", "--part", "mha"])["counts"][
        "skipped_existing"] == 3
    table = plots.e2e_table_md(plots.e2e_index(data)["mha"])
    assert table.splitlines()[2] == "| 4 | X | X | X | - | - |"
    out2 = str(tmp_path / "long_document_cpu.json")
    res = long_document.main(["--smoke", "--out", out2, "--mem-limit-gb", "0.001", "--questions", "4"])
    assert res["counts"]["oom"] == 3
    assert "| 4 | X | X | X | X | - | - |" in plots.long_document_table_md(_load(out2))


def test_budget_stops_before_new_points(tmp_path):
    from bench import two_level  # noqa: PLC0415
    out = str(tmp_path / "two_level_cpu.json")
    res = two_level.main(["--smoke", "--out", out, "--budget-min", "0", "--part", "equal"])
    assert res["counts"]["measured"] == 0 and res["counts"]["not_started_budget"] == 2
    assert _load(out)["points"] == []


def test_is_oom():
    from bench.e2e_common import is_oom  # noqa: PLC0415
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 38.76GiB"))
    assert is_oom(MemoryError())
    assert not is_oom(ValueError("shapes do not match"))
    # a kernel over the SM's shared memory is a bug, not an out-of-memory point
    assert not is_oom(RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded"))
    from bench import timing  # noqa: PLC0415
    assert timing.is_oom is is_oom  # one definition for every benchmark


def _e2e_point(part, b, p, backend, tps, status="ok"):
    return {"part": part, "model": "m", "layers": 16, "batch": b, "prefix": p, "backend": backend,
            "status": status, "tokens_per_s": tps}


def test_targets_from_constructed_results():
    from bench import plots  # noqa: PLC0415
    pts = [_e2e_point("gqa", 256, None, "none", 100.0), _e2e_point("gqa", 1024, None, "none", 400.0),
           _e2e_point("gqa", 256, 1024, "shared", 90.0), _e2e_point("gqa", 256, 8192, "shared", 85.0),
           _e2e_point("gqa", 1024, 1024, "shared", 360.0), _e2e_point("gqa", 1024, 8192, "shared", 300.0),
           _e2e_point("gqa", 256, 1024, "flat", 50.0), _e2e_point("gqa", 256, 8192, "flat", 5.0),
           _e2e_point("gqa", 1024, 8192, "flat", None, status="oom")]
    t = plots.e2e_targets({"points": pts})
    assert t["shared_vs_none"]["min"] == pytest.approx(0.75)
    assert t["shared_vs_none"]["at"] == {"part": "gqa", "batch": 1024, "prefix": 8192}
    assert t["shared_vs_none"]["points_meeting"] == 3 and not t["shared_vs_none"]["met"]
    loss = t["prefix_loss_at_largest_batch"]["gqa"]
    assert loss["shared"] == pytest.approx(1 - 300 / 360) and not loss["met"] and loss["flat"] is None
    assert t["shared_vs_flat"]["min"] == pytest.approx(17.0) and t["shared_vs_flat"]["met"]
    assert t["shared_vs_flat"]["points"] == 1

    tl = {"fixed": {"samples": 128}, "points": [
        {"method": "single", "problems": 1, "batch": 128, "role": "equal_batch", "status": "ok",
         "per_problem_s": 6.0, "decode_per_problem_s": 5.0},
        {"method": "tree", "problems": 1, "batch": 128, "role": "equal_batch", "status": "ok",
         "per_problem_s": 4.0, "decode_per_problem_s": 2.5},
        {"method": "tree", "problems": 4, "batch": 512, "role": "larger_batch", "status": "ok",
         "per_problem_s": 2.0, "decode_per_problem_s": 1.5}]}
    t2 = plots.two_level_targets(tl)
    assert t2["tree_vs_single_equal_batch"]["total"] == pytest.approx(1.5)
    assert t2["tree_vs_single_equal_batch"]["decode_only"] == pytest.approx(2.0)
    assert t2["tree_vs_single_equal_batch"]["met"]
    assert t2["tree_large_vs_single"]["total"] == pytest.approx(3.0)


def test_plots_and_readme_from_json(smoke_runs, tmp_path):
    from bench import plots  # noqa: PLC0415
    readme = tmp_path / "README.md"
    readme.write_text(f"# bench\n\n{plots.BEGIN}\nold\n{plots.END}\n\nafter\n")
    pdir = tmp_path / "plots"
    # smoke results are skipped unless asked for: the tables say "not yet run on GPU"
    res = plots.main(["--results", str(smoke_runs["dir"]), "--plots", str(pdir), "--readme", str(readme)])
    text = readme.read_text()
    assert text.count("_Not yet run on GPU._") == 3 and "old" not in text and text.endswith("after\n")
    assert res["lines"] == []
    res = plots.main(["--results", str(smoke_runs["dir"]), "--plots", str(pdir), "--readme", str(readme),
                      "--include-smoke"])
    text = readme.read_text()
    assert "Not yet run on GPU" not in text and "CPU smoke run, not a measurement" in text
    assert "| batch | flat 8 | shared 8 | none (all) | shared/none min | shared/roofline min |" in text
    assert "| questions | shared (s) | flat (s) | none (s)" in text and "| single | equal_batch | 1 | 2 |" in text
    names = sorted(os.listdir(pdir))
    # the roofline plot exists where a smoke run's decode timing rose above noise (timing_valid)
    roof = ["e2e_decode_cpu_roofline.png"] if any(
        p["backend"] == "shared" and p["status"] == "ok" and p.get("roofline_fraction") is not None
        for p in _load(smoke_runs["outs"]["e2e_decode"])["points"]) else []
    assert names == sorted(roof + ["e2e_decode_cpu_vs_batch.png", "e2e_decode_cpu_vs_prefix.png",
                                   "long_document_cpu.png", "two_level_cpu.png"])
    for n in names:
        with open(pdir / n, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert f"![{n}](plots/{n})" in text
    assert any("two-level vs single-level at equal batch 2" in ln for ln in res["lines"])


def test_run_points_records_runtime_oom_and_errors_and_goes_on(tmp_path):
    from bench import e2e_common as ec  # noqa: PLC0415
    path = str(tmp_path / "x_cpu.json")
    store = ec.ResultStore(path, "x", ("n",), {"a": 1}, {})
    calls = []

    def measure(point):
        calls.append(point["n"])
        if point["n"] == 0:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB")
        if point["n"] == 1:
            raise ValueError("some bug")
        return {"value": 10 * point["n"]}

    plan = [{"n": i} for i in range(3)]
    counts = ec.run_points(store, plan, measure, ec.Budget(None), log=lambda *a, **k: None)
    assert counts == {"measured": 1, "skipped_existing": 0, "oom": 1, "errors": 1, "not_started_budget": 0}
    pts = {p["n"]: p for p in _load(path)["points"]}
    assert pts[0]["status"] == "oom" and pts[0]["oom"].startswith("measured: RuntimeError: RESOURCE_EXHAUSTED")
    assert pts[1]["status"] == "error" and "some bug" in pts[1]["error"]
    assert pts[2] == {"n": 2, "status": "ok", "value": 20, "wall_s": pts[2]["wall_s"]}
    # reopening: the error point is retried (and replaced), finished and out-of-memory points are not
    store = ec.ResultStore(path, "x", ("n",), {"a": 1}, {})
    calls.clear()
    counts = ec.run_points(store, plan, lambda p: {"value": -1}, ec.Budget(None), log=lambda *a, **k: None)
    assert counts["measured"] == 1 and counts["skipped_existing"] == 2
    data = _load(path)
    assert [p["n"] for p in data["points"]] == [0, 2, 1] and data["points"][-1]["value"] == -1
    assert len(data["runs"]) == 2
    with pytest.raises(ValueError, match="fixed settings"):
        ec.ResultStore(path, "x", ("n",), {"a": 2}, {})
    with pytest.raises(ValueError, match="holds benchmark"):
        ec.ResultStore(path, "y", ("n",), {"a": 1}, {})


# ------------------------------------------------------------------ GPU: real layer shapes, tiny sizes
# A minute of GPU time that exercises the Pallas kernel paths of all three scripts before the long runs.

@pytest.mark.gpu
def test_gpu_e2e_decode_tiny(tmp_path):
    from bench import e2e_decode  # noqa: PLC0415
    out = str(tmp_path / "e2e.json")
    res = e2e_decode.main(["--part", "gqa", "--layers", "1", "--batches", "8", "--prefixes", "512",
                           "--gen-tokens", "8", "--out", out])
    assert res["counts"]["measured"] == 3, res
    pts = {p["backend"]: p for p in _load(out)["points"]}
    assert all(p["status"] == "ok" and p["logits_finite"] for p in pts.values())
    assert pts["flat"]["rel_err_first_logits_vs_shared"] < 2e-2     # bf16, same cache contents


@pytest.mark.gpu
def test_gpu_long_document_tiny(tmp_path):
    from bench import long_document  # noqa: PLC0415
    out = str(tmp_path / "ld.json")
    res = long_document.main(["--layers", "1", "--doc-tokens", "700", "--questions", "4", "--answer-tokens", "4",
                              "--reps", "1", "--out", out])
    assert res["counts"]["measured"] == 3, res
    assert all(p["status"] == "ok" and p["all_answers_full_length"] for p in _load(out)["points"])


@pytest.mark.gpu
def test_gpu_two_level_tiny(tmp_path):
    from bench import two_level  # noqa: PLC0415
    out = str(tmp_path / "tl.json")
    res = two_level.main(["--layers", "1", "--root-tokens", "300", "--problem-len", "40", "90", "--samples", "4",
                          "--gen-tokens", "4", "--equal-problems", "1", "--large-problems", "2", "--max-problems", "2",
                          "--out", out])
    pts = _load(out)["points"]
    assert len(pts) == 3 and all(p["status"] == "ok" and p["all_full_length"] for p in pts), res


def test_e2e_index_separates_layer_counts_of_one_part():
    from bench import plots  # noqa: PLC0415
    pts = [_e2e_point("gqa", 32, 1024, "shared", 10.0), _e2e_point("gqa", 32, None, "none", 20.0),
           dict(_e2e_point("gqa", 32, 1024, "shared", 5.0), layers=32)]
    idx = plots.e2e_index({"points": pts})
    assert sorted(idx) == ["gqa (16 layers)", "gqa (32 layers)"]
    assert idx["gqa (16 layers)"]["pts"][(32, 1024, "shared")]["tokens_per_s"] == 10.0
    assert idx["gqa (32 layers)"]["pts"][(32, 1024, "shared")]["tokens_per_s"] == 5.0
    assert plots.e2e_targets({"points": pts})["shared_vs_none"]["points"] == 1


def test_shared_prefix_bench_smoke(tmp_path):
    """``bench/shared_prefix.py --smoke`` (every kernel in interpret mode, tiny shapes): the
    probe, the small-GQA set (a prefix of 4000, no multiple of any tile) and
    the grid are measured; the probe and small-GQA points with every column, each column's
    output checked against ours and ours against the reference; a ``--resume`` run keeps them."""
    out = str(tmp_path / "sp.json")
    env = dict(os.environ, XLA_FLAGS=FAST_XLA, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "shared_prefix.py"), "--smoke", "--out", out]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = _load(out)
    assert data["info"]["device"] and data["copy_bw_Bps"] > 0 and data["matmul_flops"] > 0
    small = [r for r in data["results"] if r.get("small_gqa")]
    probes = [r for r in data["results"] if r.get("probe")]
    assert len(small) == 1 and len(probes) == 1 and len(data["results"]) == 3
    assert (small[0]["batch"], small[0]["prefix"], small[0]["heads_q"], small[0]["heads_kv"]) == (3, 100, 4, 1)
    for r in small + probes:
        for c in ("shared", "flat", "flat_gqa", "composed", "auto"):
            assert isinstance(r[c + "_ms"], float) and r[c + "_ms"] > 0, (c, r.get(c + "_error"))
        assert r["maxdiff_vs_reference"] < 2e-2
        for c in ("flat", "flat_gqa", "composed"):
            assert r[c + "_maxdiff_vs_shared"] < 2e-2, c
        assert r["auto_ms"] == r[r["auto_choice"] + "_ms"]
        assert r["auto_over_best"] == pytest.approx(r["auto_ms"] / min(r["shared_ms"], r["flat_ms"]))
    assert "small GQA points" in run.stdout
    assert os.path.exists(os.path.join(tmp_path, "sp.png"))
    # a resumed run measures nothing again and keeps every record
    run2 = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert run2.returncode == 0, run2.stdout[-3000:] + run2.stderr[-3000:]
    again = _load(out)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "run"} for r in rs]  # noqa: E731
    assert strip(again["results"]) == strip(data["results"])
    assert len(again["earlier_runs"]) == 1


def _run_grad_smoke(script: str, out: str) -> dict:
    """Run a gradient benchmark with ``--smoke`` on the CPU; its JSON, with the run's rates."""
    env = dict(os.environ, XLA_FLAGS=FAST_XLA, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), "--smoke", "--out", out]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = _load(out)
    assert data["info"]["device"] and data["copy_bw_Bps"] > 0 and data["matmul_flops"] > 0
    return data


def test_shared_prefix_grad_bench_smoke(tmp_path):
    """``bench/shared_prefix_grad.py --smoke`` (interpret mode, tiny shapes, one and two prefix
    groups): every column timed with its memory recorded, the kernel backward's gradients and
    the concatenated-KV flash gradients within bf16 tolerance of the reference backward's."""
    data = _run_grad_smoke("shared_prefix_grad.py", str(tmp_path / "spg.json"))
    assert [r["groups"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        for c in ("kernels", "refbwd", "concat_flash"):
            assert isinstance(r[c + "_ms"], float) and r[c + "_ms"] > 0, (c, r[c + "_ms"])
            assert isinstance(r[c + "_temp_bytes"], int)
        for c in ("kernels", "concat_flash"):
            assert r[c + "_finite"] is True
            errs = r[c + "_rel_err_vs_refbwd"]
            assert set(errs) == {"dq", "dprefix_k", "dprefix_v", "dsuffix_k", "dsuffix_v"}
            assert 0 < max(errs.values()) < 2e-2, errs  # (0: the same backward ran twice)
        assert r["kernels_over_floor"] == pytest.approx(r["kernels_ms"] / r["floor_ms"])


def test_tree_attention_grad_bench_smoke(tmp_path):
    """``bench/tree_attention_grad.py --smoke`` (interpret mode, two small multi-level trees, Tq 1
    and 3): every column timed with its memory recorded, the kernel backward's and the gathered
    contexts' flash gradients within bf16 tolerance of the mirror backward's."""
    data = _run_grad_smoke("tree_attention_grad.py", str(tmp_path / "tag.json"))
    assert [r["tq"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["depth"] >= 2
        for c in ("kernels", "auto", "mirror", "concat_flash"):
            assert isinstance(r[c + "_ms"], float) and r[c + "_ms"] > 0, (c, r[c + "_ms"])
            assert isinstance(r[c + "_temp_bytes"], int)
        for c in ("kernels", "auto", "concat_flash"):
            assert r[c + "_finite"] is True
            errs = r[c + "_rel_err_vs_mirror"]
            assert set(errs) == {"dq", "dk_pool", "dv_pool", "dsuffix_k", "dsuffix_v"}
            assert max(errs.values()) < 2e-2, errs
            # (0 only for auto: off the GPU it is the mirror itself)
            assert (max(errs.values()) == 0) == (c == "auto"), (c, errs)
        assert r["kernels_over_floor"] == pytest.approx(r["kernels_ms"] / r["floor_ms"])


def test_roofline_from_constructed_points():
    """roofline = none + layers x floor per group; the floor is the shared path's bytes / flops."""
    from bench import roofline  # noqa: PLC0415
    f = roofline.attention_floor(batch=4, tq=1, prefix=1000, suffix=10, heads_q=8, heads_kv=2, head_dim=64,
                                 bw=1e12, mma=1e15)
    assert f["bytes"] == (1000 + 40) * 2 * 2 * 64 * 2 + 2 * 4 * 8 * 64 * 2
    assert f["flops"] == 4 * 4 * 8 * 1010 * 64 and f["ms"] == pytest.approx(f["bytes"] / 1e12 * 1e3)
    pts = [{"backend": "none", "status": "ok", "questions": 8, "time_s": 1.0, "layers": 2},
           {"backend": "shared", "status": "ok", "questions": 8, "time_s": 1.5, "layers": 2,
            "attn_floor_ms_per_layer": 100.0},
           {"backend": "flat", "status": "ok", "questions": 8, "time_s": 3.0, "layers": 2,
            "attn_floor_ms_per_layer": 100.0},
           {"backend": "shared", "status": "ok", "questions": 16, "time_s": 2.0, "layers": 2,
            "attn_floor_ms_per_layer": 100.0}]
    assert roofline.annotate(pts, time_key="time_s", group=("questions",), scale=1e3) == 2
    assert pts[1]["roofline_ms"] == pytest.approx(1200.0) and pts[1]["roofline_fraction"] == pytest.approx(0.8)
    assert pts[1]["shared_over_none_time"] == pytest.approx(1.5)
    assert pts[2]["measured_over_roofline"] == pytest.approx(2.5)
    assert "roofline_ms" not in pts[3]          # no none point with 16 questions
