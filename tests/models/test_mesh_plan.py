"""The mesh choice (``models.mesh_plan``) and the device profile it reads: the modelled decode
step against the steps measured on two H200s, the choice at those points and at the shapes
where the trade-off turns, memory refusals and argument errors."""
import json
import os

import pytest

from jax_prefix_attn.device import CPU, H100_SXM, H200
from jax_prefix_attn.device_profile import DeviceProfile, device_profile, profiles
from models.config import LlamaConfig
from models.mesh_plan import plan_mesh, splits_of, step_estimate

LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
LLAMA_70B = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results",
                       "tensor_parallel_2xh200.json")
MODES = {"single": (1, 1), "tp": (2, 1), "dp": (1, 2)}


def h200() -> DeviceProfile:
    """The H200's profile (its data file): the part the measured steps ran on."""
    return profiles()["H200"]


def _measured_8b():
    with open(RESULTS) as f:
        points = json.load(f)["points"]
    return [p for p in points if p["part"] == "8b" and p["status"] == "ok"]


def test_modelled_steps_are_within_15_percent_of_the_measured_ones():
    points = _measured_8b()
    assert len(points) >= 6
    for p in points:
        tp, dp = MODES[p["mode"]]
        seconds, _ = step_estimate(LLAMA_8B, h200(), tensor_parallel=tp, data_parallel=dp,
                                   batch=p["batch"], prefix_len=p["prefix"],
                                   suffix_len=p["gen_tokens"])
        assert abs(seconds * 1e3 / p["step_ms"] - 1) < 0.15, (p["mode"], p["batch"], seconds)


def test_the_choice_is_the_fastest_measured_mesh_at_every_measured_point():
    points = _measured_8b()
    for batch, prefix in {(p["batch"], p["prefix"]) for p in points}:
        at = {MODES[p["mode"]]: p["step_ms"] for p in points
              if (p["batch"], p["prefix"]) == (batch, prefix) and p["gpus"] == 2}
        plan = plan_mesh(LLAMA_8B, devices=2, batch=batch, prefix_len=prefix, suffix_len=128,
                         profile=h200())
        assert at[(plan.tensor_parallel, plan.data_parallel)] == min(at.values()), (batch, at)


def test_weight_bound_small_batches_take_tensor_parallel():
    """At a few sequences every replica of data parallel still reads all the weights: tensor
    parallel halves the reads."""
    for batch in (1, 8, 64):
        plan = plan_mesh(LLAMA_8B, devices=2, batch=batch, prefix_len=1024, suffix_len=128,
                         profile=h200())
        assert (plan.tensor_parallel, plan.data_parallel) == (2, 1), plan.reason


def test_a_model_one_device_cannot_hold_takes_tensor_parallel_and_says_why():
    plan = plan_mesh(LLAMA_70B, devices=2, batch=1024, prefix_len=16384, suffix_len=128,
                     profile=h200())
    assert (plan.tensor_parallel, plan.data_parallel) == (2, 1)
    assert plan.bytes_per_device <= 0.9 * h200().memory_bytes
    assert "tp 1 x dp 2" in plan.reason and "(does not fit)" in plan.reason
    assert plan.reason.startswith("tensor_parallel=2 x data_parallel=1: modelled step")
    with pytest.raises(ValueError, match=r"70\.6 B parameters.*needs at least 144\.2 GB per "
                                         r"device on 1 device.*has 138\.1 GB"):
        plan_mesh(LLAMA_70B, devices=1, batch=64, prefix_len=1024, suffix_len=128,
                  profile=h200())


def test_memory_budget_and_batch_limit_the_splits():
    # 8 devices with a batch of 2: only splits with dp <= 2 are considered
    plan = plan_mesh(LLAMA_8B, devices=8, batch=2, prefix_len=1024, suffix_len=64,
                     profile=h200())
    assert {(t, d) for t, d, *_ in plan.estimates} == {(8, 1), (4, 2)}
    # a 20 GB device cannot hold the 8B model whole: data parallel alone is refused
    plan = plan_mesh(LLAMA_8B, devices=4, batch=1024, prefix_len=1024, suffix_len=128,
                     profile=h200(), memory_bytes=20e9)
    assert plan.tensor_parallel >= 2
    assert all(not fits for t, _, _, _, fits in plan.estimates if t == 1)


def test_splits_of():
    assert splits_of(1) == [(1, 1)]
    assert splits_of(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.mark.parametrize("kw,match", [
    (dict(devices=0), "devices must be a positive int, got 0"),
    (dict(batch=True), "batch must be a positive int, got True"),
    (dict(prefix_len=-1), "prefix_len must be a non-negative int, got -1"),
    (dict(suffix_len=0), "suffix_len must be a positive int, got 0"),
])
def test_argument_errors_name_the_argument(kw, match):
    args = dict(devices=2, batch=8, prefix_len=16, suffix_len=8) | kw
    with pytest.raises(ValueError, match=match):
        plan_mesh(LLAMA_8B, profile=h200(), **args)


def test_device_profile_of_known_and_unknown_parts():
    assert device_profile(H200) == (h200(), "")
    profile, note = device_profile(H100_SXM)
    assert profile is h200()
    assert note == ("no measured profile for 'NVIDIA H100 80GB HBM3' (compute capability 9.0); "
                    "planned with the H200 profile")
    assert "compute capability none" in device_profile(CPU)[1]
    plan = plan_mesh(LLAMA_8B, devices=2, batch=8, prefix_len=16, suffix_len=8,
                     profile=profile, profile_note=note)
    assert plan.reason.endswith(f"({note})")


def test_profile_rejects_non_positive_rates():
    with pytest.raises(ValueError, match="DeviceProfile.copy_bytes_per_s must be a positive"):
        DeviceProfile(**{**h200().__dict__, "copy_bytes_per_s": 0.0})
