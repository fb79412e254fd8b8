"""Executes shared-prefix attention plans (placeholder: re-exports the current implementation)."""
from pallas_kernels.prefix_attention import decode_prefix_partials  # noqa: F401
