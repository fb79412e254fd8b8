"""The Mosaic GPU path of :func:`jax_prefix_attn.mla_attention` (``impl="mgpu"``, and
``impl="auto"`` on Hopper): which inputs it takes, how it runs, how it is differentiated.

* Prefix part: :func:`pallas_kernels.mla_prefix_mgpu.mla_prefix_attention` over the rows of
  every head of every sequence of one prefix group: ``G = 1`` is one launch over all
  ``B * Tq * H`` rows; with ``G > 1`` groups whose sequences are contiguous and equally many
  (``seq_to_prefix = arange(B) // (B / G)``, the layout of a batch of ``G`` prompts with ``B / G``
  samples each) one launch per group (``lax.map``), each over its ``(B / G) * Tq * H`` rows and
  its own prefix, read once.
* Suffix part: :func:`pallas_kernels.mla_suffix_mgpu.mla_suffix_attention`, each sequence's
  rows against its own suffix, causal within it.
* The parts are merged through their LSE (:func:`jax_prefix_attn.merge_attention_states`).

The prefix kernel gives every row of a group the same prefix length; with ``Tq > 1`` that holds
when every ``suffix_length >= Tq - 1``.  A call whose traced values break a condition (those
lengths, or a ``seq_to_prefix`` other than the contiguous layout) computes the reference
instead: a branch on the device, no recompilation.

Gradients: a ``jax.custom_vjp`` whose backward differentiates the pure-JAX reference
(:func:`jax_prefix_attn.mla_reference.mla_reference`, recomputed from the inputs), so the kernel path can
sit under ``jax.grad`` (``completion_logprobs`` of an MLA model) with the reference's gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_prefix_attn.device import DeviceInfo
from jax_prefix_attn.merge import merge_attention_states
from jax_prefix_attn.mla_reference import mla_reference
from pallas_kernels import mla_prefix_mgpu, mla_suffix_mgpu
from pallas_kernels._common import cdiv

__all__ = ["kernels_supported", "auto_impl", "mla_kernels", "kernel_parts", "key_splits"]


def key_splits(ctas: int, n_keys: int, sm_count: int) -> int:
    """Key splits of a kernel with ``ctas`` CTAs per split over ``n_keys`` keys in tiles of 64:
    about one CTA per SM when ``ctas`` alone would leave SMs idle, every split at least one
    tile."""
    n_tiles = cdiv(n_keys, 64)
    per_split = cdiv(n_tiles, max(1, min(n_tiles, cdiv(sm_count, ctas))))
    return cdiv(n_tiles, per_split)


def kernels_supported(q_nope, q_rope, prefix_latent, suffix_latent) -> str | None:
    """``None`` when the kernel path runs these canonical inputs (``q_nope [B, Tq, H, R]``,
    ``prefix_latent [G, P, R]``, ``suffix_latent [B, S, R]``), else the reason."""
    b, r, dr, dtype = q_nope.shape[0], q_nope.shape[-1], q_rope.shape[-1], q_nope.dtype
    g = prefix_latent.shape[0]
    if b % g:
        return (f"prefix groups of equally many sequences (batch {b} is not a multiple of "
                f"G={g} prefix groups)")
    return (mla_prefix_mgpu.supported(rank=r, rope_dim=dr, prefix_len=prefix_latent.shape[1],
                                      dtype=dtype)
            or mla_suffix_mgpu.supported(rank=r, rope_dim=dr, suffix_cap=suffix_latent.shape[1],
                                         dtype=dtype))


def auto_impl(q_nope, q_rope, prefix_latent, suffix_latent, dev: DeviceInfo) -> tuple[str, str]:
    """``(impl, reason)`` of ``impl="auto"``: ``"mgpu"`` on a GPU that runs Mosaic GPU kernels
    (compute capability 9.0+) when :func:`kernels_supported`, else ``"reference"``."""
    if not dev.mosaic_gpu_ok:
        return "reference", f"{dev.name}: no Mosaic GPU kernels (compute capability 9.0+ GPUs)"
    why = kernels_supported(q_nope, q_rope, prefix_latent, suffix_latent)
    if why is not None:
        return "reference", f"the Mosaic GPU kernels need {why}"
    return "mgpu", "Mosaic GPU prefix and suffix kernels"


def kernel_parts(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                  p_len_g, s_len_b, scale, interpret, sm_count):
    """Prefix and suffix kernels, merged: ``(out [B, Tq, H, R]``, ``lse [B, Tq, H])``, for
    sequences in the contiguous group layout with every row seeing its whole prefix (the
    conditions :func:`mla_kernels` checks on the device); ``p_len_g [G]`` and ``s_len_b [B]``
    already clamped."""
    b, tq, h, r = q_nope.shape
    dr = q_rope.shape[-1]
    g, p = prefix_latent.shape[:2]
    s = suffix_latent.shape[1]
    rows = (b // g) * tq * h                                   # rows of one prefix group
    splits = key_splits(cdiv(rows, 64), p, sm_count)

    def prefix_group(args):
        qn_mr, qr_md, c_pr, kr_pd, length = args
        return mla_prefix_mgpu.mla_prefix_attention(
            qn_mr, qr_md, c_pr, kr_pd, length, sm_scale=scale, interpret=interpret,
            num_splits=splits)

    group_args = (q_nope.reshape(g, rows, r), q_rope.reshape(g, rows, dr), prefix_latent,
                  prefix_rope_k, p_len_g)
    if g == 1:
        o_p, l_p = prefix_group(tuple(x[0] for x in group_args))
    else:
        o_p, l_p = jax.lax.map(prefix_group, group_args)
    o_s, l_s = mla_suffix_mgpu.mla_suffix_attention(
        q_nope.reshape(b, tq * h, r), q_rope.reshape(b, tq * h, dr), suffix_latent,
        suffix_rope_k, s_len_b, sm_scale=scale, seq_q=tq, interpret=interpret,
        num_splits=key_splits(b * cdiv(tq * h, 64), s, sm_count))
    out, lse = merge_attention_states(
        [o_p.reshape(b, tq, h, r), o_s.reshape(b, tq, h, r)],
        [l_p.reshape(b, tq, h), l_s.reshape(b, tq, h)])
    return out.astype(q_nope.dtype), lse


def _forward(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
             seq_to_prefix, prefix_lengths, suffix_lengths, scale, interpret, sm_count):
    b, tq = q_nope.shape[:2]
    g, p = prefix_latent.shape[:2]
    s = suffix_latent.shape[1]
    p_len = jnp.clip(prefix_lengths.astype(jnp.int32), 0, p)
    s_len = jnp.clip(suffix_lengths.astype(jnp.int32), 0, s)
    s2p = seq_to_prefix.astype(jnp.int32)

    def kernels():
        return kernel_parts(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                             suffix_rope_k, p_len, s_len, scale, interpret, sm_count)

    def reference():
        return mla_reference(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                             suffix_rope_k, s2p, p_len, s_len, scale)

    ok = []
    if tq > 1:
        ok.append(jnp.all(s_len >= tq - 1))
    if g > 1:
        ok.append(jnp.all(s2p == jnp.arange(b, dtype=jnp.int32) // (b // g)))
    if not ok:
        return kernels()
    return jax.lax.cond(functools.reduce(jnp.logical_and, ok), kernels, reference)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _differentiable(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                    seq_to_prefix, prefix_lengths, suffix_lengths, scale, interpret, sm_count):
    return _forward(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                    seq_to_prefix, prefix_lengths, suffix_lengths, scale, interpret, sm_count)


def _differentiable_fwd(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                        suffix_rope_k, seq_to_prefix, prefix_lengths, suffix_lengths, scale,
                        interpret, sm_count):
    res = (q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
           seq_to_prefix, prefix_lengths, suffix_lengths)
    return _forward(*res, scale, interpret, sm_count), res


def _differentiable_bwd(scale, interpret, sm_count, res, cts):
    *floats, seq_to_prefix, prefix_lengths, suffix_lengths = res
    _, vjp = jax.vjp(lambda *f: mla_reference(*f, seq_to_prefix, prefix_lengths, suffix_lengths,
                                              scale), *floats)
    return (*vjp(cts), None, None, None)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def mla_kernels(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent, suffix_rope_k,
                seq_to_prefix, prefix_lengths, suffix_lengths, scale, interpret=False,
                sm_count=132):
    """The kernel path on canonical inputs (``q_nope [B, Tq, H, R]``, ``q_rope [B, Tq, H, Dr]``,
    ``prefix_latent [G, P, R]``, ``prefix_rope_k [G, P, Dr]``, ``suffix_latent [B, S, R]``,
    ``suffix_rope_k [B, S, Dr]``, int ``seq_to_prefix [B]``, ``prefix_lengths [G]``,
    ``suffix_lengths [B]``; :func:`kernels_supported` holds): ``(out [B, Tq, H, R]`` in the
    queries' dtype, ``lse [B, Tq, H]`` float32)``, differentiable (the module docstring).
    Lengths are clamped; the keys are split so that each kernel has about ``sm_count`` CTAs when
    its rows alone give fewer."""
    return _differentiable(q_nope, q_rope, prefix_latent, prefix_rope_k, suffix_latent,
                           suffix_rope_k, seq_to_prefix, prefix_lengths, suffix_lengths,
                           float(scale), bool(interpret), max(1, int(sm_count)))
