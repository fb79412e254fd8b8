"""Float64 NumPy oracle of the differential fuzz harness (independent of the library).

Every attention the library computes is, per sequence ``b``, softmax attention of its queries
``q [Tq, Hq, D]`` over an explicit context ``k, v [L, Hkv, D]`` with a visibility mask
``[Tq, L]``.  The callers build those contexts and masks with NumPy (concatenating prefix and
suffix, gathering tree paths); :func:`attend` computes the answer in float64 and says which
rows must be NaN (a NaN query, or a NaN key or value the row sees) and which may be (a NaN
value of the same kv head at a position the row does not see: zero weight times NaN inside a
shared tile, see README "Conventions").
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np


@dataclasses.dataclass
class Expected:
    """Oracle answer for a batch: ``out [B, Tq, Hq, D]``, ``lse [B, Tq, Hq]`` (float64, from the
    inputs with their NaNs taken out), ``must_nan`` / ``may_nan [B, Tq, Hq]`` bool."""
    out: np.ndarray
    lse: np.ndarray
    must_nan: np.ndarray
    may_nan: np.ndarray


def attend(q_thd, k_lhd, v_lhd, mask_tl, scale):
    """One sequence: ``(out [Tq, Hq, D], lse [Tq, Hq], must_nan [Tq, Hq], nan_v_heads [Hkv])``.

    ``out``/``lse`` are computed with every NaN replaced by 0 (their values matter only on rows
    that see no NaN); rows that see nothing get ``out = 0``, ``lse = -inf``."""
    q = np.asarray(q_thd, np.float64)
    k = np.asarray(k_lhd, np.float64)
    v = np.asarray(v_lhd, np.float64)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    nan_q, nan_k, nan_v = np.isnan(q), np.isnan(k), np.isnan(v)
    bad_q = nan_q.any(-1)                                           # [Tq, Hq]
    bad_kv = nan_k.any(-1) | nan_v.any(-1)                          # [L, Hkv]
    q, k, v = (np.where(n, 0.0, x) if n.any() else x for x, n in ((q, nan_q), (k, nan_k), (v, nan_v)))
    # per kv head: its G query heads' Tq * G rows against its keys (BLAS matmuls)
    qh = q.reshape(tq, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, tq * g, d)
    s = np.matmul(qh, k.transpose(1, 2, 0)) * scale                 # [Hkv, Tq * G, L]
    vis = np.broadcast_to(np.repeat(np.asarray(mask_tl, bool), g, axis=0)[None], s.shape)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    empty = ~vis.any(-1)
    p = np.where(vis, np.exp(s - np.where(empty, 0.0, m)[..., None]), 0.0)
    l_safe = np.where(empty, 1.0, p.sum(-1))
    out = np.matmul(p / l_safe[..., None], v.transpose(1, 0, 2))    # [Hkv, Tq * G, D]
    lse = np.where(empty, -np.inf, m + np.log(l_safe))
    seen_bad = (vis & bad_kv.T[:, None, :]).any(-1)                 # [Hkv, Tq * G]
    to_thd = lambda x: np.moveaxis(x.reshape((hkv, tq, g) + x.shape[2:]), 0, 1).reshape(  # noqa: E731
        (tq, hq) + x.shape[2:])
    must = (bad_q & ~to_thd(empty)) | to_thd(seen_bad)
    return to_thd(out), to_thd(lse), must, nan_v.any((0, 2))


def attend_batch(q_bthd, context, scale) -> Expected:
    """The whole batch: ``context(b) = (k [L_b, Hkv, D], v, mask [Tq, L_b])`` (called once per
    sequence, so only a few contexts are alive at a time; sequences run on a few threads: NumPy
    releases the GIL in its array loops and BLAS).  A NaN value of kv head ``h`` anywhere in
    the contexts may spill to every row of that kv head."""
    q = np.asarray(q_bthd)
    b, tq, hq, d = q.shape

    def one(i):
        k, v, mask = context(i)
        return attend(q[i], k, v, mask, scale)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        res = list(pool.map(one, range(b)))
    out = np.stack([r[0] for r in res])
    lse = np.stack([r[1] for r in res])
    must = np.stack([r[2] for r in res])
    spill_heads = np.any([r[3] for r in res], axis=0)
    may = np.broadcast_to(np.repeat(spill_heads, hq // spill_heads.shape[0])[None, None, :],
                          must.shape) | must
    return Expected(out, lse, must, may.copy())


def causal_mask(tq: int, length: int) -> np.ndarray:
    """``[Tq, length]``: query ``t`` sees keys ``j <= t + length - Tq`` (bottom-right causal)."""
    j = np.arange(length)[None, :]
    t = np.arange(tq)[:, None]
    return j <= t + length - tq


def merge(outs_n, lses_n):
    """Exact merge of partial states ``outs [N, ..., D]``, ``lses [N, ...]`` in float64:
    ``(out, lse, must_nan)``; parts with ``lse = -inf`` are empty (their ``out`` ignored)."""
    o = np.asarray(outs_n, np.float64)
    l = np.asarray(lses_n, np.float64)
    live = l != -np.inf                                              # NaN counts as live
    must = (np.isnan(l) | (live[..., None] & np.isnan(o)).any(-1)).any(0)
    l0 = np.where(np.isnan(l), -np.inf, l)
    m = l0.max(0)
    empty = ~(l0 > -np.inf).any(0)
    w = np.where(l0 > -np.inf, np.exp(l0 - np.where(empty, 0.0, m)), 0.0)
    tot = w.sum(0)
    out = np.einsum("n...,n...d->...d", w, np.where(live[..., None], np.nan_to_num(o), 0.0))
    out = out / np.where(empty, 1.0, tot)[..., None]
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, tot)))
    return out, lse, must
