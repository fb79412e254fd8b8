"""Measured rates of a GPU part, for the cost models that choose how work is laid out.

A :class:`DeviceProfile` holds what the runtime does not report: the rate a kernel copies
memory at, the bf16 matmul rate, and, for a model's decode step, the share of that matmul rate
its matmuls reach whole and split over a tensor-parallel mesh, and the all-reduce time over the
GPUs of one host.  The figures are measured (``docs/performance.md``, "Device profiles"); the
facts the runtime does report (memory, SM count) come from the device.

:func:`device_profile` gives the profile of a :class:`~jax_prefix_attn.device.DeviceInfo`:
the part's own profile when one was measured, else the nearest (same compute capability first)
and a one-line note saying which profile stands in for the part.
"""
from __future__ import annotations

import dataclasses
import types

from jax_prefix_attn.device import DeviceInfo

__all__ = ["DeviceProfile", "PROFILES", "H200_PROFILE", "device_profile"]


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Measured rates of one GPU part (hashable).

    ``name``: the part (a substring of the device kind it matches, e.g. ``"H200"``);
    ``compute_capability``: ``"9.0"`` style; ``memory_bytes``: device memory a process may use
    (used when the device does not report it); ``copy_bytes_per_s``: bytes a copy kernel moves
    per second; ``matmul_flops_per_s``: dense bf16 matmul rate (large square products);
    ``decode_matmul_efficiency``: the share of that rate a decode step's matmuls reach on one
    device (weight-by-batch products, the layer's other kernels between them);
    ``sharded_matmul_efficiency``: the same with the matmuls split over a tensor-parallel mesh
    (narrower products); ``allreduce_latency_s`` and ``allreduce_bytes_per_s``: an all-reduce of
    ``n`` bytes over the GPUs of one host takes ``latency + n / rate``.
    """
    name: str
    compute_capability: str
    memory_bytes: float
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    decode_matmul_efficiency: float
    sharded_matmul_efficiency: float
    allreduce_latency_s: float
    allreduce_bytes_per_s: float

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "float" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"DeviceProfile.{field.name} must be a positive number, got "
                                 f"{value!r}")

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds of one all-reduce of ``nbytes`` bytes over the GPUs of one host."""
        return self.allreduce_latency_s + nbytes / self.allreduce_bytes_per_s


# One H200 (and two of one host for the all-reduce): bench/results/tensor_parallel_2xh200.json
# and the copy and matmul rates of bench/results/peers_*_h200.json.
H200_PROFILE = DeviceProfile(
    name="H200", compute_capability="9.0", memory_bytes=138.1e9, copy_bytes_per_s=2.74e12,
    matmul_flops_per_s=6.9e14, decode_matmul_efficiency=0.63, sharded_matmul_efficiency=0.57,
    allreduce_latency_s=1.36e-5, allreduce_bytes_per_s=1.32e11)

PROFILES = types.MappingProxyType({"H200": H200_PROFILE})


def _cc(cc: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(cc).split("."))
    except ValueError:
        return ()


def device_profile(dev: DeviceInfo) -> tuple[DeviceProfile, str]:
    """``(profile, note)`` for ``dev``: the profile whose ``name`` occurs in the device kind
    (``note == ""``), else the measured part nearest by compute capability with a note naming
    both (e.g. for a CPU, or a GPU no profile was measured on)."""
    for profile in PROFILES.values():
        if profile.name.lower() in dev.name.lower():
            return profile, ""
    want = _cc(dev.compute_capability)
    nearest = min(PROFILES.values(),
                  key=lambda p: (_cc(p.compute_capability) != want,
                                 abs(_cc(p.compute_capability)[0] - (want or (0,))[0])))
    return nearest, (f"no measured profile for {dev.name!r} (compute capability "
                     f"{dev.compute_capability or 'none'}); planned with the {nearest.name} "
                     f"profile")
