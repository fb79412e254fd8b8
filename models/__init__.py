"""Flax Llama decoder using jax_prefix_attn."""
