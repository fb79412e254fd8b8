"""The XLA flags that multi-GPU programs need on jaxlib 0.12 where NCCL runs with NVLink multicast
off, and the check that says so before a collective fails.

From jaxlib 0.12 XLA runs small all-reduces with collective kernels of its own, which reach the
peer GPU's memory through NCCL symmetric-memory windows.  On a host whose NCCL has NVLink
multicast off (``NCCL_NVLS_ENABLE=0``, as on shared machines where multicast can take the GPUs
out of service) every such all-reduce fails with ``ncclGetPeerDevicePointer ... unhandled system
error``.  :data:`NCCL_COLLECTIVE_FLAGS` turn both features off and leave the all-reduce to NCCL;
on 2 H200s under jaxlib 0.12.0.1 that gives the right sums and the multi-GPU tests pass
(``bench/results/two_gpus_h200x2``, ``docs/multi_gpu.md``).

XLA reads ``XLA_FLAGS`` once, when the GPU backend starts, so the flags must be in the
environment before the first device is used: :func:`collective_xla_flags` gives the value to
export (the CLI and the tests set it at start-up), and :func:`check_collective_flags` warns, when
a mesh of several GPUs is built, if the running process lacks them.

This module imports nothing from jax, so start-up code can use it before jax is imported.
"""
from __future__ import annotations

import warnings
from importlib import metadata
from typing import Mapping

__all__ = ["NCCL_COLLECTIVE_FLAGS", "MissingCollectiveFlagsWarning", "collective_flags_needed",
           "collective_xla_flags", "check_collective_flags"]

NCCL_COLLECTIVE_FLAGS = ("--xla_gpu_experimental_use_collective_kernels=",
                         "--xla_gpu_experimental_enable_nccl_symmetric_buffers=false")
FROM_JAXLIB = (0, 12)


class MissingCollectiveFlagsWarning(UserWarning):
    """A multi-GPU mesh is built in a process whose XLA collectives will fail on this host."""


def _jaxlib_version() -> str | None:
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def collective_flags_needed(environ: Mapping[str, str], jaxlib_version: str | None) -> tuple[str, ...]:
    """The flags of :data:`NCCL_COLLECTIVE_FLAGS` missing from ``environ["XLA_FLAGS"]`` when
    ``jaxlib_version`` is 0.12 or newer and ``environ`` has ``NCCL_NVLS_ENABLE=0``; else ``()``."""
    if not jaxlib_version or environ.get("NCCL_NVLS_ENABLE") != "0":
        return ()
    try:
        version = tuple(int(x) for x in jaxlib_version.split(".")[:2])
    except ValueError:
        return ()
    if version < FROM_JAXLIB:
        return ()
    present = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in present}
    return tuple(f for f in NCCL_COLLECTIVE_FLAGS if f.split("=", 1)[0] not in names)


def collective_xla_flags(environ: Mapping[str, str], jaxlib_version: str | None = None) -> str | None:
    """The ``XLA_FLAGS`` value to export before jax starts: the current one plus the flags
    :func:`collective_flags_needed` names, or ``None`` when none is needed.  ``jaxlib_version``
    defaults to the installed jaxlib's."""
    version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
    missing = collective_flags_needed(environ, version)
    if not missing:
        return None
    return " ".join([environ.get("XLA_FLAGS", "").strip(), *missing]).strip()


def check_collective_flags(devices, environ: Mapping[str, str], jaxlib_version: str | None = None) -> bool:
    """Warn (:class:`MissingCollectiveFlagsWarning`, naming the fix) when ``devices`` holds more
    than one GPU and :func:`collective_flags_needed` finds flags missing; returns whether it
    warned."""
    devices = list(devices)
    if len(devices) < 2 or any(getattr(d, "platform", "") != "gpu" for d in devices):
        return False
    version = _jaxlib_version() if jaxlib_version is None else jaxlib_version
    missing = collective_flags_needed(environ, version)
    if not missing:
        return False
    warnings.warn(f"jaxlib {version} with NCCL_NVLS_ENABLE=0: XLA's all-reduces across these "
                  f"{len(devices)} GPUs will fail (ncclGetPeerDevicePointer) unless XLA_FLAGS holds "
                  f"{' '.join(missing)}; set it before jax starts, e.g. "
                  f"XLA_FLAGS=\"$XLA_FLAGS {' '.join(missing)}\" (docs/multi_gpu.md)",
                  MissingCollectiveFlagsWarning, stacklevel=3)
    return True
