"""Planner for shared-prefix attention (placeholder: re-exports the current constants)."""
from pallas_kernels.prefix_attention import DECODE_SUFFIX_TILING  # noqa: F401
