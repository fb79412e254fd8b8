"""The device facts the planner needs, read from the device.

:func:`device_info` reads ``jax.devices()[0]`` (or a given device): its ``platform``,
``device_kind``, ``core_count`` (the SM count on CUDA) and ``compute_capability``.  The shared
memory one CTA may allocate is not exposed by the runtime; it comes from
:data:`SMEM_PER_BLOCK` keyed by compute capability (the CUDA programming guide's "maximum
shared memory per thread block" with the opt-in attribute):

* 9.0 (Hopper: H100, H200): 232,448 bytes (227 KB);
* 8.0 (A100): 166,912 bytes (163 KB);
* 8.6, 8.9 and 12.0 (consumer Ampere, Ada, Blackwell): 101,376 bytes (99 KB).

Every attribute is read with ``getattr`` and a default, so a CPU (or any other backend) gives a
valid :class:`DeviceInfo` with ``sm_count = 0``.  Tests pass a known part (:data:`H100_SXM`,
:data:`H100_PCIE`, :data:`H200`) instead of reading the device.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax

__all__ = ["DeviceInfo", "device_info", "planning_device_info", "SMEM_PER_BLOCK", "KNOWN_PARTS", "H100_SXM", "H100_PCIE",
           "H200", "CPU"]

SMEM_PER_BLOCK = types.MappingProxyType({
    "9.0": 232448,
    "8.0": 166912,
    "8.6": 101376,
    "8.9": 101376,
    "12.0": 101376,
})


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """Static facts of one device (hashable: usable as a ``jax.jit`` static argument).

    ``platform``: ``"gpu"``, ``"cpu"``, ``"tpu"``; ``name``: the device kind (e.g. ``"NVIDIA
    H100 80GB HBM3"``); ``sm_count``: streaming multiprocessors (0 when unknown or not a GPU);
    ``smem_per_block``: shared memory bytes one CTA may allocate (0 when unknown);
    ``compute_capability``: ``"9.0"`` style string (``""`` when not a CUDA GPU).
    """
    platform: str
    name: str
    sm_count: int
    smem_per_block: int
    compute_capability: str

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu" and self.sm_count > 0

    @property
    def mosaic_gpu_ok(self) -> bool:
        """Whether the Mosaic GPU kernels (wgmma, TMA, warp specialisation as used here) run:
        a CUDA GPU of compute capability 9.0 or newer."""
        return self.platform == "gpu" and _cc_tuple(self.compute_capability) >= (9, 0)


def _cc_tuple(cc: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(cc).split("."))
    except ValueError:
        return ()


H100_SXM = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 132, 232448, "9.0")
H100_PCIE = DeviceInfo("gpu", "NVIDIA H100 PCIe", 114, 232448, "9.0")
H200 = DeviceInfo("gpu", "NVIDIA H200", 132, 232448, "9.0")
CPU = DeviceInfo("cpu", "cpu", 0, 0, "")
KNOWN_PARTS = types.MappingProxyType({"H100_SXM": H100_SXM, "H100_PCIE": H100_PCIE,
                                      "H200": H200, "CPU": CPU})


@functools.lru_cache(maxsize=None)
def _read(device) -> DeviceInfo:
    platform = str(getattr(device, "platform", "cpu"))
    name = str(getattr(device, "device_kind", platform))
    cc = str(getattr(device, "compute_capability", "") or "")
    sms = int(getattr(device, "core_count", 0) or 0) if platform == "gpu" else 0
    return DeviceInfo(platform=platform, name=name, sm_count=sms,
                      smem_per_block=SMEM_PER_BLOCK.get(cc, 0) if platform == "gpu" else 0,
                      compute_capability=cc)


def device_info(device=None) -> DeviceInfo:
    """:class:`DeviceInfo` of ``device`` (default ``jax.devices()[0]``); cached per device."""
    if device is None:
        try:
            device = jax.devices()[0]
        except RuntimeError:  # no backend at all
            return CPU
    return _read(device)


def planning_device_info(device=None) -> DeviceInfo:
    """The part that host-side planning targets: :func:`device_info` on a GPU; off the GPU the
    documented :data:`H100_SXM`, so that the reference, mirror and interpret paths make the same
    choices (schedules, splits) as that GPU would."""
    dev = device_info(device)
    return dev if dev.is_gpu else H100_SXM
