"""Paged KV layouts of a shared-prefix forest for FlashInfer's wrappers, built from the arrays
our functions take (one KV pool of node spans + per-sequence suffixes), so that every library
in ``bench/peers.py`` reads the same numbers.

A layout for page size ``ps`` holds, in one page table of ``num_pages`` pages (NHD: a cache
``[num_pages, 2, ps, Hkv, D]``, ``[:, 0]`` keys, ``[:, 1]`` values):

* **node pages**: every node's span paged from a fresh page (its last page partly filled);
* **suffix pages**: ``ceil(S_max / ps)`` pages per sequence holding its suffix;
* **own pages** (only when needed): per sequence, the tokens a page table cannot share -- the
  tail of an ancestor whose length is no multiple of ``ps`` and everything after it on the
  path, then the suffix -- copied once per sequence (what prefix caching with block hashing
  does: only full blocks are shared).

From it:

* :attr:`PagedLayout.cascade`: ``MultiLevelCascadeAttentionWrapper`` levels: level ``l`` has
  one request per node at depth ``l`` (its queries: the contiguous run of sequences below it),
  the last level one request per sequence over its suffix pages.  ``None`` (with
  :attr:`PagedLayout.cascade_why_not`) when the forest has leaves at different depths, a node's
  sequences are not contiguous, a node is empty or a suffix is empty (FlashInfer's levels
  partition all queries, and a request needs at least one key);
* :attr:`PagedLayout.decode`: ``BatchDecodeWithPagedKVCacheWrapper``'s page lists: one request
  per sequence, its shared full pages followed by its suffix (or own) pages.

:func:`build_cache` gathers the cache from the pool and the suffixes (JAX, one jitted call).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import PrefixTree

__all__ = ["Level", "PagedLayout", "paged_layout", "build_cache", "single_prefix_tree"]


@dataclasses.dataclass(frozen=True)
class Level:
    """One level's page table (int32 host arrays): requests ``r`` own the queries
    ``qo_indptr[r]:qo_indptr[r+1]`` and the pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``,
    the last of which holds ``last_page_len[r]`` tokens."""
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int

    @property
    def kv_lens(self) -> np.ndarray:
        """Keys per request."""
        return (np.diff(self.kv_indptr) - 1) * self.page_size + self.last_page_len


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """See the module doc.  Slots ``[num_pages * page_size]``: ``node_src`` (pool token index, or
    -1 for padding) for the node pages, then the suffix pages (``suffix_pages_per_seq`` per
    sequence, filled from ``suffix_k[b]``), then the own pages (``own_src``: pool token index;
    ``own_suffix``: suffix token index ``b * S_max + s``; one of the two is >= 0, or both -1
    for padding)."""
    page_size: int
    num_node_pages: int
    suffix_pages_per_seq: int
    num_seqs: int
    node_src: np.ndarray
    own_src: np.ndarray
    own_suffix: np.ndarray
    cascade: tuple[Level, ...] | None
    cascade_why_not: str | None
    decode: Level
    shared_pages_per_seq: np.ndarray

    @property
    def num_pages(self) -> int:
        return (self.num_node_pages + self.num_seqs * self.suffix_pages_per_seq
                + self.own_src.shape[0] // self.page_size)


def _cdiv(a, b):
    return -(-a // b)


def single_prefix_tree(prefix_len: int, batch: int) -> PrefixTree:
    """One root of ``prefix_len`` tokens at pool offset 0, shared by ``batch`` sequences."""
    return PrefixTree(parents=[-1], starts=[0], lengths=[prefix_len], leaf_of_seq=[0] * batch)


def _level(qo_indptr, pages, lens, ps) -> Level:
    kv_indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    idx = (np.concatenate(pages) if pages else np.zeros(0)).astype(np.int32)
    last = np.asarray([n - (len(p) - 1) * ps for p, n in zip(pages, lens)], np.int32)
    return Level(np.asarray(qo_indptr, np.int32), kv_indptr, idx, last, ps)


def _cascade_levels(tree, sl, s_max, ps, node_page0, suffix_page0, spp):
    """The cascade's levels, or ``(None, why)``."""
    b = tree.num_seqs
    paths = [tree.path(i) for i in range(b)]
    depths = {len(p) for p in paths}
    if len(depths) != 1:
        return None, f"leaves at different depths {sorted(depths)}: cascade levels must cover every query"
    levels = []
    for lvl in range(depths.pop()):
        nodes = [p[lvl] for p in paths]
        runs = [0] + [i for i in range(1, b) if nodes[i] != nodes[i - 1]] + [b]
        heads = [nodes[runs[j]] for j in range(len(runs) - 1)]
        if len(set(heads)) != len(heads):
            return None, f"the sequences below a node at depth {lvl} are not contiguous"
        lens = [tree.lengths[u] for u in heads]
        if min(lens) == 0:
            return None, f"an empty node at depth {lvl} (a request needs at least one key)"
        pages = [node_page0[u] + np.arange(_cdiv(n, ps)) for u, n in zip(heads, lens)]
        levels.append(_level(runs, pages, lens, ps))
    if s_max > 0:
        if int(np.min(sl)) < 1:
            return None, "an empty suffix (a request needs at least one key)"
        pages = [suffix_page0 + i * spp + np.arange(_cdiv(int(sl[i]), ps)) for i in range(b)]
        levels.append(_level(np.arange(b + 1), pages, [int(x) for x in sl], ps))
    return tuple(levels), None


