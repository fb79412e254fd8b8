"""``bench/peers.py`` and its modules on the CPU: the paged layouts handed to FlashInfer (checked
through the torch reference of FlashInfer's wrappers against attention over each sequence's
gathered context in numpy), the ratios and targets from constructed records, and the script end
to end with tiny shapes (``--smoke``), resumed, and the one-line reason where FlashInfer is
absent."""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

torch = pytest.importorskip("torch")

from bench import flashinfer_reference as fr  # noqa: E402
from bench import peers_flashinfer as pfi  # noqa: E402
from bench.peers_paged import build_cache, paged_layout, single_prefix_tree  # noqa: E402
from bench.peers_summary import finish_point, summarize  # noqa: E402
from jax_prefix_attn import PrefixTree  # noqa: E402

HQ, HKV, D = 4, 2, 16


def _case(tree, sl, smax, seed):
    """bf16 inputs and the float64 numpy attention of every sequence over its gathered context
    (path spans, then its suffix)."""
    b, n = tree.num_seqs, tree.pool_extent
    rng = np.random.default_rng(seed)
    shapes = ((b, HQ, D), (n, HKV, D), (n, HKV, D), (b, smax, HKV, D), (b, smax, HKV, D))
    q, kp, vp, sk, sv = (jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16) for s in shapes)
    qf, kpf, vpf, skf, svf = (np.asarray(x, np.float64) for x in (q, kp, vp, sk, sv))
    ref = np.zeros((b, HQ, D))
    for i in range(b):
        idx = np.concatenate([np.arange(tree.starts[u], tree.starts[u] + tree.lengths[u]) for u in tree.path(i)])
        k = np.concatenate([kpf[idx], skf[i, :sl[i]]]).repeat(HQ // HKV, axis=1)   # [L, Hq, D]
        v = np.concatenate([vpf[idx], svf[i, :sl[i]]]).repeat(HQ // HKV, axis=1)
        s = np.einsum("hd,lhd->hl", qf[i], k) / np.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref[i] = np.einsum("hl,lhd->hd", p / p.sum(-1, keepdims=True), v)
    return q, kp, vp, sk, sv, ref


CASES = {
    # one prefix, a multiple of the page / not (partly filled last prefix page)
    "prefix_aligned": (single_prefix_tree(32, 3), [16, 16, 16], 16),
    "prefix_unaligned": (single_prefix_tree(37, 3), [5, 5, 5], 5),
    # root + 3 problems of unaligned lengths, 2 samples each, ragged suffixes
    "two_level": (PrefixTree.from_nested([[20, 7, 9, 16]], seqs_per_leaf=2), [1, 3, 5, 2, 4, 6], 6),
    # leaves at depths 2 and 3: no cascade, paged decode still works
    "mixed_depth": (PrefixTree.from_nested([[16, [5, 3, 4], 6]]), [2, 1, 2], 4),
    # one-token leaves without suffixes (speculative drafts)
    "no_suffix": (PrefixTree.from_nested([[30, 1, 1, 1]]), [0, 0, 0], 0),
}


@pytest.mark.parametrize("name,page_size", [(c, ps) for c in sorted(CASES) for ps in (16, 1)]
                         + [("two_level", 4), ("prefix_unaligned", 4)])
def test_paged_layout_attends_like_the_tree(name, page_size):
    """FlashInfer's cascade and paged decode (torch reference) over the layout equal attention
    over each sequence's gathered context on the same bf16 data."""
    tree, sl, smax = CASES[name]
    q, kp, vp, sk, sv, ref = _case(tree, sl, smax, seed=sorted(CASES).index(name))
    layout = paged_layout(tree, sl, smax, page_size)
    cache = pfi.to_torch(build_cache(layout, kp, vp, sk, sv))
    q_t, ws = pfi.to_torch(q), torch.empty(8)
    kinds = ["decode"] + (["cascade"] if name != "mixed_depth" else [])
    for kind in kinds:
        out = pfi.planned(fr, kind, layout, (HQ, HKV, D), ws).run(q_t, cache).float().numpy()
        np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2, err_msg=f"{kind} page {page_size}")
    if name == "mixed_depth":
        assert layout.cascade is None and "different depths" in layout.cascade_why_not
        with pytest.raises(ValueError, match="no cascade"):
            pfi.planned(fr, "cascade", layout, (HQ, HKV, D), ws)


def test_page_tables_of_one_prefix():
    """B=3 sequences, prefix 37, suffix 5, pages of 16: the cascade's top level is one request of
    all queries over the 3 prefix pages; paged decode shares the 2 full prefix pages and copies
    the 5-token tail with each suffix into 10 own tokens = 1 page per sequence."""
    layout = paged_layout(single_prefix_tree(37, 3), [5, 5, 5], 5, 16)
    top, suf = layout.cascade
    assert top.qo_indptr.tolist() == [0, 3] and top.kv_indices.tolist() == [0, 1, 2]
    assert top.last_page_len.tolist() == [37 - 32] and top.kv_lens.tolist() == [37]
    assert suf.qo_indptr.tolist() == [0, 1, 2, 3] and suf.kv_lens.tolist() == [5, 5, 5]
    dec = layout.decode
    assert dec.kv_lens.tolist() == [42, 42, 42]
    assert layout.shared_pages_per_seq.tolist() == [2, 2, 2]
    assert [dec.kv_indices[dec.kv_indptr[i]:dec.kv_indptr[i] + 2].tolist() for i in range(3)] == [[0, 1]] * 3
    assert int((layout.own_src >= 0).sum()) == 3 * 5 and int((layout.own_suffix >= 0).sum()) == 3 * 5
    assert layout.num_pages == 3 + 3 * 1 + 3 * 1
    for lv in (top, suf, dec):
        assert lv.kv_indices.dtype == np.int32 and lv.kv_indptr.dtype == np.int32
        assert ((lv.last_page_len >= 1) & (lv.last_page_len <= 16)).all()


def test_empty_suffix_has_no_cascade_level():
    layout = paged_layout(single_prefix_tree(32, 2), [3, 0], 3, 16)
    assert layout.cascade is None and "empty suffix" in layout.cascade_why_not
    assert layout.decode.kv_lens.tolist() == [35, 32]


def _rec(**kw):
    base = dict(kind="single", key="k", heads_q=32, heads_kv=8, batch=256, prefix=4096, suffix=128,
                tags=["probe"], floor_ms=0.05)
    return {**base, **kw}


def test_ratios_and_targets_from_constructed_records():
    a = finish_point(_rec(key="a", ours_auto_ms=0.1, fi_cascade_p16_ms=0.4, fi_cascade_p1_ms=0.5,
                          fi_decode_p16_ms=0.6, fi_decode_tc_p16_ms="error"))
    assert a["fi_cascade_best_ms"] == 0.4 and a["fi_decode_best_ms"] == 0.6 and a["fi_best_ms"] == 0.4
    assert a["fi_cascade_over_ours"] == pytest.approx(4.0) and a["ours_over_fi_best"] == pytest.approx(0.25)
    assert a["ours_over_floor"] == pytest.approx(2.0) and a["status"] == "ok"
    b = finish_point(_rec(key="b", batch=8, prefix=1024, ours_auto_ms=0.03, ours_auto_u8_ms=0.012,
                          fi_cascade_p16_ms=0.04, fi_decode_p16_ms=0.02))
    assert b["ours_best_ms"] == 0.012 and b["ours_over_fi_best"] == pytest.approx(1.5)
    assert b["ours_best_over_fi_best"] == pytest.approx(0.6)
    c = finish_point(_rec(key="c", kind="tree", name="apps8", ours_auto_ms=0.2, fi_cascade_p16_ms=0.3,
                          fi_cascade_levels=3, fi_decode_p16_ms=0.5, fi_cascade_p16_maxrel_vs_ours=0.004))
    t = summarize({"results": [a, b, c]})
    assert t["cascade_over_ours_large"] == {"min": pytest.approx(4.0), "at": "a", "points": 1, "met": True}
    assert t["ours_over_fi_best"]["max"] == pytest.approx(1.5) and not t["ours_over_fi_best"]["met"]
    assert t["ours_over_fi_best"]["points_missing"] == ["b"]
    assert t["ours_best_over_fi_best"]["met"] and t["ours_best_over_fi_best"]["max"] == pytest.approx(0.2 / 0.3)
    assert t["tree_cascade_over_ours"]["min"] == pytest.approx(1.5) and not t["tree_cascade_over_ours"]["met"]
    assert t["parity_max_rel"] == {"value": 0.004, "column": "fi_cascade_p16", "at": "c"}
    assert len(t["lines"]) == 5


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from bench import peers  # noqa: PLC0415
    out = str(tmp_path_factory.mktemp("peers") / "peers_cpu.json")
    res = peers.main(["--smoke", "--flashinfer-module", "bench.flashinfer_reference", "--out", out,
                      "--commit", "abc123"])
    return out, res["doc"]


def test_smoke_run_records_every_column(smoke):
    out, doc = smoke
    with open(out) as f:
        assert json.load(f) == json.loads(json.dumps(doc))
    run = doc["runs"][0]
    assert doc["commit"] == run["commit"] == "abc123" and run["copy_bw_Bps"] > 0 and run["matmul_flops"] > 0
    assert run["versions"]["flashinfer"] == "torch-reference" and run["versions"]["jax"] == jax.__version__
    assert run["flashinfer"]["available"] and run["flashinfer"]["warm_up"]["errors"] == []
    assert run["harness"]["torch_graph_empty_kernel"]["ms"] > 0
    assert set(doc["methodology"]) >= {"ours", "flashinfer", "harness_overheads", "parity", "floor"}
    kinds = sorted(r["kind"] for r in doc["results"])
    assert kinds == ["single"] * 2 + ["tree"]
    assert run["harness"]["jax_loop_identity"]["ms"] > 0 and run["harness"]["jax_loop_identity"]["u2_ms"] > 0
    cols = ["ours_auto", "fi_cascade_p16", "fi_cascade_p1", "fi_decode_p16", "fi_decode_tc_p16"]
    for r in doc["results"]:
        assert r["status"] == "ok" and r["floor_ms"] > 0
        for c in cols:
            assert isinstance(r[f"{c}_ms"], float) and r[f"{c}_ms"] > 0, (r["key"], c, r.get(f"{c}_error"))
        for c in cols[1:]:
            assert r[f"{c}_maxrel_vs_ours"] < 2e-2, (r["key"], c)
        assert r["fi_cascade_levels"] == (3 if r["kind"] == "tree" else 2)
        # the large points' own columns ran while FlashInfer warmed up; ours_auto was timed again
        first = r["tags"][0] in ("probe", "tree", "two_level")
        assert r["ours_during_flashinfer_compile"] == first == ("ours_auto_during_compile_ms" in r)
        assert r["fi_cascade_over_ours"] == pytest.approx(r["fi_cascade_best_ms"] / r["ours_auto_ms"])
        small = r["kind"] == "single" and r["batch"] <= 32
        assert ("ours_auto_u2_ms" in r) == small == ("jax_loop_identity_ms" in r)   # smoke: 2 calls per iteration
        assert r["ours_best_ms"] == min(r["ours_auto_ms"], r.get("ours_auto_u2_ms", np.inf))
    assert os.path.exists(os.path.splitext(out)[0] + ".png")
    from bench.peers_plot import table_md  # noqa: PLC0415
    assert table_md(doc).count("\n") == 2 + 2 + len(doc["results"]) - 1   # header, 2 groups, rows


def test_resume_keeps_finished_points(smoke):
    from bench import peers  # noqa: PLC0415
    out, doc = smoke
    again = peers.main(["--smoke", "--resume", "--flashinfer-module", "bench.flashinfer_reference", "--out", out])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "run"} for r in rs]  # noqa: E731
    assert strip(again["doc"]["results"]) == strip(doc["results"]) and len(again["doc"]["runs"]) == 2
    assert again["doc"]["runs"][1]["commit"] != "abc123"


def test_flashinfer_absent_gives_one_line_reason():
    fi, why = pfi.load("no_such_module_here")
    assert fi is None and why.startswith("no_such_module_here not importable") and "\n" not in why


@pytest.mark.gpu
def test_gpu_one_small_point(tmp_path):
    """One small point on the GPU with our kernels (and FlashInfer where it is importable)."""
    from bench import peers  # noqa: PLC0415
    res = peers.main(["--only", "single:hq32:hkv8:d128:b8:p1024:s64", "--out", str(tmp_path / "p.json")])
    (r,) = res["doc"]["results"]
    assert isinstance(r["ours_auto_ms"], float) and isinstance(r["ours_auto_u8_ms"], float)
    assert r["ours_auto_maxabs_vs_reference"] < 2e-2
    if "flashinfer_skipped" not in r:
        assert isinstance(r["fi_cascade_p16_ms"], float) and r["fi_cascade_p16_maxrel_vs_ours"] < 2e-2
