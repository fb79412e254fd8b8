"""Joining a run of several processes (one per host) through JAX's multi-controller runtime.

Every process runs the same program; :func:`initialize` connects it to the others with
``jax.distributed.initialize`` before anything else touches a device.  After that
``jax.devices()`` lists the devices of every process, :func:`models.sharding.make_mesh` builds
the mesh over all of them (tensor parallel inside a host, data parallel across hosts), each
process places only the parameter blocks of its own devices (it needs the checkpoint on its own
file system), and :func:`models.sharding.host_array` gathers the outputs so that every process
returns the same tokens.

:class:`Distributed` says how to join: the coordinator's ``host:port`` (process 0 serves
there), the number of processes and this process's index, all three or none (``None``:
detected from the cluster, as ``jax.distributed.initialize`` does under Slurm or Open MPI).
:meth:`Distributed.from_env` reads them from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID``.  On CPU devices the collectives between processes go through Gloo.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax

__all__ = ["Distributed", "initialize", "ENV_VARS"]

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _int_or_none(name: str, value, minimum: int):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} or None, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Distributed:
    """How this process joins the run (module docstring): ``coordinator_address`` (``"host:port"``
    of process 0), ``num_processes`` (>= 1) and ``process_id`` (in ``[0, num_processes)``), all
    three given or all ``None`` (cluster detection)."""
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        addr = self.coordinator_address
        if addr is not None and (not isinstance(addr, str) or ":" not in addr):
            raise ValueError(f"coordinator_address must be 'host:port', got {addr!r}")
        n = _int_or_none("num_processes", self.num_processes, 1)
        i = _int_or_none("process_id", self.process_id, 0)
        given = [x is not None for x in (addr, n, i)]
        if any(given) and not all(given):
            raise ValueError(f"coordinator_address, num_processes and process_id go together "
                             f"(all three, or none for cluster detection), got "
                             f"coordinator_address={addr!r}, num_processes={n!r}, process_id={i!r}")
        if n is not None and i >= n:
            raise ValueError(f"process_id must be in [0, num_processes={n}), got {i}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Distributed":
        """From ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (unset:
        ``None``); a value that is not an integer is a ``ValueError`` naming the variable."""
        env = os.environ if environ is None else environ
        values = []
        for name in ENV_VARS[1:]:
            raw = env.get(name)
            try:
                values.append(None if raw in (None, "") else int(raw))
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
        return cls(env.get(ENV_VARS[0]) or None, *values)


def initialize(spec: Distributed) -> None:
    """Join the run described by ``spec`` (``jax.distributed.initialize``) unless this process
    already has; then ``jax.process_count()`` and ``jax.process_index()`` are the run's.  A
    process that joined another run is a ``ValueError`` naming both."""
    if not isinstance(spec, Distributed):
        raise TypeError(f"spec must be a models.distributed.Distributed, got "
                        f"{type(spec).__name__}")
    if jax.distributed.is_initialized():
        have = (jax.process_count(), jax.process_index())
        if spec.num_processes is not None and have != (spec.num_processes, spec.process_id):
            raise ValueError(f"this process already joined a run as process {have[1]} of {have[0]}, "
                             f"not process {spec.process_id} of {spec.num_processes}")
        return
    # Collectives between processes on CPU devices (tests, CPU clusters); GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=spec.coordinator_address,
                               num_processes=spec.num_processes, process_id=spec.process_id)
