"""Gradients of tree attention's schedules.

* :func:`grads_via_kernels` (the ``"kernels"`` backward of the kernel paths): the tree part
  through :func:`pallas_kernels.tree_attention_bwd.tree_grads` over the flatten schedule's
  metadata (whichever schedule ran the forward), the suffix part through
  :func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`, both with the merged ``out`` /
  ``lse`` saved by the forward (FlashAttention-2's ``p = exp(s - lse)``), so nothing of size
  rows x keys is materialised; a draft token tree's suffix part is differentiated through its
  pure-JAX partial state, as its forward.  Its own backward (grad of grad) differentiates
  :func:`mirror_grads`.
* :func:`mirror_grads` (the ``"mirror"`` backward, and every backward of the pure-JAX paths):
  autodiff of the pure-JAX mirror of the flatten schedule, recomputed in the backward pass (it
  materialises the scores of every work item).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn.planner import suffix_grad_key_splits
from jax_prefix_attn.tree_drafts import draft_ancestors, draft_suffix_partials
from jax_prefix_attn.tree_layout import pad_pool, part_cotangents, q_sorted, row_tables
from jax_prefix_attn.tree_metadata import TreeMetadata
from jax_prefix_attn.tree_paths import kernel_smem_bytes, schedule_forward
from pallas_kernels.suffix_attention_bwd import suffix_part_grads
from pallas_kernels.tree_attention_bwd import tree_grads

__all__ = ["mirror_grads", "kernel_grads", "grads_via_kernels"]


def mirror_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, cts, scale):
    """Autodiff of the pure-JAX mirror of the flatten schedule (differentiable again)."""
    def f(q, k_pool, v_pool, suffix_k, suffix_v):
        return schedule_forward(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents,
                                scale=scale, schedule="flatten", backend="mirror")

    _, vjp = jax.vjp(f, q, k_pool, v_pool, suffix_k, suffix_v)
    return vjp(tuple(cts))


def kernel_grads(q, meta: TreeMetadata, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out,
                 lse, d_out, d_lse, *, scale: float, interpret: bool):
    """Gradients through the backward kernels: the tree part by the flatten schedule's
    (:func:`pallas_kernels.tree_attention_bwd.tree_grads`, whatever schedule ran the forward),
    the suffix part by :func:`pallas_kernels.suffix_attention_bwd.suffix_part_grads`, both with
    the merged ``out``/``lse``; ``dq`` is the sum of the two parts'."""
    b, tq, hq, d = q.shape
    n, hkv = k_pool.shape[:2]
    g = hq // hkv
    f32 = jnp.float32
    lse = lse.astype(f32)
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1) - d_lse.astype(f32)   # [B, Tq, Hq]
    d_out = d_out.astype(q.dtype)
    sched = meta.flatten
    key, lim = row_tables(meta, suffix_lengths)
    stat = lambda x: q_sorted(x[..., None], meta, hkv)[..., 0]  # noqa: E731  [Hkv, R_pad * G]
    kp, vp = pad_pool(k_pool, v_pool, sched.block_kv)
    dq, dk, dv = tree_grads(q_sorted(q, meta, hkv), q_sorted(d_out, meta, hkv), stat(lse), stat(delta), kp, vp,
                            sched.items, sched.tok, sched.chunk_start, sched.parts, jnp.repeat(key, g),
                            jnp.repeat(lim, g), group=g, block_rows=sched.block_rows, block_kv=sched.block_kv,
                            sm_scale=scale, interpret=interpret, disjoint=not meta.spans_overlap,
                            smem_bytes=kernel_smem_bytes())
    dq = dq.reshape(b, tq, hq, d)                                               # (original row order)
    if draft_parents is not None:
        # the draft-masked suffix part (pure JAX, as its forward), through its partial state's
        # cotangents under the merge
        def part(q_, sk, sv):
            o, l = draft_suffix_partials(q_, sk, sv, suffix_lengths, draft_ancestors(draft_parents, tq), scale)
            return o[:, :, 0], l[:, :, 0]                                # [B, Tq, Hkv, G(, D)]
        (o_s, l_s), vjp = jax.vjp(part, q, suffix_k, suffix_v)
        shp = (b, tq, hkv, g)
        d_o, d_l = part_cotangents(o_s, l_s, out.reshape(shp + (d,)), lse.reshape(shp),
                                   d_out.reshape(shp + (d,)), d_lse.reshape(shp))
        dq_x, dks, dvs = vjp((d_o.astype(o_s.dtype), d_l))
        dq = dq + dq_x.astype(f32)
    elif suffix_k.shape[1] > 0:
        dq_x, dks, dvs = suffix_part_grads(
            q, d_out, lse, delta, suffix_k, suffix_v, suffix_lengths, scale=scale,
            interpret=interpret, key_splits=suffix_grad_key_splits(b, hkv, suffix_k.shape[1]))
        dq = dq + dq_x.astype(f32)
    else:
        dks, dvs = jnp.zeros_like(suffix_k), jnp.zeros_like(suffix_v)
    return (dq.astype(q.dtype), dk[:n].astype(k_pool.dtype), dv[:n].astype(v_pool.dtype),
            dks.astype(suffix_k.dtype), dvs.astype(suffix_v.dtype))


# First-order gradients through the kernels; differentiating them again (grad of grad) goes
# through the mirror's autodiff, which the Pallas kernels have no rule for.
@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13))
def grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out,
                      d_lse, scale, interpret):
    """:func:`kernel_grads` with a ``custom_vjp`` whose backward differentiates :func:`mirror_grads`
    (``scale``, ``interpret`` static)."""
    return kernel_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse,
                        d_out, d_lse, scale=scale, interpret=interpret)


def _grads_via_kernels_fwd(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse,
                           d_out, d_lse, scale, interpret):
    grads = grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out,
                              lse, d_out, d_lse, scale, interpret)
    return grads, (q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out,
                   d_lse)


def _grads_via_kernels_bwd(scale, interpret, res, cts):
    q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out, lse, d_out, d_lse = res
    # (out and lse are functions of the inputs: the mirror recomputes them, so their own
    # cotangents are zero and the inputs' carry the whole second-order term)
    _, vjp = jax.vjp(lambda q_, kp, vp, sk, sv, do, dl: mirror_grads(
        q_, meta, kp, vp, sk, sv, suffix_lengths, draft_parents, (do, dl), scale),
        q, k_pool, v_pool, suffix_k, suffix_v, d_out, d_lse)
    dq, dkp, dvp, dks, dvs, dd_out, dd_lse = vjp(tuple(cts))
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return (dq, jax.tree_util.tree_map(f0, meta), dkp, dvp, dks, dvs, f0(suffix_lengths),
            None if draft_parents is None else f0(draft_parents),
            jnp.zeros_like(out), jnp.zeros_like(lse), dd_out, dd_lse)


grads_via_kernels.defvjp(_grads_via_kernels_fwd, _grads_via_kernels_bwd)

