"""Speculative-decoding draft token trees in tree attention (pure JAX).

The ``Tq`` queries of a sequence may be draft tokens forming a tree, stored as the last ``Tq``
suffix tokens; ``draft_parents[t]`` is the parent draft (``< t``) or ``-1`` (child of the
committed context).  Query ``t`` sees the shared path, the committed suffix and only its own
ancestors among the drafts (and itself).  The draft-masked suffix part is a dense masked
attention over the suffix (the shared path still goes through the tree schedules).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn._validation import check_array, check_range, is_concrete
from jax_prefix_attn.reference import masked_softmax
from pallas_kernels._common import flag_nonfinite

__all__ = ["check_draft_parents", "draft_ancestors", "masked_attention", "draft_suffix_partials"]


def check_draft_parents(draft_parents, b: int, tq: int, suffix_lengths, *, checked: bool = False):
    """Validate ``draft_parents`` (``[Tq]`` or ``[B, Tq]`` ints, or ``None``) and return it as
    ``[B, Tq]`` int32 (or ``None``).  Concrete values out of range raise ``ValueError``; traced
    ones are clamped to ``[-1, t - 1]`` for draft ``t`` (and, with ``checked``, reported under
    ``checkify``, as ``suffix_lengths < Tq``, which :func:`jax_prefix_attn.tree_attention`
    clamps up to ``Tq``)."""
    if draft_parents is None:
        return None
    if not hasattr(draft_parents, "shape"):
        draft_parents = np.asarray(draft_parents)
    check_array("draft_parents", draft_parents, (1, 2), floating=False, layout="[seq_q] or [batch, seq_q]")
    if draft_parents.shape[-1] != tq or (draft_parents.ndim == 2 and draft_parents.shape[0] != b):
        raise ValueError(f"draft_parents must have shape [{tq}] or [{b}, {tq}], got {tuple(draft_parents.shape)}")
    if is_concrete(draft_parents):
        vals = np.asarray(draft_parents).reshape(-1, tq)
        t = np.arange(tq)[None, :]
        bad = (vals < -1) | (vals >= t)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(f"draft_parents[..., {j}] = {int(vals[i, j])}: a draft's parent must be -1 or an "
                             f"earlier draft in [0, {j})")
    if is_concrete(suffix_lengths) and np.asarray(suffix_lengths).size and np.asarray(suffix_lengths).min() < tq:
        raise ValueError(f"with draft_parents the {tq} draft tokens are the last suffix tokens: suffix_lengths must "
                         f"be >= {tq}, got minimum {int(np.asarray(suffix_lengths).min())}")
    check_range("draft_parents", draft_parents, -1, jnp.arange(tq) - 1,   # (traced values only)
                enabled=checked, bounds="[-1, t - 1] for draft t")
    check_range("suffix_lengths", suffix_lengths, tq, np.iinfo(np.int32).max, enabled=checked,
                bounds=f"[{tq}, S_max] with draft_parents (the {tq} drafts are the last suffix "
                       f"tokens)", rule="clamped up to it")
    dp = jnp.clip(jnp.asarray(draft_parents, jnp.int32), -1, jnp.arange(tq, dtype=jnp.int32) - 1)
    return jnp.broadcast_to(dp, (b, tq)) if dp.ndim == 1 else dp



def draft_ancestors(draft_parents_bt, tq: int):
    """``anc [B, Tq, Tq]`` bool: ``anc[b, t, u]`` iff draft token ``u`` is ``t`` or an ancestor of ``t``
    (parents ``-1`` attach to the committed context).  Pointer closure by repeated squaring."""
    par = draft_parents_bt.astype(jnp.int32)
    u = jnp.arange(tq)
    a = (u[None, None, :] == u[None, :, None]) | (u[None, None, :] == par[:, :, None])
    a = a.astype(jnp.float32)
    for _ in range(max(1, (tq - 1).bit_length())):
        a = jnp.minimum(a + jnp.einsum("btu,buv->btv", a, a), 1.0)
    return a > 0


def masked_attention(q_bthd, k_bshd, v_bshd, mask_bts, scale: float):
    """Exact attention with an explicit visibility mask ``[B, Tq, S]`` (float32 math, reference rules:
    ``lse=-inf``, ``out=0`` where nothing is visible, :func:`jax_prefix_attn.reference.masked_softmax`).
    Returns ``(o [B, Tq, Hkv, G, D] float32, lse [B, Tq, Hkv, G] float32)``."""
    b, tq, hq, d = q_bthd.shape
    hkv = k_bshd.shape[2]
    g = hq // hkv
    hi = jax.lax.Precision.HIGHEST
    qf = q_bthd.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    vis = mask_bts[:, None, None]                                          # [B, 1, 1, Tq, S]
    kf = jnp.where(jnp.any(mask_bts, axis=1)[:, :, None, None], k_bshd.astype(jnp.float32), 0.0)
    vf = jnp.where(jnp.any(mask_bts, axis=1)[:, :, None, None], v_bshd.astype(jnp.float32), 0.0)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=hi) * scale
    p, lse = masked_softmax(s, vis)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, vf, precision=hi)              # [B, Tq, Hkv, G, D]
    lse = jnp.transpose(lse[..., 0], (0, 3, 1, 2))                         # lse [B, Tq, Hkv, G]
    return o, flag_nonfinite(jax.lax.stop_gradient(o), lse)


def draft_suffix_partials(q, suffix_k, suffix_v, suffix_lengths, draft_anc, scale: float):
    """Suffix part when the ``Tq`` queries form a draft token tree (the last ``Tq`` suffix tokens):
    query ``t`` sees committed suffix tokens ``j < S_b - Tq`` and draft tokens on its own branch."""
    b, tq = q.shape[:2]
    smax = suffix_k.shape[1]
    s_len = suffix_lengths.astype(jnp.int32)[:, None, None]
    j = jnp.arange(smax)[None, None, :]
    first = s_len - tq                                                     # first draft position
    du = jnp.clip(j - first, 0, tq - 1)                                    # [B, 1, S]
    on_branch = jnp.take_along_axis(draft_anc, jnp.broadcast_to(du, (b, tq, smax)), axis=2)
    mask = (j < s_len) & ((j < first) | on_branch)
    o, lse = masked_attention(q, suffix_k, suffix_v, mask, scale)
    return o[:, :, None], lse[:, :, None]

