"""Pure-JAX mirror of the tree kernel: the same schedule and metadata, computed with dense
per-item matrix products (it materialises the scores of every work item, ``[Hkv, W, M, T * C]``).

Off the GPU it is the forward of the level-wise, flatten and node schedules, and its autodiff is
the backward of the pure-JAX paths and of grad of grad.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_prefix_attn.tree_schedule import Schedule
from pallas_kernels.tree_attention import CHUNK, KV_START, LENGTH, NEVER, NTILES, OFF0, POS0, ROW_START, TIN, TOUT

__all__ = ["mirror_partials"]



def mirror_partials(sched: Schedule, q_hmd, k_nhd, v_nhd, key_m, lim_m, *, group: int, scale: float):
    """Pure-JAX twin of ``pallas_kernels.tree_attention.tree_partials`` (same metadata and layouts:
    ``q_hmd [Hkv, R_pad * G, D]``, pool ``[N, Hkv, D]``, ``key_m/lim_m [R_pad * G]``).  Returns
    ``o [W, Hkv, M, D]`` float32 and ``lse [W, Hkv, M]``."""
    items = sched.items
    c = sched.block_kv
    m = sched.block_rows * group
    hkv, _, d = q_hmd.shape
    n_pool = k_nhd.shape[0]
    hi = jax.lax.Precision.HIGHEST
    mi = items[:, ROW_START][:, None] * group + jnp.arange(m)[None, :]    # [W, M]
    q = q_hmd[:, mi]                                                      # [Hkv, W, M, D]
    key = key_m[mi][..., None]                                            # [W, M, 1]
    lim = lim_m[mi][..., None]
    if sched.mode == "flatten":
        nt = sched.max_tiles
        t = jnp.arange(nt)
        live = t[None, :] < items[:, NTILES][:, None]                      # [W, T]
        chunk = jnp.minimum(items[:, CHUNK][:, None] + t[None, :], sched.tok.shape[0] - 1)
        pos = (sched.chunk_start[chunk][:, :, None] + jnp.arange(c)[None, None, :]).reshape(chunk.shape[0], -1)
        tok = jnp.transpose(sched.tok[chunk], (0, 2, 1, 3)).reshape(chunk.shape[0], 3, -1)   # [W, 3, T*C]
        tok_ok = (tok[:, 0] != NEVER) & jnp.repeat(live, c, axis=1)        # [W, T*C]
        vis = (tok[:, None, 0] <= key) & (key < tok[:, None, 1]) & (tok[:, None, 2] <= lim)
        vis = vis & tok_ok[:, None, :]
    else:
        nt = sched.max_tiles
        t = jnp.arange(nt)
        nominal = items[:, KV_START][:, None] + t[None, :] * c                # [W, T]
        start = jnp.minimum(nominal, n_pool - c)
        pos3 = start[:, :, None] + jnp.arange(c)[None, None, :]            # [W, T, C]
        base = (items[:, KV_START] - items[:, OFF0])[:, None, None]
        off = pos3 - base
        lo = items[:, OFF0][:, None, None] + t[None, :, None] * c
        ok = (off >= lo) & (off < jnp.minimum(lo + c, items[:, LENGTH][:, None, None]))
        ok = ok & (t[None, :, None] < items[:, NTILES][:, None, None])
        pos = pos3.reshape(pos3.shape[0], -1)                              # [W, T*C]
        ok = ok.reshape(ok.shape[0], 1, -1)
        tpos = (items[:, POS0][:, None, None] + off).reshape(off.shape[0], 1, -1)
        node = (items[:, TIN][:, None, None] <= key) & (key < items[:, TOUT][:, None, None])
        vis = node & ok & (tpos <= lim)                                    # [W, M, T*C]
        tok_ok = ok[:, 0]                                                  # [W, T*C]
    k = jnp.where(tok_ok[:, :, None, None], k_nhd[pos], 0)                # [W, K, Hkv, D]
    v = jnp.where(tok_ok[:, :, None, None], v_nhd[pos], 0)                # garbage outside items
    s = jnp.einsum("hwmd,wkhd->hwmk", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
    s = jnp.where(vis[None], s, -jnp.inf)
    mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    mx = jnp.where(mx == -jnp.inf, 0.0, mx)  # (NaN stays NaN)
    p = jnp.where(vis[None], jnp.exp(s - mx), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0  # (a NaN score leaves l NaN: the row is NaN, not empty)
    l_safe = jnp.where(empty, 1.0, l)
    o = jnp.einsum("hwmk,wkhd->hwmd", p / l_safe, v.astype(jnp.float32), precision=hi)
    lse = jnp.where(empty, -jnp.inf, mx + jnp.log(l_safe))[..., 0]
    return jnp.transpose(o, (1, 0, 2, 3)), jnp.transpose(lse, (1, 0, 2))   # [W, Hkv, M, D], [W, Hkv, M]

