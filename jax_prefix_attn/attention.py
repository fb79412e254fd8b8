"""Public flash-attention entry point with backend dispatch.

``impl``:
  * ``"auto"``: the Pallas kernel on GPU, the reference elsewhere;
  * ``"pallas"``: the Pallas kernel compiled for the GPU;
  * ``"pallas_interpret"``: the Pallas kernel in interpret mode (CPU tests);
  * ``"reference"``: :func:`jax_prefix_attn.reference.attention`.
"""
from __future__ import annotations

import jax

from jax_prefix_attn import reference
from jax_prefix_attn._validation import check_bool, check_impl, check_qkv

IMPLS = ("auto", "pallas", "pallas_interpret", "reference")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def attention(q, k, v, *, causal: bool = False, kv_lengths=None, sm_scale=None, impl: str = "auto"):
    """Attention ``(out [B, Tq, Hq, D], lse [B, Tq, Hq] float32)``; see README for conventions."""
    check_impl(impl, IMPLS)
    check_qkv(q, k, v, kv_lengths=kv_lengths, sm_scale=sm_scale)
    check_bool("causal", causal)
    if impl in ("pallas", "pallas_interpret") and 0 in (q.shape[1], k.shape[1]):
        raise ValueError(f"impl={impl!r} (Pallas kernels) needs at least one query and one key, got "
                         f"q seq_q={q.shape[1]} and k seq_k={k.shape[1]}; use impl='reference'")
    if impl == "auto":
        impl = "pallas" if on_gpu() and 0 not in (q.shape[1], k.shape[1]) else "reference"
    if impl == "reference":
        return reference.attention(q, k, v, causal=causal, kv_lengths=kv_lengths, sm_scale=sm_scale)
    from pallas_kernels import flash_attention as fa  # noqa: PLC0415  (kernel import is lazy)
    return fa.flash_attention(q, k, v, causal=causal, kv_lengths=kv_lengths, sm_scale=sm_scale,
                              interpret=(impl == "pallas_interpret"))
