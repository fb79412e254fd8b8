"""Work lists (schedules) of tree attention: which pool windows each kernel program reads for
which block of query rows, and how the partial states reduce per row.

A :class:`Schedule` is one kernel launch's work list over a :class:`PrefixTree` whose query rows
are sorted by the depth-first number of their node (KV-guided grouping: the rows under any run
of depth-first-consecutive nodes are contiguous):

* :func:`flatten_schedule` (DeFT-Flatten): node spans flattened depth-first into chunks of
  ``block_kv`` tokens (a chunk is one contiguous pool window; it may hold the end of one node
  and the start of the next when their spans are adjacent in the pool), each chunk paired with
  the contiguous range of rows that see it, split in blocks of ``block_rows`` rows.  Per-token
  visibility is an interval test on depth-first numbers (a token of node ``u`` is seen by a row
  of node ``x`` iff ``tin[u] <= tin[x] < tout[u]``) and a path-position test (for ``Tq > 1``).
  Equal-sized items keep the programs balanced whatever the tree's shape.
* :func:`node_schedule` (Hydragen level / DeFT-Node): one item per ``(node, block of the rows
  under it)`` looping over the node's whole span.

Each schedule carries a reduction map ``parts [B * Tq, P]``: for each query row (original
order ``b * Tq + t``), the flat slots ``item * block_rows + row_in_block`` of its partial
results, ``-1`` padded; the per-row merge is a deterministic gather + log-sum-exp reduction
(no atomics).  Item tables are padded to a power of two (>= 8) of items, chunk tables to a power
of two of chunks and ``P`` to a power of two, which bounds recompilation.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jax_prefix_attn.prefix_tree import PrefixTree
from pallas_kernels.tree_attention import ITEM_FIELDS, LENGTH, NEVER, NTILES, ROW_START, TIN

__all__ = ["Schedule", "next_pow2", "block_rows_for", "parts_map", "node_schedule", "flatten_schedule"]


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Schedule:
    """One kernel launch's work list.

    Arrays: ``items [W, 9]`` int32 (columns :data:`ITEM_FIELDS`), ``tok [NC, 3, C]`` int32
    per-chunk token ``(tin, tout, path_pos)`` and ``chunk_start [NC]`` (pool window of each
    chunk) in flatten mode (a flatten item processes ``ntiles`` consecutive chunks from
    ``chunk``; ``[1, 3, C]`` / ``[1]`` dummies otherwise),
    ``parts [B * Tq, P]`` int32 reduction slots (``-1`` = none).
    Static: ``mode`` (``"flatten"`` or ``"node"``), ``block_rows``, ``block_kv``,
    ``max_tiles`` (node mode: bucketed maximum tiles of one item), ``stats`` (exact host
    cost-model numbers; not static pytree data, so flatten/unflatten drops them).
    """
    items: Any
    tok: Any
    parts: Any
    mode: str = "flatten"
    block_rows: int = 16
    block_kv: int = 128
    max_tiles: int = 1
    stats: tuple = ()
    chunk_start: Any = None

    def tree_flatten(self):
        # ``stats`` (exact host numbers) stay out of the static part so that trees in the same
        # buckets share one compilation; they are only needed when the metadata is built.
        return (self.items, self.tok, self.parts, self.chunk_start), (self.mode, self.block_rows,
                                                                      self.block_kv, self.max_tiles)

    @classmethod
    def tree_unflatten(cls, aux, children):
        items, tok, parts, chunk_start = children
        return cls(items, tok, parts, *aux, chunk_start=chunk_start)



def block_rows_for(max_rows: int, group: int, max_m: int) -> int:
    """Rows per item: a power of two holding ``max_rows``, with ``16 <= rows * group <= max_m``."""
    lo = max(1, next_pow2(-(-16 // group)))
    hi = max(lo, max_m // group)
    return int(min(max(next_pow2(max(max_rows, 1)), lo), next_pow2(hi)))


def parts_map(item_rs: np.ndarray, item_lo: np.ndarray, item_hi: np.ndarray, block_rows: int,
               sorted_rows: np.ndarray, n_rows: int) -> np.ndarray:
    """``parts [n_rows, P]``: slots ``w * block_rows + i`` of each original row's partials."""
    start = np.maximum(item_rs, item_lo)
    stop = np.minimum(item_rs + block_rows, item_hi)
    counts = np.maximum(stop - start, 0)
    total = int(counts.sum())
    if total == 0:
        return np.full((n_rows, 1), -1, np.int32)
    wid = np.repeat(np.arange(item_rs.shape[0]), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    srow = start[wid] + (np.arange(total) - first[wid])
    slot = wid * block_rows + (srow - item_rs[wid])
    orow = sorted_rows[srow]
    order = np.argsort(orow, kind="stable")
    orow, slot = orow[order], slot[order]
    grp_first = np.searchsorted(orow, orow, side="left")
    rank = np.arange(total) - grp_first
    p = next_pow2(int(rank.max()) + 1)
    parts = np.full((n_rows, p), -1, np.int32)
    parts[orow, rank] = slot
    return parts


def _pad_items(items: np.ndarray) -> np.ndarray:
    w = max(8, next_pow2(items.shape[0]))
    out = np.zeros((w, len(ITEM_FIELDS)), np.int32)
    out[: items.shape[0]] = items
    out[items.shape[0]:, TIN] = NEVER
    return out


def node_schedule(nodes: np.ndarray, tree: PrefixTree, info: dict, seq_lo, seq_hi, tq: int, group: int,
                  block_kv: int, max_m: int, sorted_rows: np.ndarray, n_rows: int) -> Schedule:
    ln = np.asarray(tree.lengths, np.int64)
    st = np.asarray(tree.starts, np.int64)
    nodes = np.asarray([u for u in nodes if ln[u] > 0], np.int64)
    rows_lo = seq_lo[nodes] * tq
    rows_hi = seq_hi[nodes] * tq
    br = block_rows_for(int((rows_hi - rows_lo).max()) if nodes.size else 1, group, max_m)
    items = []
    for u, lo, hi in zip(nodes, rows_lo, rows_hi):
        nt = -(-int(ln[u]) // block_kv)
        for rs in range(int(lo), int(hi), br):
            items.append((st[u], nt, rs, info["tin"][u], info["tout"][u], info["path_start"][u], ln[u], 0, 0))
    items_arr = np.asarray(items, np.int64).reshape(-1, len(ITEM_FIELDS))
    if items_arr.shape[0]:
        ilo = np.repeat(rows_lo, [len(range(int(a), int(b), br)) for a, b in zip(rows_lo, rows_hi)])
        ihi = np.repeat(rows_hi, [len(range(int(a), int(b), br)) for a, b in zip(rows_lo, rows_hi)])
        parts = parts_map(items_arr[:, ROW_START], ilo, ihi, br, sorted_rows, n_rows)
        max_tiles = next_pow2(int(items_arr[:, NTILES].max()))
        kv_read = int((items_arr[:, LENGTH]).sum())
        max_item = int(items_arr[:, LENGTH].max())
    else:
        parts = np.full((n_rows, 1), -1, np.int32)
        max_tiles, kv_read, max_item = 1, 0, 0
    w_real = int(items_arr.shape[0])
    stats = (("items", w_real), ("kv_tokens_read", kv_read), ("max_item_tokens", max_item),
             ("partial_rows", int((parts >= 0).sum())), ("parts", int(parts.shape[1])))
    return Schedule(items=_pad_items(items_arr), tok=np.full((1, 3, block_kv), NEVER, np.int32),
                    parts=parts, mode="node", block_rows=br, block_kv=block_kv,
                    max_tiles=max_tiles, stats=stats, chunk_start=np.zeros((1,), np.int32))


def flatten_schedule(tree: PrefixTree, info: dict, sorted_keys: np.ndarray, tq: int, group: int,
                     block_kv: int, max_m: int, pool_size: int, sorted_rows: np.ndarray,
                     n_rows: int, chunks_per_item: int | None = None, min_items: int = 64,
                     keep: np.ndarray | None = None) -> Schedule:
    """DeFT-Flatten work list over every node (or the nodes where ``keep [N]`` is true)."""
    ln = np.asarray(tree.lengths, np.int64)
    st = np.asarray(tree.starts, np.int64)
    order = [u for u in info["dfs_order"] if ln[u] > 0 and (keep is None or keep[u])]
    c = block_kv
    if order:
        node_of_tok = np.repeat(np.asarray(order, np.int64), ln[order])
        seg_first = np.concatenate([[0], np.cumsum(ln[order])[:-1]])
        off = np.arange(node_of_tok.shape[0]) - np.repeat(seg_first, ln[order])
        pool_pos = st[node_of_tok] + off
        path_pos = info["path_start"][node_of_tok] + off
        brk = np.ones(pool_pos.shape[0], bool)
        brk[1:] = pool_pos[1:] != pool_pos[:-1] + 1
        run_id = np.cumsum(brk) - 1
        run_first = np.nonzero(brk)[0]
        k = np.arange(pool_pos.shape[0]) - run_first[run_id]
        new_chunk = brk | (k % c == 0)
        chunk_id = np.cumsum(new_chunk) - 1
        n_chunks = int(chunk_id[-1]) + 1
        chunk_first = np.nonzero(new_chunk)[0]
        ws_nominal = pool_pos[chunk_first]
        ws = np.minimum(ws_nominal, max(pool_size, c) - c)
        col = pool_pos - ws[chunk_id]
        tok = np.zeros((next_pow2(n_chunks), 3, c), np.int64)
        tok[:, 0, :] = NEVER
        tok[chunk_id, 0, col] = info["tin"][node_of_tok]
        tok[chunk_id, 1, col] = info["tout"][node_of_tok]
        tok[chunk_id, 2, col] = path_pos
        tin_tok = info["tin"][node_of_tok]
        tout_tok = info["tout"][node_of_tok]
        c_lo = np.full(n_chunks, NEVER, np.int64)
        c_hi = np.zeros(n_chunks, np.int64)
        np.minimum.at(c_lo, chunk_id, tin_tok)
        np.maximum.at(c_hi, chunk_id, tout_tok)
        rows_lo = np.searchsorted(sorted_keys, c_lo, side="left") * tq
        rows_hi = np.searchsorted(sorted_keys, c_hi, side="left") * tq
        ntok = np.bincount(chunk_id, minlength=n_chunks)
    else:
        n_chunks = 0
        tok = np.zeros((1, 3, c), np.int64)
        tok[:, 0, :] = NEVER
        rows_lo = rows_hi = ws = ntok = np.zeros((0,), np.int64)
    br = block_rows_for(int((rows_hi - rows_lo).max()) if n_chunks else 1, group, max_m)
    # Chunk groups: consecutive chunks with the same row range whose windows follow each other
    # (the inside of a long node) may be processed by one item, up to ``k`` chunks, so long
    # shared nodes leave fewer partial states to reduce.  ``k`` is the largest power of two
    # (<= max_chunks_per_item) that still leaves >= min_items items (load balance: items stay
    # equal-sized, DeFT's point, only coarser).
    def groups_for(k):
        out = []
        ci = 0
        while ci < n_chunks:
            cj = ci + 1
            while (cj < n_chunks and cj - ci < k and rows_lo[cj] == rows_lo[ci] and rows_hi[cj] == rows_hi[ci]
                   and ws[cj] == ws[cj - 1] + c):
                cj += 1
            out.append((ci, cj - ci))
            ci = cj
        return out

    def n_items(groups):
        return sum(len(range(int(rows_lo[g]), int(rows_hi[g]), br)) for g, _ in groups)

    k = 1
    if chunks_per_item is None:
        for cand in (8, 4, 2):
            if n_chunks and n_items(groups_for(cand)) >= min_items:
                k = cand
                break
    else:
        k = int(chunks_per_item)
    groups = groups_for(k)
    items, ilo, ihi = [], [], []
    for ci, nt in groups:
        for rs in range(int(rows_lo[ci]), int(rows_hi[ci]), br):
            items.append((ws[ci], nt, rs, 0, 0, 0, 0, 0, ci))
            ilo.append(rows_lo[ci])
            ihi.append(rows_hi[ci])
    items_arr = np.asarray(items, np.int64).reshape(-1, len(ITEM_FIELDS))
    if items_arr.shape[0]:
        parts = parts_map(items_arr[:, ROW_START], np.asarray(ilo), np.asarray(ihi), br, sorted_rows, n_rows)
    else:
        parts = np.full((n_rows, 1), -1, np.int32)
    w_real = int(items_arr.shape[0])
    starts = np.zeros((tok.shape[0],), np.int32)
    starts[:n_chunks] = ws
    stats = (("items", w_real), ("kv_tokens_read", int(items_arr[:, NTILES].sum()) * c if w_real else 0),
             ("max_item_tokens", k * c), ("partial_rows", int((parts >= 0).sum())), ("parts", int(parts.shape[1])),
             ("chunks", n_chunks), ("tokens", int(ntok.sum()) if n_chunks else 0), ("chunks_per_item", k))
    return Schedule(items=_pad_items(items_arr), tok=tok.astype(np.int32),
                    parts=parts, mode="flatten", block_rows=br, block_kv=c, max_tiles=next_pow2(k),
                    stats=stats, chunk_start=starts)

