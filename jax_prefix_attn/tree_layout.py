"""Row layouts and partial states of tree attention (pure JAX glue around the kernels).

Query rows are processed in *sorted* order (by the depth-first number of their node, see
:mod:`jax_prefix_attn.tree_schedule`) and in the kernels' layout ``[Hkv, R_pad * G, D]``: the
``G = Hq / Hkv`` query heads of one kv head are consecutive query vectors, so one program's
matrix product covers every query head sharing its K/V tiles.  Partial states ``(o, lse)``
(``o`` normalised, ``lse`` float32, ``-inf`` where nothing was visible) are merged per row by a
gather through a schedule's reduction map and a log-sum-exp reduction.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_prefix_attn.tree_metadata import TreeMetadata
from jax_prefix_attn.tree_schedule import Schedule

__all__ = ["row_tables", "q_sorted", "pad_pool", "partial_dtype", "gather_parts", "merge_states",
           "part_cotangents"]


def row_tables(meta: TreeMetadata, suffix_lengths):
    """Sorted-order ``(row_key [R_pad], row_limit [R_pad])`` int32: the dfs number of each row's
    node (``-1`` padding) and the last path position it may see (bottom-right causal rule)."""
    b, tq = meta.num_seqs, meta.tq
    n_rows = b * tq
    srow = meta.sorted_rows                                    # [R_pad], n_rows for padding
    real = srow < n_rows
    seq = jnp.where(real, srow // tq, 0)
    t = jnp.where(real, srow % tq, 0)
    s_len = suffix_lengths.astype(jnp.int32)
    limit = meta.seq_path_len[seq] + s_len[seq] - tq + t
    limit = jnp.where(real, limit, -1)
    return meta.row_key, limit


def q_sorted(q, meta: TreeMetadata, hkv: int):
    """``q [B, Tq, Hq, D]`` -> sorted-row layout ``[Hkv, R_pad * G, D]`` (padding rows zero)."""
    b, tq, hq, d = q.shape
    g = hq // hkv
    rows = q.reshape(b * tq, hkv, g, d)
    rows = jnp.concatenate([rows, jnp.zeros((1, hkv, g, d), q.dtype)], axis=0)
    qs = rows[meta.sorted_rows]                                # [R_pad, Hkv, G, D]
    return jnp.transpose(qs, (1, 0, 2, 3)).reshape(hkv, -1, d)


def pad_pool(k_nhd, v_nhd, c: int):
    """Zero-pad a pool ``[N, Hkv, D]`` to at least ``c`` tokens (kernel windows are ``c`` wide)."""
    n = k_nhd.shape[0]
    if n >= c:
        return k_nhd, v_nhd
    pad = ((0, c - n), (0, 0), (0, 0))
    return jnp.pad(k_nhd, pad), jnp.pad(v_nhd, pad)


def partial_dtype(dtype):
    """Partial outputs are stored in the input dtype when it is 16-bit (half the traffic; they are
    normalised, so this adds about one rounding of the output), float32 otherwise."""
    return jnp.float32 if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(dtype)


def gather_parts(sched: Schedule, o, lse, group: int):
    """Partials ``o [W, Hkv, M, D]`` / ``lse [W, Hkv, M]`` of a schedule, per original row:
    ``o [R, P, Hkv, G, D]`` and ``lse [R, P, Hkv, G]`` (``-inf`` in unused slots)."""
    w, hkv, m, d = o.shape
    br = sched.block_rows
    parts = sched.parts                                       # [R, P]
    valid = parts >= 0
    idx = jnp.where(valid, parts, 0)
    wi, si = idx // br, idx % br
    o5 = o.reshape(w, hkv, br, group, d)
    l4 = lse.reshape(w, hkv, br, group)
    og = o5[wi, :, si]                                        # [R, P, Hkv, G, D]
    lg = l4[wi, :, si]                                        # [R, P, Hkv, G]
    lg = jnp.where(valid[..., None, None], lg, -jnp.inf)
    return og, lg


def merge_states(parts_o, parts_l):
    """Merge lists of ``o [..., P, Hkv, G, D]`` / ``lse [..., P, Hkv, G]`` over every P axis:
    ``(o [..., Hkv, G, D] float32, lse [..., Hkv, G])``.  A NaN part makes the row's ``o`` NaN
    (and its ``lse`` where the part's ``lse`` is NaN); :func:`jax_prefix_attn.tree_attention`
    flags the LSE of rows with a non-finite ``o`` once, when it returns the LSE."""
    m = None
    for l in parts_l:
        mm = jnp.max(l, axis=-3)
        m = mm if m is None else jnp.maximum(m, mm)
    m = jax.lax.stop_gradient(m)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # (NaN stays NaN: a NaN part makes the row NaN)
    total, acc = 0.0, 0.0
    for o, l in zip(parts_o, parts_l):
        w = jnp.exp(l - m[..., None, :, :])
        w = jnp.where(l == -jnp.inf, 0.0, w)
        total = total + jnp.sum(w, axis=-3)
        o = jnp.where((w > 0)[..., None], o.astype(jnp.float32), 0.0)
        acc = acc + jnp.sum(w[..., None] * o, axis=-4)
    empty = total == 0
    t_safe = jnp.where(empty, 1.0, total)
    out = acc / t_safe[..., None]
    return out, jnp.where(empty, -jnp.inf, m + jnp.log(t_safe))


def part_cotangents(o_part, l_part, out, lse, d_out, d_lse):
    """Cotangents of one part ``(o_part, l_part)`` of a merged state ``(out, lse)`` (same shapes,
    ``D`` last; float32): with ``w = exp(l_part - lse)``, ``d o_part = w d_out`` and
    ``d l_part = w (<d_out, o_part - out> + d_lse)`` (``w = 0`` where the part saw nothing)."""
    f32 = jnp.float32
    lse = lse.astype(f32)
    # (a part is empty where its lse is -inf; a NaN lse gives NaN cotangents)
    w = jnp.where(l_part == -jnp.inf, 0.0, jnp.exp(l_part - jnp.where(lse == -jnp.inf, 0.0, lse)))
    d_out = d_out.astype(f32)
    d_l = w * (jnp.sum(d_out * (o_part.astype(f32) - out.astype(f32)), axis=-1) + d_lse.astype(f32))
    return w[..., None] * d_out, d_l
