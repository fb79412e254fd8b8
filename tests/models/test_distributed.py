"""Several devices chosen for the user (``LLM.load(devices=N)``, ``jpa-sample --devices``) and
runs of several processes (``models.distributed``): two processes on this machine, each with two
CPU devices, sample on a tensor 2 x data 2 mesh over all four and print one process's tokens."""
import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from helpers import assert_one_error_line, run_cli, write_tiny_gguf
from models import LLM
from models.distributed import ENV_VARS, Distributed, initialize
from models.mesh_plan import DecodeWorkload

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["the cat sat on", "a dog ran to the"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=7, lm_head_scale=30)


def _tokens(result):
    return [[list(c.token_ids) for c in per_prompt] for per_prompt in result]


# ------------------------------------------------------------------------------ Distributed spec
@pytest.mark.parametrize("kw,match", [
    (dict(coordinator_address="localhost:1234"), "go together"),
    (dict(num_processes=2, process_id=0), "go together"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), "must be 'host:port'"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"process_id must be in \[0, "
                                                                     r"num_processes=2\), got 2"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), "num_processes must be an int >= 1"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=True), "process_id must be an int >= 0"),
])
def test_spec_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        Distributed(**kw)


def test_spec_from_env():
    env = dict(zip(ENV_VARS, ("10.0.0.1:4000", "4", "3")))
    assert Distributed.from_env(env) == Distributed("10.0.0.1:4000", 4, 3)
    assert Distributed.from_env({}) == Distributed()
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'two'"):
        Distributed.from_env({**env, "JAX_NUM_PROCESSES": "two"})
    with pytest.raises(TypeError, match="spec must be a models.distributed.Distributed, got dict"):
        initialize({"coordinator_address": "h:1"})


# ------------------------------------------------------------------------------ devices=N
def test_load_with_devices_chooses_a_split_and_samples_as_one_device(tiny_model):
    one = LLM.load(tiny_model)
    want = _tokens(one.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.0))
    for workload in (DecodeWorkload(batch=4, prefix_len=8, suffix_len=6), None):
        llm = LLM.load(tiny_model, devices=4, workload=workload)
        plan = llm.mesh_plan
        assert (llm.tensor_parallel, llm.data_parallel) == (plan.tensor_parallel, plan.data_parallel)
        assert plan.tensor_parallel * plan.data_parallel == 4
        assert plan.reason.startswith(f"tensor_parallel={plan.tensor_parallel} x data_parallel="
                                      f"{plan.data_parallel}: modelled step")
        assert "planned with the H200 profile" in plan.reason      # no profile for a CPU
        assert _tokens(llm.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.0)) == want
    assert one.mesh_plan is None


def test_load_devices_errors(tiny_model):
    with pytest.raises(ValueError, match="pass devices= or tensor_parallel= / data_parallel= / mesh="):
        LLM.load(tiny_model, devices=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="workload= is what devices= plans for"):
        LLM.load(tiny_model, workload=DecodeWorkload())
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"devices={n + 1} needs {n + 1} devices, but only {n}"):
        LLM.load(tiny_model, devices=n + 1)
    with pytest.raises(ValueError, match="DecodeWorkload.batch must be a positive int, got 0"):
        DecodeWorkload(batch=0)


def test_cli_devices(tiny_model, capsys):
    rc, out, err = run_cli(["--model", tiny_model, "-p", PROMPTS[0], "-n", 4, "-m", 4, "-t", 0,
                            "--devices", 4], capsys)
    assert rc == 0, err
    line = next(ln for ln in err.splitlines() if ln.startswith("jpa-sample: --devices 4: "))
    assert "modelled step" in line and "planned with the H200 profile" in line
    assert_one_error_line(*run_cli(["--model", tiny_model, "-p", "x", "--devices", 2,
                                    "--tensor-parallel", 2], capsys),
                          "--devices chooses the split")
    assert_one_error_line(*run_cli(["--model", tiny_model, "-p", "x", "--num-processes", 2], capsys),
                          "--coordinator-address, --num-processes and --process-id go together")
    assert_one_error_line(*run_cli(["--model", tiny_model, "-p", "x", "--coordinator-address", "h:1",
                                    "--num-processes", 2, "--process-id", 2], capsys),
                          "--process-id must be in [0, --num-processes=2), got 2")


# ------------------------------------------------------------------------------ two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _records(out: str) -> dict:
    """``{(prompt_index, sample): token_ids}`` of ``--output -`` records."""
    return {(r["prompt_index"], r["sample"]): r["token_ids"]
            for r in (json.loads(line) for line in out.splitlines())}


@pytest.mark.slow
def test_two_processes_sample_what_one_process_samples(tiny_model, tmp_path, capsys):
    """``jpa-sample`` in two processes of two CPU devices each (``--tensor-parallel 2
    --data-parallel 2`` over the four; the flags for one, the environment variables for the
    other): process 0 writes every record, with the tokens of one process on one device; the
    other process writes nothing."""
    questions = tmp_path / "questions.txt"
    questions.write_text("sat on\nran to the\n")
    argv = ["--model", tiny_model, "-p", "the cat", "--questions-file", str(questions), "-n", "2",
            "-m", "6", "-t", "0"]
    rc, out, err = run_cli(argv + ["--output", "-"], capsys)
    assert rc == 0, err
    want = _records(out)
    assert len(want) == 4
    port = _free_port()
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                   PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "models.cli", *argv, "--tensor-parallel", "2",
               "--data-parallel", "2", "--output", str(tmp_path / f"out{i}.jsonl")]
        if i == 0:
            cmd += ["--coordinator-address", f"localhost:{port}", "--num-processes", "2",
                    "--process-id", "0"]
        else:
            env.update(zip(ENV_VARS, (f"localhost:{port}", "2", "1")))
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    text = (tmp_path / "out0.jsonl").read_text()
    assert _records(text) == want
    assert all(json.loads(line)["mesh"] == {"tensor_parallel": 2, "data_parallel": 2}
               for line in text.splitlines())
    assert not (tmp_path / "out1.jsonl").exists()
