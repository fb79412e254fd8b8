"""Pallas GPU kernels (Triton and Mosaic GPU lowerings; interpret mode on CPU). Nothing here
imports jax_prefix_attn.  Importing the package checks the installed jax against the supported
range (:mod:`pallas_kernels.jax_support`)."""
import jax as _jax

from pallas_kernels.jax_support import check_jax_version as _check_jax_version

_check_jax_version(_jax.__version__)
