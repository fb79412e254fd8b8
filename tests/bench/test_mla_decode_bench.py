"""``bench/mla_decode.py`` on the CPU: the grid, the floor, FlashInfer's page tables, and the
script's core on its tiny points: ours through the Mosaic GPU kernels in interpret mode, flat
XLA, and FlashInfer's MLA wrapper API through its torch reference (where torch is installed;
else the reason is recorded).  The JSON's keys, its atomic rewrite, the refusal to overwrite
without ``--resume``, ``--resume`` keeping the measured points, the budget and memory skips;
the tables and plot of a synthetic result file."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import mla_decode as md  # noqa: E402
from bench import mla_decode_flashinfer as mfi  # noqa: E402
from bench import mla_decode_plot as mdp  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_grid_and_list():
    grid = md.full_grid()
    assert len(grid) == 80 and len({p.key for p in grid}) == 80
    assert {(p.model, p.heads) for p in grid} == {("v2lite", 16), ("v3", 128)}
    assert {p.batch for p in grid} == {64, 128, 256, 512, 1024}
    assert {p.prefix for p in grid} == {4096, 8192, 16384, 32768} and {p.suffix for p in grid} == {128, 1024}
    assert all((p.rank, p.rope) == (512, 64) for p in grid)
    assert grid[0].key == "v2lite_B64_P4096_S128" and grid[-1].key == "v3_B1024_P32768_S1024"
    assert md.main(["--list", "--points", "78:"])["points"] == [p.key for p in grid[78:]]
    assert md.select_points(grid, "-2:") == grid[-2:]
    with pytest.raises(ValueError, match="i:j"):
        md.select_points(grid, "3")


def test_cost_floor_and_memory():
    pt = md.Point("v3", 128, 64, 4096, 128)
    c = md.cost(pt)
    io = 64 * 128 * (576 + 512) * 2
    assert c["bytes"] == (4096 + 64 * 128) * 576 * 2 + io
    assert c["bytes_flat"] == 64 * (4096 + 128) * 576 * 2 + io
    assert c["flops"] == 2 * 64 * 128 * (4096 + 128) * (576 + 512)
    f = md.floors(c, bw=1e11, mma=1e15)
    assert f["floor_ms"] == pytest.approx(c["bytes"] / 1e11 * 1e3) and f["floor_bound"] == "memory"
    assert f["floor_flat_ms"] == pytest.approx(c["bytes_flat"] / 1e11 * 1e3)
    f = md.floors(c, bw=1e12, mma=1e14)      # 128 heads: flat or not, the products bound it
    assert f["floor_bound"] == "compute" and f["floor_ms"] == f["floor_flat_ms"] == pytest.approx(c["flops"] / 1e11)
    m = md.memory_bytes(pt)
    assert m["cache"] == 64 * (4096 + 128) * 576 * 2 and m["flat_xla"] > m["ours_flat"] > m["cache"]
    assert md.fits(100, None) is None and md.fits(90, 100) is None
    assert "GiB free" in md.fits(91, 100)


def test_page_table():
    t = mfi.page_table(3, 32, 48, 16)     # 2 shared prefix pages + 3 own pages per sequence
    assert t.num_pages == 2 + 3 * 3 and t.kv_len.tolist() == [80] * 3
    assert t.qo_indptr.tolist() == [0, 1, 2, 3] and t.kv_indptr.tolist() == [0, 5, 10, 15]
    assert t.kv_indices.reshape(3, 5).tolist() == [[0, 1, 2, 3, 4], [0, 1, 5, 6, 7], [0, 1, 8, 9, 10]]
    assert all(a.dtype == np.int32 for a in t[:4])
    with pytest.raises(ValueError, match="multiples of the page size"):
        mfi.page_table(2, 40, 16, 16)


def test_tiny_run_json_resume_budget(tmp_path):
    out = tmp_path / "mla.json"
    base = ["--tiny", "--out", str(out), "--commit", "abc1234", "--flashinfer-module", "reference"]
    res = md.main(base + ["--interpret", "--points", "0:1", "--contenders", "ours,flat_xla,flashinfer"])
    assert res["counts"] == {"measured": 1, "skipped_existing": 0, "not_started_budget": 0}
    assert sorted(os.listdir(tmp_path)) == ["mla.json"]           # the temporary file was renamed
    doc = _load(out)
    assert (doc["benchmark"], doc["schema"], doc["dtype"]) == ("mla_decode", md.SCHEMA, "bfloat16")
    run = doc["runs"][0]
    assert run["device"]["device"] and run["versions"]["jax"] and run["versions"]["jaxlib"]
    assert (run["commit"], run["commit_source"]) == ("abc1234", "argument")
    assert "--interpret" in run["argv"] and run["interpret"] and run["impl"] == "mgpu"
    assert run["rates"]["copy_bw_Bps"] > 0 and run["rates"]["matmul_flops"] > 0
    assert run["counts"]["measured"] == 1 and run["wall_s"] >= 0
    (p,) = doc["points"]
    assert (p["key"], p["status"], p["run"], p["heads"], p["rank"]) == ("tiny_B2_P64_S64", "ok", 0, 2, 128)
    assert p["floor_ms"] > 0 and p["bytes"] < p["bytes_flat"] and p["flops"] > 0
    ours, flat = p["results"]["ours"], p["results"]["flat_xla"]
    assert ours["ms"] > 0 and ours["over_floor"] == pytest.approx(ours["ms"] / p["floor_ms"])
    assert ours["timing"]["method"].startswith("one call")
    assert p["speedup"]["vs_flat_xla"] == pytest.approx(flat["ms"] / ours["ms"])
    assert p["check"]["ref"] == "ours" and p["check"]["rel_err"]["flat_xla"] < 2e-2
    fi = p["results"]["flashinfer"]
    if HAVE_TORCH:
        assert run["flashinfer"]["available"] and run["versions"]["flashinfer"] == "torch-reference"
        assert fi["ms"] > 0 and fi["backend"] == "torch-reference" and fi["pages"] == 4 + 2 * 4
        assert p["check"]["rel_err"]["flashinfer"] < 2e-2 and "vs_flashinfer" in p["speedup"]
        assert run["flashinfer"]["warm_up"]["errors"] == []
    else:
        assert "torch" in fi["skipped"] and not run["flashinfer"]["available"]

    # an existing file is refused without --resume, and left as it was
    before = out.read_text()
    with pytest.raises(FileExistsError, match="--resume"):
        md.main(base + ["--interpret"])
    assert out.read_text() == before

    # --resume keeps the measured point and adds the other (the library's pure-JAX path, and
    # our functions without prefix sharing over per-sequence caches)
    res = md.main(base + ["--resume", "--interpret", "--impl", "reference", "--contenders", "ours,ours_flat"])
    assert res["counts"] == {"measured": 1, "skipped_existing": 1, "not_started_budget": 0}
    doc2 = _load(out)
    assert len(doc2["runs"]) == 2 and doc2["points"][0] == p
    q = doc2["points"][1]
    assert (q["key"], q["run"], q["status"]) == ("tiny_B3_P32_S48", 1, "ok")
    assert q["results"]["ours_flat"]["ms"] > 0 and q["check"]["rel_err"]["ours_flat"] < 1e-2
    assert doc2["runs"][1]["flashinfer"]["reason"] == "not among --contenders"

    # the budget starts no point; a memory cap skips with the reason
    res = md.main(["--tiny", "--out", str(tmp_path / "b.json"), "--budget-s", "0", "--contenders", "ours"])
    assert res["counts"]["not_started_budget"] == 2
    doc3 = _load(tmp_path / "b.json")
    assert doc3["points"] == [] and doc3["runs"][0]["not_started_budget"] == ["tiny_B2_P64_S64", "tiny_B3_P32_S48"]
    md.main(["--tiny", "--out", str(tmp_path / "m.json"), "--mem-limit-gb", "1e-9", "--contenders", "ours"])
    assert all(p["status"] == "skipped" and "GiB free" in p["skipped"] for p in _load(tmp_path / "m.json")["points"])


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
def test_flashinfer_entries_follow_its_compile(tmp_path, monkeypatch):
    """A point measured while FlashInfer's warm-up (its nvcc compile) runs is saved as
    "partial" and gets its FlashInfer entry once the warm-up is done."""
    started = threading.Event()
    warm_up, measure_jax = mfi.warm_up, md.measure_jax

    def slow_warm_up(*args):
        started.wait(60)
        time.sleep(0.5)
        warm_up(*args)

    def measure_and_release(pt, ctx):
        out = measure_jax(pt, ctx)
        started.set()
        return out

    monkeypatch.setattr(mfi, "warm_up", slow_warm_up)
    monkeypatch.setattr(md, "measure_jax", measure_and_release)
    out = tmp_path / "d.json"
    md.main(["--tiny", "--out", str(out), "--interpret", "--impl", "reference", "--contenders",
             "ours,flashinfer", "--flashinfer-module", "reference"])
    doc = _load(out)
    first = doc["points"][0]
    assert first["jax_during_flashinfer_compile"] and first["results"]["flashinfer"]["ms"] > 0
    assert all(p["status"] == "ok" and "vs_flashinfer" in p["speedup"] for p in doc["points"])
    assert doc["runs"][0]["flashinfer"]["warm_up"]["errors"] == []


def test_store_atomic_and_resume_checks(tmp_path):
    path = tmp_path / "s.json"
    st = md.Store(str(path), {"device": {"device": "cpu"}}, resume=False)
    st.put({"key": "a", "status": "ok"})
    st.put({"key": "b", "status": "partial"})
    st.put({"key": "d", "status": "skipped"})
    good = path.read_text()
    st.doc["points"].append({"key": "c", "value": object()})      # not serialisable: json.dump fails midway
    with pytest.raises(TypeError):
        st.save()
    assert path.read_text() == good and sorted(os.listdir(tmp_path)) == ["s.json"]
    again = md.Store(str(path), {"device": {"device": "cpu"}}, resume=True)
    assert again.done == {"a"} and len(again.doc["runs"]) == 2     # the others are measured again
    with pytest.raises(ValueError, match="measured on"):
        md.Store(str(path), {"device": {"device": "H200"}}, resume=True)
    (tmp_path / "o.json").write_text(json.dumps({"benchmark": "peers", "runs": [], "points": []}))
    with pytest.raises(ValueError, match="cannot resume"):
        md.Store(str(tmp_path / "o.json"), {"device": {"device": "cpu"}}, resume=True)


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
def test_reference_wrapper_checks_its_inputs():
    import torch
    t = mfi.page_table(2, 16, 16, 16)
    w = mfi.ReferenceMLAWrapper(torch.empty(8, dtype=torch.uint8))
    tabs = [torch.from_numpy(a) for a in t[:4]]
    with pytest.raises(ValueError, match="int32"):
        w.plan(tabs[0].long(), *tabs[1:], 2, 128, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    w.plan(*tabs, num_heads=2, head_dim_ckv=128, head_dim_kpe=64, page_size=16, causal=False, sm_scale=0.1,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    ckv = torch.randn(t.num_pages, 16, 128).bfloat16()
    kpe = torch.randn(t.num_pages, 16, 64).bfloat16()
    qn, qp = torch.randn(2, 2, 128).bfloat16(), torch.randn(2, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="contiguous"):
        w.run(qn, qp, ckv.transpose(0, 1).contiguous().transpose(0, 1), kpe)
    out = w.run(qn, qp, ckv, kpe)
    c = torch.cat([ckv[0], ckv[1 + 1]]).float()                   # sequence 1: shared page 0, own page 2
    k = torch.cat([kpe[0], kpe[2]]).float()
    p = torch.softmax((qn[1].float() @ c.T + qp[1].float() @ k.T) * 0.1, dim=-1)
    torch.testing.assert_close(out[1].float(), (p @ c), atol=1e-2, rtol=1e-2)


def _synthetic_doc():
    pts = []
    for model, heads in (("v2lite", 16), ("v3", 128)):
        for b in (64, 128):
            for pre in (4096, 8192):
                pt = md.Point(model, heads, b, pre, 128)
                res = {"ours": {"ms": 0.1}, "flat_xla": {"skipped": "needs ~50 GiB"},
                       "flashinfer": {"ms": 0.3} if b == 64 else {"error": "boom"}}
                sp = {"vs_flashinfer": 3.0} if b == 64 else {}
                pts.append(dict(pt.describe(), status="ok", floor_ms=0.05, results=res, speedup=sp))
    return {"benchmark": "mla_decode", "runs": [{"device": {"device": "NVIDIA H200"}, "commit": "abc"}],
            "points": pts}


def test_tables_and_plot(tmp_path):
    doc = _synthetic_doc()
    assert mdp.panels(doc) == [("v2lite", 16, 128), ("v3", 128, 128)]
    assert mdp.series(doc, ("v3", 128, 128), 4096, "flashinfer") == [(64, 3.0)]
    assert mdp.series(doc, ("v3", 128, 128), 4096, "flat_xla") == []
    table = mdp.table_md(doc)
    assert "| 64 | 0.100 (3.00 / -) | 0.100 (3.00 / -) |" in table and "| 128 | 0.100 (- / -)" in table
    line = mdp.point_line(doc["points"][2])
    assert "flat_xla skip" in line and "flashinfer err" in line
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    png = mdp.main([str(path)])
    assert png == str(tmp_path / "r.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
