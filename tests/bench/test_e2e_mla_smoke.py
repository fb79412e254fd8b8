"""``bench/e2e_decode_mla.py`` on CPU: a tiny DeepSeek model (reference attention) decodes a few
steps in the shared and the flat layout, every point records its timing, roofline and commit,
both layouts' first logits agree, an existing file is refused without ``--resume``; the full
DeepSeek-V2-Lite grid's memory prediction and kernel layout, the random weights' layout and the
MLA / MoE roofline arithmetic."""
from __future__ import annotations

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import e2e_common as ec  # noqa: E402
from bench import e2e_decode_mla as mla  # noqa: E402
from bench import roofline  # noqa: E402
from jax_prefix_attn.mla_kernels import kernels_supported  # noqa: E402
from models.deepseek import init_params  # noqa: E402
from models.deepseek.config import PRESETS  # noqa: E402

SMOKE = ["--smoke", "--commit", "abc123"]
V2_LITE = PRESETS["DeepSeek-V2-Lite"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mla") / "mla.json")
    result = mla.main(SMOKE + ["--out", out])
    with open(out) as f:
        return out, result, json.load(f)


def test_smoke_records_both_layouts_with_roofline(smoke):
    _, result, doc = smoke
    assert result["counts"]["measured"] == 2 and result["counts"]["errors"] == 0
    pts = {p["backend"]: p for p in doc["points"]}
    assert set(pts) == {"shared", "flat"}
    k = doc["fixed"]["gen_tokens"]
    for p in pts.values():
        assert p["status"] == "ok" and p["commit"] == "abc123" and p["logits_finite"] is True, p
        assert (p["model"], p["layers"], p["batch"], p["prefix"]) == ("deepseek-v2-lite", 2, 2, 8)
        assert p["moe_lowering"] == "buckets" and p["prefix_groups"] == 1
        assert p["mla_auto_impl"] in ("reference", "mgpu") and p["mla_auto_reason"]
        assert len(p["t1_s"]) == 3 and len(p["tk_s"]) == (1 if p["backend"] == "flat" else 2)
        assert p["roofline_ms"] > 0 and p["copy_bw_Bps"] > 0 and p["matmul_flops"] > 0
        assert p["roofline_ms"] >= (k - 1) * p["roofline_step_ms"]
        assert p["roofline_tokens_per_s"] == pytest.approx(2 / (p["roofline_step_ms"] * 1e-3))
        if p["timing_valid"]:
            assert p["roofline_fraction"] == pytest.approx(p["roofline_step_ms"] / p["step_ms"])
            assert p["tokens_per_s"] == pytest.approx(2 * (k - 1) / p["decode_s"])
    # the same prompt latents, stored once or per sequence: the first step's logits agree
    assert pts["flat"]["rel_err_first_logits_vs_shared"] < 1e-5
    assert pts["flat"]["roofline_cache_bytes_per_step"] > pts["shared"]["roofline_cache_bytes_per_step"]
    assert doc["runs"][-1]["commit"] == "abc123"
    # (the tiny smoke steps can be shorter than the timing noise: a ratio only where both timed)
    timed = all(p["timing_valid"] for p in pts.values())
    assert any("shared / flat" in line for line in doc["runs"][-1]["targets"]["lines"]) == timed


def test_existing_file_needs_resume_which_keeps_it(smoke):
    out, _, doc = smoke
    with pytest.raises(SystemExit, match="exists: pass --resume"):
        mla.main(SMOKE + ["--out", out])
    again = mla.main(SMOKE + ["--out", out, "--resume"])
    assert again["counts"]["skipped_existing"] == 2 and again["counts"]["measured"] == 0
    with open(out) as f:
        assert json.load(f)["points"] == doc["points"]


def test_random_params_have_the_models_layout():
    cfg = ec.deepseek_smoke_config(layers=3)
    shapes = lambda t: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    ours = ec.deepseek_random_params(cfg, seed=0, dtype=jnp.float32, host=True)
    assert shapes(ours) == shapes(init_params(cfg, seed=0, dtype=jnp.float32))
    assert sum(x.size for x in jax.tree_util.tree_leaves(ours)) == ec.deepseek_param_bytes(cfg, 1)


def test_full_grid_memory_prediction_and_kernel_layout(tmp_path):
    """27 layers at an H200's ~128 GiB limit: every shared point fits, flat does not at
    B >= 256 x 16K nor B = 1024 x 4K; both layouts are one prefix group the MLA kernels take."""
    args = mla.parse_args(["--mem-limit-gb", "128", "--out", str(tmp_path / "x.json")])
    plan = mla.plan_points(args)
    assert len(plan) == 30 and {p["layers"] for p in plan} == {27}
    bench = mla.Bench(args)
    oom = {(p["batch"], p["prefix"]) for p in plan if p["backend"] == "flat" and bench.predict_oom(p)}
    assert oom == {(256, 16384), (512, 16384), (1024, 4096), (1024, 16384)}
    assert not any(bench.predict_oom(p) for p in plan if p["backend"] == "shared")
    s = jax.ShapeDtypeStruct
    for p in plan:
        b, flat = p["batch"], p["backend"] == "flat"
        q = s((b, 1, 16, 512), jnp.bfloat16)
        qr = s((b, 1, 16, 64), jnp.bfloat16)
        pre = s((1, mla.FLAT_PLACEHOLDER if flat else p["prefix"], 512), jnp.bfloat16)
        suf = s((b, p["prefix"] + 128 if flat else 128, 512), jnp.bfloat16)
        assert kernels_supported(q, qr, pre, suf) is None, p


def test_mla_moe_roofline_arithmetic():
    c, item = V2_LITE, 2
    params = ec.deepseek_param_bytes(c, item)
    assert round(params / item / 1e9, 1) == 15.7
    one = roofline.mla_moe_step_cost(c, batch=1, prefix=1024, suffix=1, shared=True)
    full = roofline.mla_moe_step_cost(c, batch=64, prefix=1024, suffix=1, shared=True)
    assert (one["experts_touched"], full["experts_touched"]) == (6, 64)
    # 64 tokens touch every expert: every weight is read, the embedding only in the 64 rows gathered
    assert full["weight_bytes"] == params - (c.vocab_size - 64) * c.hidden_size * item
    flat = roofline.mla_moe_step_cost(c, batch=64, prefix=1024, suffix=1, shared=False)
    w = (c.kv_lora_rank + c.qk_rope_head_dim) * item * c.num_hidden_layers
    assert flat["cache_bytes"] - full["cache_bytes"] == 63 * 1024 * w
    assert flat["flops"] == full["flops"]
    r = roofline.mla_moe_roofline(c, batch=64, prefix=1024, steps=4, shared=True, bw=1e12, mma=1e15)
    steps = [roofline.mla_moe_step_cost(c, batch=64, prefix=1024, suffix=j, shared=True) for j in (1, 2, 3, 4)]
    per = [max(x["bytes"] / 1e12, x["flops"] / 1e15) * 1e3 for x in steps]
    assert r["roofline_ms"] == pytest.approx(sum(per))
    assert r["roofline_step_ms"] == pytest.approx(sum(per[1:]) / 3)
    assert r["roofline_bound"] == "memory" and math.isfinite(r["roofline_flops_per_step"])


@pytest.mark.gpu
def test_gpu_e2e_decode_mla_tiny(tmp_path):
    """Two layers of the real shapes (one dense, one MoE) at B=64 x P=1K on the GPU: the decoder's
    absorbed MLA takes the Mosaic GPU kernels in both layouts, which agree."""
    out = str(tmp_path / "mla.json")
    res = mla.main(["--layers", "2", "--batches", "64", "--prefixes", "1024", "--gen-tokens", "4", "--out", out])
    assert res["counts"]["measured"] == 2, res
    with open(out) as f:
        pts = {p["backend"]: p for p in json.load(f)["points"]}
    for p in pts.values():
        assert p["status"] == "ok" and p["logits_finite"] and p["roofline_step_ms"] > 0, p
        assert p["mla_auto_impl"] == "mgpu", p["mla_auto_reason"]
    assert pts["flat"]["rel_err_first_logits_vs_shared"] < 5e-2     # bf16, same cache contents
