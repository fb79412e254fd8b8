"""models.collective_flags: which XLA flags a multi-GPU process needs under jaxlib >= 0.12 with
NCCL's NVLink multicast off, the value to export, and the warning when a GPU mesh lacks them."""
import os
import types
import warnings

import pytest

from models.collective_flags import (NCCL_COLLECTIVE_FLAGS, MissingCollectiveFlagsWarning,
                                     check_collective_flags, collective_flags_needed,
                                     collective_xla_flags)

OFF = {"NCCL_NVLS_ENABLE": "0"}


@pytest.mark.parametrize("environ,version,want", [
    (OFF, "0.12.0.1", NCCL_COLLECTIVE_FLAGS),
    (OFF, "0.13.0", NCCL_COLLECTIVE_FLAGS),
    (OFF, "0.11.2", ()),                                    # XLA's own collective kernels: 0.12 on
    ({}, "0.12.0.1", ()),                                   # multicast on (or unset): not needed
    ({"NCCL_NVLS_ENABLE": "1"}, "0.12.0.1", ()),
    (OFF, None, ()),                                        # no jaxlib
    (dict(OFF, XLA_FLAGS="--xla_gpu_experimental_use_collective_kernels=all_reduce"), "0.12.0.1",
     NCCL_COLLECTIVE_FLAGS[1:]),                            # a user's own value is kept
    (dict(OFF, XLA_FLAGS=" ".join(NCCL_COLLECTIVE_FLAGS)), "0.12.0.1", ()),
])
def test_flags_needed(environ, version, want):
    assert collective_flags_needed(environ, version) == want


def test_value_to_export_keeps_the_users_flags():
    env = dict(OFF, XLA_FLAGS="--xla_gpu_autotune_level=0")
    want = " ".join(("--xla_gpu_autotune_level=0",) + NCCL_COLLECTIVE_FLAGS)
    assert collective_xla_flags(env, "0.12.0.1") == want
    assert collective_xla_flags(OFF, "0.12.0.1") == " ".join(NCCL_COLLECTIVE_FLAGS)
    assert collective_xla_flags(OFF, "0.11.2") is None


def test_gpu_mesh_without_the_flags_warns_naming_the_fix():
    gpus = [types.SimpleNamespace(platform="gpu") for _ in range(2)]
    with pytest.warns(MissingCollectiveFlagsWarning, match="--xla_gpu_experimental_use_collective_kernels="):
        assert check_collective_flags(gpus, OFF, "0.12.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_collective_flags(gpus[:1], OFF, "0.12.0.1")             # one GPU: no collective
        assert not check_collective_flags([types.SimpleNamespace(platform="cpu")] * 2, OFF, "0.12.0.1")
        assert not check_collective_flags(gpus, dict(OFF, XLA_FLAGS=" ".join(NCCL_COLLECTIVE_FLAGS)),
                                          "0.12.0.1")


def test_cli_exports_the_flags_before_jax_starts(monkeypatch):
    """``jpa-sample`` puts the value of :func:`collective_xla_flags` into ``XLA_FLAGS`` first
    thing (here with the installed jaxlib taken as 0.12 on a multicast-off host)."""
    from models.cli import command
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    monkeypatch.setattr(command, "collective_xla_flags",
                        lambda environ: collective_xla_flags(environ, "0.12.0.1"))
    assert command.main(["--version"]) == 0
    assert os.environ["XLA_FLAGS"].split() == ["--xla_gpu_autotune_level=0", *NCCL_COLLECTIVE_FLAGS]
