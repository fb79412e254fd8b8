"""The jax releases this project supports, checked once when :mod:`pallas_kernels` is imported
(and so whenever ``jax_prefix_attn`` or ``models`` is).

* Below :data:`MIN_JAX` the import fails: the kernels use Pallas and Mosaic GPU APIs that
  older releases lack, and the failure would otherwise surface as a lowering error deep in a
  kernel.
* From :data:`UNTESTED_FROM` on the import warns (:class:`UntestedJaxWarning`): a new jax
  release has changed Mosaic GPU's layout and transfer rules and Pallas's checks before, so the
  kernels may fail to lower or, rarely, compute wrong results there.

The GPU kernels were tested on :data:`GPU_TESTED` (H200); the CPU suite runs on jax 0.10.2
(Python 3.11) and the newest of :data:`GPU_TESTED` (Python 3.12).  ``pyproject.toml`` declares
the same range.
"""
from __future__ import annotations

import re
import warnings

__all__ = ["MIN_JAX", "UNTESTED_FROM", "GPU_TESTED", "UntestedJaxWarning", "parse_version",
           "check_jax_version", "supported_range"]

MIN_JAX = (0, 10, 2)
UNTESTED_FROM = (0, 13)
GPU_TESTED = ("0.11.2", "0.12.0.1")


class UntestedJaxWarning(UserWarning):
    """The installed jax is newer than any release this project was tested with."""


def parse_version(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.12.0.1"`` -> ``(0, 12, 0, 1)``,
    ``"0.13.0.dev20261101"`` -> ``(0, 13, 0)``.  Raises ``ValueError`` naming ``version`` when
    it does not start with a number."""
    if not isinstance(version, str):
        raise TypeError(f"version must be a string, got {type(version).__name__}")
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    if m is None:
        raise ValueError(f"version must start with a release number such as '0.12.0', got {version!r}")
    return tuple(int(x) for x in m.group(0).split("."))


def supported_range() -> str:
    """The supported range in words, as ``pyproject.toml`` states it."""
    lo = ".".join(map(str, MIN_JAX))
    hi = ".".join(map(str, UNTESTED_FROM))
    return (f"jax>={lo},<{hi} (GPU kernels tested on jax {' and '.join(GPU_TESTED)})")


def check_jax_version(version: str) -> None:
    """Raise ``ImportError`` when jax ``version`` is below :data:`MIN_JAX`; warn
    (:class:`UntestedJaxWarning`) from :data:`UNTESTED_FROM` on; both name the supported range."""
    v = parse_version(version)
    if v < MIN_JAX:
        raise ImportError(f"jax-prefix-attn needs {supported_range()}, but jax {version} is "
                          f"installed: pip install 'jax>={'.'.join(map(str, MIN_JAX))}'")
    if v >= UNTESTED_FROM:
        warnings.warn(f"jax-prefix-attn was tested with {supported_range()}; jax {version} is "
                      f"newer and untested: kernels may fail to lower", UntestedJaxWarning,
                      stacklevel=3)
