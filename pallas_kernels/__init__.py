"""Pallas GPU kernels (Triton lowering; interpret mode on CPU). Nothing here imports jax_prefix_attn."""