def paged_layout(tree: PrefixTree, suffix_lengths, s_max: int, page_size: int) -> PagedLayout:
    """The layout of ``tree`` (spans in one pool) with per-sequence suffixes of
    ``suffix_lengths`` tokens (host ints ``[B]``, capacity ``s_max``) in pages of ``page_size``."""
    ps = int(page_size)
    sl = np.asarray(suffix_lengths, np.int64)
    b = tree.num_seqs
    if sl.shape != (b,) or (sl < 0).any() or (sl > s_max).any():
        raise ValueError(f"suffix_lengths must be {b} values in [0, {s_max}], got {sl.tolist()[:8]}...")
    n_nodes = tree.num_nodes
    node_page0 = np.zeros(n_nodes, np.int64)
    node_src = []
    cur = 0
    for u in range(n_nodes):
        n = tree.lengths[u]
        npg = _cdiv(n, ps)
        node_page0[u] = cur
        src = np.full(npg * ps, -1, np.int64)
        src[:n] = tree.starts[u] + np.arange(n)
        node_src.append(src)
        cur += npg
    num_node_pages = cur
    spp = _cdiv(s_max, ps)
    suffix_page0 = num_node_pages
    own_page0 = suffix_page0 + b * spp
    cascade, why = _cascade_levels(tree, sl, s_max, ps, node_page0, suffix_page0, spp)
    # decode page lists: shared full pages while the path stays page-aligned, then own pages
    own_src, own_suffix, pages, lens, shared_count = [], [], [], [], []
    own_cur = own_page0
    for i in range(b):
        shared, tail = [], []
        aligned = True
        for u in tree.path(i):
            n = tree.lengths[u]
            if aligned:
                full = n // ps
                shared.append(node_page0[u] + np.arange(full))
                if n % ps:
                    aligned = False
                    tail.append(tree.starts[u] + np.arange(full * ps, n))
            else:
                tail.append(tree.starts[u] + np.arange(n))
        shared = np.concatenate(shared) if shared else np.zeros(0, np.int64)
        tail = np.concatenate(tail) if tail else np.zeros(0, np.int64)
        s_i = int(sl[i])
        if tail.size == 0:
            own = suffix_page0 + i * spp + np.arange(_cdiv(s_i, ps))
        else:
            n_own = tail.size + s_i
            npg = _cdiv(n_own, ps)
            src = np.full(npg * ps, -1, np.int64)
            suf = np.full(npg * ps, -1, np.int64)
            src[:tail.size] = tail
            suf[tail.size:n_own] = i * s_max + np.arange(s_i)
            own_src.append(src)
            own_suffix.append(suf)
            own = own_cur + np.arange(npg)
            own_cur += npg
        pages.append(np.concatenate([shared, own]))
        lens.append(int(tree.info["seq_path_len"][i]) + s_i)
        shared_count.append(shared.size)
    if min(lens) < 1:
        raise ValueError("every sequence needs at least one key (path + suffix)")
    decode = _level(np.arange(b + 1), pages, lens, ps)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)  # noqa: E731
    return PagedLayout(page_size=ps, num_node_pages=num_node_pages, suffix_pages_per_seq=spp,
                       num_seqs=b, node_src=cat(node_src), own_src=cat(own_src),
                       own_suffix=cat(own_suffix), cascade=cascade, cascade_why_not=why,
                       decode=decode, shared_pages_per_seq=np.asarray(shared_count, np.int64))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gather(ps, spp, node_src, own_src, own_suffix, pool_k, pool_v, suffix_k, suffix_v):
    hkv, d = pool_k.shape[1:]
    b, s_max = suffix_k.shape[:2]

    def one(pool, suffix):
        zero = jnp.zeros((1, hkv, d), pool.dtype)
        pz = jnp.concatenate([pool, zero])
        node = pz[jnp.where(node_src < 0, pool.shape[0], node_src)]
        suf = jnp.pad(suffix, ((0, 0), (0, spp * ps - s_max), (0, 0), (0, 0)))
        flat = jnp.concatenate([suffix.reshape(b * s_max, hkv, d), zero])
        own = jnp.where((own_suffix >= 0)[:, None, None],
                        flat[jnp.where(own_suffix < 0, b * s_max, own_suffix)],
                        pz[jnp.where(own_src < 0, pool.shape[0], own_src)])
        return jnp.concatenate([node.reshape(-1, ps, hkv, d), suf.reshape(-1, ps, hkv, d),
                                own.reshape(-1, ps, hkv, d)])
    return jnp.stack([one(pool_k, suffix_k), one(pool_v, suffix_v)], axis=1)


def build_cache(layout: PagedLayout, pool_k, pool_v, suffix_k, suffix_v):
    """The paged cache ``[num_pages, 2, page_size, Hkv, D]`` of ``layout`` from the pool
    ``[N, Hkv, D]`` and the suffixes ``[B, S_max, Hkv, D]`` (padding slots are zeros)."""
    if suffix_k.shape[0] != layout.num_seqs:
        raise ValueError(f"suffix_k must hold {layout.num_seqs} sequences, got shape {suffix_k.shape}")
    return _gather(layout.page_size, layout.suffix_pages_per_seq, jnp.asarray(layout.node_src),
                   jnp.asarray(layout.own_src), jnp.asarray(layout.own_suffix), pool_k, pool_v,
                   suffix_k, suffix_v)
