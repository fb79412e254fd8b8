"""The Mosaic GPU API as the kernels here use it, across the supported jax versions (0.10.2 to
0.12): the one place that knows where two versions differ.  Differences are found by looking for
the feature, never by comparing version numbers.

* :func:`store_gmem`: a store from registers straight to global memory.  jax 0.12 plans such a
  store per warp and refuses (``TransferPlanDerivationError``) one whose warp-wide accesses do
  not cover whole 32-byte sectors, such as a wgmma-layout ``[D, 16]`` bf16 tile (each row is
  two 16-byte halves held by different registers); ``plgpu.store(..., optimized=False)`` (new in
  0.12) takes the per-thread plan that earlier versions always took.  Before 0.12 a plain
  ``ref[...] = value`` is that store.
* :func:`gpu_interpret_params`: Mosaic GPU's CPU interpreter, public as
  ``plgpu.InterpretGPUParams`` from jax 0.11, internal before.
"""
from __future__ import annotations

try:  # Mosaic GPU is part of jax; guarded so that an unusual build still imports this package
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

__all__ = ["plgpu", "store_gmem", "gpu_interpret_params", "has_public_interpreter"]


def store_gmem(ref, value) -> None:
    """``ref[...] = value`` for ``ref`` in global memory and ``value`` in any register layout,
    whether or not its warp-wide accesses cover whole 32-byte sectors (one thread's contiguous
    elements per access)."""
    store = getattr(plgpu, "store", None)
    if store is None:
        ref[...] = value
    else:
        store(ref, value, optimized=False)


def has_public_interpreter() -> bool:
    """Whether this jax exports Mosaic GPU's CPU interpreter (``plgpu.InterpretGPUParams``)."""
    return plgpu is not None and hasattr(plgpu, "InterpretGPUParams")


def gpu_interpret_params():
    """Parameters that run a Mosaic GPU kernel in its CPU interpreter (simulated shared memory,
    warpgroups, barriers, TMA and wgmma)."""
    if has_public_interpreter():
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
    return InterpretGPUParams()
