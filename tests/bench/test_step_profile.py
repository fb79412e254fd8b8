"""bench/step_profile.py: kernel times read from a Perfetto trace of the JAX profiler."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import step_profile as sp  # noqa: E402


def test_gpu_kernels_sums_the_compute_stream(tmp_path):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #14(Compute,Memset)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "python"}},
        {"ph": "X", "name": "gemm", "pid": 1, "tid": 7, "ts": 0, "dur": 10.0},
        {"ph": "X", "name": "gemm", "pid": 1, "tid": 7, "ts": 20, "dur": 12.0},
        {"ph": "X", "name": "attn", "pid": 1, "tid": 7, "ts": 40, "dur": 5.5},
        {"ph": "X", "name": "gemm", "pid": 1, "tid": 8, "ts": 0, "dur": 99.0},     # op line, not a kernel
        {"ph": "X", "name": "gemm", "pid": 2, "tid": 7, "ts": 0, "dur": 99.0},     # host
    ]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    us, count = sp.gpu_kernels(str(tmp_path))
    assert us == {"gemm": 22.0, "attn": 5.5} and count == {"gemm": 2, "attn": 1}


@pytest.mark.gpu
def test_gpu_profile_of_a_small_step():
    shared, none = sp.profile([(8, 1024)], 1)
    assert shared["point"]["backend"] == "shared" and none["point"]["backend"] == "none"
    assert none["total_us"] > 0 and shared["total_us"] > none["total_us"]


def test_mla_step_profile_classes_and_cpu_smoke(tmp_path):
    """bench/step_profile_mla.py: kernel names into classes; the CPU smoke run decodes and
    writes its result file (device, jax, commit)."""
    from bench import step_profile_mla as spm
    assert spm.kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert spm.kind("mosaic_gpu_mla_prefix") == "mla attention (Mosaic GPU)"
    assert spm.kind("loop_gather_fusion") == "gather / scatter"
    assert spm.kind("input_reduce_fusion") == "reduce"
    assert spm.kind("loop_multiply_fusion") == "other fusion"
    out = tmp_path / "prof.json"
    (res,) = spm.main(["--smoke", "4:16", "--commit", "abc1234", "--out", str(out)])
    assert res["point"]["batch"] == 4 and res["point"]["steps"] == spm.STEPS
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc1234" and doc["jax"] and doc["device"]
