"""Prefix trees (forests) over a flat KV pool, and their device-side metadata.

A :class:`PrefixTree` describes hierarchical prefix sharing (Hydragen section 3.3, DeFT):
node ``i`` has a parent ``parents[i]`` (``-1`` for a root) and a span
``[starts[i], starts[i] + lengths[i])`` of a flat KV pool ``k_pool/v_pool [N_tokens, Hkv, D]``;
sequence ``b`` is attached to node ``leaf_of_seq[b]`` and its context is the concatenation
of the spans on the root-to-node path (then its own suffix, see ``tree_attention``).
Several independent trees (a forest) are batched in one object.

:func:`build_tree_metadata` turns a tree into a :class:`TreeMetadata`: static-shaped,
padded int32 arrays (a registered pytree; numpy on the host, device arrays once passed to a
jitted function) that drive the kernels, so a decode step under
``jax.jit`` does no host work and growing suffixes never need a rebuild.  It holds three
schedules over the same tree:

* ``flatten`` (DeFT-Flatten): node spans flattened depth-first into fixed-size chunks of
  ``block_kv`` tokens (a chunk is one contiguous pool window; it may hold the end of one node
  and the start of the next when their spans are adjacent in the pool, as the constructors
  lay them out), each chunk paired with the contiguous range of query rows that see it
  (KV-guided grouping: rows are sorted by the depth-first index of their node, so the rows
  under any run of depth-first-consecutive nodes are contiguous), split in blocks of
  ``block_rows`` rows.  Per-token visibility is an interval test on depth-first numbers
  (token of node ``u`` is seen by a row of node ``x`` iff ``tin[u] <= tin[x] < tout[u]``) and
  a path-position test (for ``Tq > 1`` when a suffix is shorter than ``Tq - 1``).
* ``levels`` (Hydragen hierarchical): one schedule per tree depth; each item is
  ``(node, block of the rows under it)`` and loops over the node's whole span.
* ``nodes`` (DeFT-Node analogue): the same node items, all depths in one launch.

Each schedule has an item table, per-chunk token tables (flatten only) and a reduction map
``parts [B * Tq, P]``: for each query row (original order ``b * Tq + t``), the flat slots
``item * block_rows + row_in_block`` of its partial results, ``-1`` padded.  The final
per-row merge is a deterministic gather + log-sum-exp reduction (no atomics).

Padding buckets (they bound recompilation: metadata of trees whose bucketed sizes agree has
identical shapes and static fields):

* number of items ``W`` of every schedule: next power of two (>= 8); padding items do no work;
* number of chunks: next power of two (>= 1), padding chunks see nothing;
* parts per row ``P``: next power of two;
* ``block_rows``: power of two chosen from the largest row count of a chunk/node (bucketed);
* ``max_tiles`` (node schedules, only used by the pure-JAX mirror): next power of two.

The remaining shapes (``B * Tq`` query rows) are fixed by the query shape anyway.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["PrefixTree", "TreeMetadata", "Schedule", "build_tree_metadata", "ITEM_FIELDS"]

# Columns of a schedule's item table ``items [W, 9]`` (int32).
ITEM_FIELDS = ("kv_start", "ntiles", "row_start", "tin", "tout", "pos0", "length", "off0", "chunk")
KV_START, NTILES, ROW_START, TIN, TOUT, POS0, LENGTH, OFF0, CHUNK = range(9)
NEVER = 1 << 30  # ``tin`` of a token nobody sees


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _as_int_vector(name: str, x: Any) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{name} must be a sequence of ints or an int array, got {type(x).__name__}") from e
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be concrete (host) ints, got a traced array; build the tree outside jit")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


class PrefixTree:
    """A forest of shared prefixes over a flat KV pool (host-side, immutable, hashable).

    Args:
      parents: ``[num_nodes]`` parent of each node, ``-1`` for a root.  A parent may come
        after its child in the list; it must exist and the parent links must not cycle.
      starts: ``[num_nodes]`` first pool token of each node's span.
      lengths: ``[num_nodes]`` span lengths (``>= 0``).
      leaf_of_seq: ``[num_seqs]`` node each sequence hangs from (usually a leaf).  Every node
        must have at least one sequence in its subtree.

    Sequence ``b``'s shared context is ``concat(span(u) for u on root..leaf_of_seq[b])``.
    """

    __slots__ = ("parents", "starts", "lengths", "leaf_of_seq", "_info")

    def __init__(self, parents, starts, lengths, leaf_of_seq):
        p = _as_int_vector("parents", parents)
        s = _as_int_vector("starts", starts)
        ln = _as_int_vector("lengths", lengths)
        leaf = _as_int_vector("leaf_of_seq", leaf_of_seq)
        n = p.shape[0]
        if n == 0:
            raise ValueError("parents must describe at least one node, got 0 nodes")
        if s.shape[0] != n or ln.shape[0] != n:
            raise ValueError(f"parents, starts and lengths must have the same length, got "
                             f"{n}, {s.shape[0]} and {ln.shape[0]}")
        bad = np.nonzero((p < -1) | (p >= n))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"parents[{i}] = {int(p[i])} names a missing parent: expected -1 (root) "
                             f"or a node index in [0, {n})")
        selfp = np.nonzero(p == np.arange(n))[0]
        if selfp.size:
            raise ValueError(f"parents[{int(selfp[0])}] = {int(selfp[0])}: a node cannot be its own parent (cycle)")
        if ln.min() < 0:
            i = int(np.argmin(ln))
            raise ValueError(f"lengths must be >= 0, got lengths[{i}] = {int(ln[i])}")
        if s.min() < 0:
            i = int(np.argmin(s))
            raise ValueError(f"starts must be >= 0 (spans lie in the pool), got starts[{i}] = {int(s[i])}")
        if leaf.shape[0] == 0:
            raise ValueError("leaf_of_seq must attach at least one sequence, got 0 sequences")
        badl = np.nonzero((leaf < 0) | (leaf >= n))[0]
        if badl.size:
            b = int(badl[0])
            raise ValueError(f"leaf_of_seq[{b}] = {int(leaf[b])} is not a node index in [0, {n})")
        # Cycle check: every node must reach a root within n steps.
        depth = np.full(n, -1, np.int64)
        for i in range(n):
            path = []
            u = i
            while u != -1 and depth[u] < 0:
                if u in path:
                    cyc = path[path.index(u):]
                    raise ValueError(f"parents has a cycle through nodes {cyc}: every node must lead to a root (-1)")
                path.append(u)
                if len(path) > n:
                    raise ValueError(f"parents has a cycle through node {i}")
                u = int(p[u])
            d = 0 if u == -1 else int(depth[u]) + 1
            for v in reversed(path):
                depth[v] = d
                d += 1
        # Every node needs a sequence beneath it.
        has_seq = np.zeros(n, bool)
        for u in set(int(x) for x in leaf):
            while u != -1 and not has_seq[u]:
                has_seq[u] = True
                u = int(p[u])
        if not has_seq.all():
            i = int(np.nonzero(~has_seq)[0][0])
            raise ValueError(f"node {i} has no sequence beneath it (a leaf without sequences): every leaf must "
                             f"appear in leaf_of_seq")
        object.__setattr__(self, "parents", tuple(int(x) for x in p))
        object.__setattr__(self, "starts", tuple(int(x) for x in s))
        object.__setattr__(self, "lengths", tuple(int(x) for x in ln))
        object.__setattr__(self, "leaf_of_seq", tuple(int(x) for x in leaf))
        object.__setattr__(self, "_info", None)

    def __setattr__(self, key, value):
        raise AttributeError("PrefixTree is immutable")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_parents(cls, parents: Sequence[int], lengths: Sequence[int],
                     leaf_of_seq: Sequence[int] | None = None, *, starts: Sequence[int] | None = None,
                     seqs_per_leaf: int = 1) -> "PrefixTree":
        """Tree from a parent list and span lengths.

        Without ``starts`` the spans are laid out contiguously in depth-first order (the
        layout DeFT-Flatten chunks best).  Without ``leaf_of_seq`` every leaf (node without
        children) gets ``seqs_per_leaf`` sequences, leaves in depth-first order.
        """
        p = _as_int_vector("parents", parents)
        ln = _as_int_vector("lengths", lengths)
        if p.shape != ln.shape:
            raise ValueError(f"parents and lengths must have the same length, got {p.shape[0]} and {ln.shape[0]}")
        if not isinstance(seqs_per_leaf, (int, np.integer)) or seqs_per_leaf < 1:
            raise ValueError(f"seqs_per_leaf must be an int >= 1, got {seqs_per_leaf!r}")
        # Validate structure first (dummy starts / leaves) so errors are about the input.
        probe_leaf = list(range(p.shape[0])) if leaf_of_seq is None else leaf_of_seq
        probe = cls(p, np.zeros_like(ln) if starts is None else starts, ln, probe_leaf)
        order = probe.info["dfs_order"]
        if starts is None:
            st = np.zeros_like(ln)
            st[order] = np.concatenate([[0], np.cumsum(ln[order])[:-1]])
        else:
            st = _as_int_vector("starts", starts)
        if leaf_of_seq is None:
            nchild = np.zeros(p.shape[0], np.int64)
            for x in p:
                if x >= 0:
                    nchild[x] += 1
            leaves = [int(u) for u in order if nchild[u] == 0]
            leaf_of_seq = np.repeat(np.array(leaves, np.int64), int(seqs_per_leaf))
        return cls(parents=p, starts=st, lengths=ln, leaf_of_seq=leaf_of_seq)

    @classmethod
    def from_nested(cls, forest: Sequence[Any], *, seqs_per_leaf: int = 1) -> "PrefixTree":
        """Forest from nested lists of token counts.

        ``forest`` is a list of trees; a tree is an int (a leaf with that many tokens) or a
        list ``[length, child, child, ...]``.  Spans are laid out contiguously in depth-first
        order; each leaf gets ``seqs_per_leaf`` sequences.  Example (Hydragen APPS shape: a
        few-shot root with 8 problems, 16 samples each)::

            PrefixTree.from_nested([[2400, 500, 620, 300, 410, 800, 700, 650, 512]], seqs_per_leaf=16)
        """
        if not isinstance(forest, (list, tuple)) or len(forest) == 0:
            raise ValueError(f"forest must be a non-empty list of trees, got {forest!r}")
        parents: list[int] = []
        lengths: list[int] = []

        def add(tree, parent, where):
            if isinstance(tree, (int, np.integer)) and not isinstance(tree, bool):
                parents.append(parent)
                lengths.append(int(tree))
                return
            if not isinstance(tree, (list, tuple)) or len(tree) == 0 or isinstance(tree[0], bool) \
                    or not isinstance(tree[0], (int, np.integer)):
                raise ValueError(f"{where} must be an int (leaf length) or a list [length, child, ...], got {tree!r}")
            me = len(parents)
            parents.append(parent)
            lengths.append(int(tree[0]))
            for j, child in enumerate(tree[1:]):
                add(child, me, f"{where}[{j + 1}]")

        for i, t in enumerate(forest):
            add(t, -1, f"forest[{i}]")
        return cls.from_parents(parents, lengths, seqs_per_leaf=seqs_per_leaf)

    # ------------------------------------------------------------------ derived info
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def num_seqs(self) -> int:
        return len(self.leaf_of_seq)

    @property
    def info(self) -> dict:
        """Derived host arrays: dfs order, tin/tout, depth, path starts, path lengths."""
        if self._info is None:
            object.__setattr__(self, "_info", _derive(self))
        return self._info

    def path(self, b: int) -> list[int]:
        """Node ids on sequence ``b``'s root-to-node path."""
        u = self.leaf_of_seq[b]
        out = []
        while u != -1:
            out.append(u)
            u = self.parents[u]
        return out[::-1]

    def path_token_indices(self, b: int) -> np.ndarray:
        """Pool indices of sequence ``b``'s shared context, in order."""
        parts = [np.arange(self.starts[u], self.starts[u] + self.lengths[u]) for u in self.path(b)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0,), np.int64)

    @property
    def pool_extent(self) -> int:
        """Smallest pool size that holds every span."""
        return int(max(s + n for s, n in zip(self.starts, self.lengths)))

    @property
    def spans_overlap(self) -> bool:
        """Whether two nodes' spans share a pool token (allowed: both then read it)."""
        s = np.asarray(self.starts, np.int64)
        e = s + np.asarray(self.lengths, np.int64)
        keep = e > s
        s, e = s[keep], e[keep]
        if s.shape[0] < 2:
            return False
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        return bool(np.any(s[1:] < np.maximum.accumulate(e)[:-1]))

    def check_pool(self, n_tokens: int, name: str = "k_pool") -> None:
        """Raise ``ValueError`` if a span lies outside a pool of ``n_tokens`` tokens."""
        for i, (s, n) in enumerate(zip(self.starts, self.lengths)):
            if s + n > n_tokens:
                raise ValueError(f"node {i}'s span [{s}, {s + n}) lies outside the pool: {name} has "
                                 f"{n_tokens} tokens (expected starts[i] + lengths[i] <= {n_tokens})")

    def _key(self):
        return (self.parents, self.starts, self.lengths, self.leaf_of_seq)

    def __eq__(self, other):
        return isinstance(other, PrefixTree) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return (f"PrefixTree(num_nodes={self.num_nodes}, num_seqs={self.num_seqs}, "
                f"tokens={sum(self.lengths)}, max_depth={int(self.info['depth'].max()) + 1})")


def _derive(tree: PrefixTree) -> dict:
    p = np.asarray(tree.parents, np.int64)
    ln = np.asarray(tree.lengths, np.int64)
    n = p.shape[0]
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, x in enumerate(p):
        (roots if x < 0 else children[x]).append(i)
    order = []
    tin = np.zeros(n, np.int64)
    tout = np.zeros(n, np.int64)
    depth = np.zeros(n, np.int64)
    pstart = np.zeros(n, np.int64)
    stack = [(r, 0, 0, False) for r in reversed(roots)]
    while stack:
        u, d, ps, done = stack.pop()
        if done:
            tout[u] = len(order)
            continue
        tin[u] = len(order)
        order.append(u)
        depth[u] = d
        pstart[u] = ps
        stack.append((u, d, ps, True))
        for c in reversed(children[u]):
            stack.append((c, d + 1, ps + ln[u], False))
    leaf = np.asarray(tree.leaf_of_seq, np.int64)
    return {
        "dfs_order": np.asarray(order, np.int64), "tin": tin, "tout": tout, "depth": depth,
        "path_start": pstart, "seq_path_len": pstart[leaf] + ln[leaf], "children": children,
    }


# ---------------------------------------------------------------------- metadata pytree


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


# A tree whose sequences have at most this many path tokens below their root is "shallow"
# (speculative-decoding token trees, short branches): ``tree_attention(impl="auto")`` then runs
# the roots through the shared-prefix path and gathers those few tokens per sequence (H200,
# bench/results/tree_attention_h200.json: the single-level shared path was 1.8x faster than the
# tree schedules on 32- and 64-draft speculative trees).
SHALLOW_MAX_TOKENS = 64


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TreeMetadata:
    """Device metadata of a :class:`PrefixTree` for queries with ``tq`` tokens per sequence.

    Arrays: ``flatten``/``nodes`` (:class:`Schedule`), ``levels`` (tuple of
    :class:`Schedule`, one per depth), ``sorted_rows [R_pad]`` (original row of each sorted
    row, ``B * Tq`` for padding), ``row_key [R_pad]`` (dfs number of the sorted row's node,
    ``-1`` padding), ``seq_path_len [B]`` (shared context length of each sequence).
    Static: ``num_seqs``, ``tq``, ``group`` (``Hq // Hkv``), ``pool_size``, ``preferred``
    (the cost model's schedule, ``"flatten"`` or ``"levelwise"``), ``single_level`` (every
    sequence hangs from a root: plain shared-prefix attention), ``root_pad`` (power-of-two
    bucket of the longest root: eight buckets per octave, multiples of 128 from 1024 on).
    ``root_span [G, 2]`` (start, length of each root) and ``seq_root [B]`` (root index of each
    sequence's path) serve the single-level path.  ``shallow_idx [B, shallow_pad]`` (pool indices
    of each sequence's path tokens below its root, padded with 0) and ``shallow_len [B]`` serve
    the shallow path (roots through shared-prefix attention, the few other path tokens gathered
    per sequence); built, and ``shallow_pad > 0`` (16 or ``SHALLOW_MAX_TOKENS``), only when no sequence
    has more than ``SHALLOW_MAX_TOKENS`` path tokens below its root and the tree is not single-level.

    Hybrid decode schedule (``tq == 1`` only; ``None`` / ``False`` otherwise): ``excl_span [B, 2]``
    (pool start, length) of the node each sequence is attached to when no other sequence reads
    it (``(0, 0)`` otherwise), streamed by the decode suffix kernel in place; ``mid``
    (:class:`Schedule`, or ``None`` when empty) the other nodes except the root when
    ``hybrid_root`` (static: one root, read by several sequences, which then goes through the
    shared-prefix kernels); ``hybrid`` (static): the cost model prefers this schedule to
    ``preferred``.  ``spans_overlap`` (static): two nodes' spans share pool tokens, so the
    backward sums their gradients there (a scatter-add instead of a gather).
    """
    flatten: Schedule
    nodes: Schedule
    levels: tuple
    sorted_rows: Any
    row_key: Any
    seq_path_len: Any
    root_span: Any = None
    seq_root: Any = None
    num_seqs: int = 1
    tq: int = 1
    group: int = 1
    pool_size: int = 0
    preferred: str = "flatten"
    single_level: bool = False
    root_pad: int = 1
    shallow_idx: Any = None
    shallow_len: Any = None
    shallow_pad: int = 0
    mid: Any = None
    excl_span: Any = None
    hybrid: bool = False
    hybrid_root: bool = False
    spans_overlap: bool = False

    def tree_flatten(self):
        return ((self.flatten, self.nodes, self.levels, self.sorted_rows, self.row_key, self.seq_path_len,
                 self.root_span, self.seq_root, self.shallow_idx, self.shallow_len, self.mid, self.excl_span),
                (self.num_seqs, self.tq, self.group, self.pool_size, self.preferred, self.single_level,
                 self.root_pad, self.shallow_pad, self.hybrid, self.hybrid_root, self.spans_overlap))

    @classmethod
    def tree_unflatten(cls, aux, children):
        (flatten, nodes, levels, sorted_rows, row_key, seq_path_len, root_span, seq_root, shallow_idx,
         shallow_len, mid, excl_span) = children
        (num_seqs, tq, group, pool_size, preferred, single_level, root_pad, shallow_pad, hybrid,
         hybrid_root, spans_overlap) = aux
        return cls(flatten, nodes, levels, sorted_rows, row_key, seq_path_len, root_span, seq_root,
                   num_seqs, tq, group, pool_size, preferred, single_level, root_pad, shallow_idx,
                   shallow_len, shallow_pad, mid, excl_span, hybrid, hybrid_root, spans_overlap)

    @property
    def rows_padded(self) -> int:
        return int(self.row_key.shape[0])


def _block_rows_for(max_rows: int, group: int, max_m: int) -> int:
    """Rows per item: a power of two holding ``max_rows``, with ``16 <= rows * group <= max_m``."""
    lo = max(1, _next_pow2(-(-16 // group)))
    hi = max(lo, max_m // group)
    return int(min(max(_next_pow2(max(max_rows, 1)), lo), _next_pow2(hi)))


def _parts_map(item_rs: np.ndarray, item_lo: np.ndarray, item_hi: np.ndarray, block_rows: int,
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
    p = _next_pow2(int(rank.max()) + 1)
    parts = np.full((n_rows, p), -1, np.int32)
    parts[orow, rank] = slot
    return parts


def _pad_items(items: np.ndarray) -> np.ndarray:
    w = max(8, _next_pow2(items.shape[0]))
    out = np.zeros((w, len(ITEM_FIELDS)), np.int32)
    out[: items.shape[0]] = items
    out[items.shape[0]:, TIN] = NEVER
    return out


def _node_schedule(nodes: np.ndarray, tree: PrefixTree, info: dict, seq_lo, seq_hi, tq: int, group: int,
                   block_kv: int, max_m: int, sorted_rows: np.ndarray, n_rows: int) -> Schedule:
    ln = np.asarray(tree.lengths, np.int64)
    st = np.asarray(tree.starts, np.int64)
    nodes = np.asarray([u for u in nodes if ln[u] > 0], np.int64)
    rows_lo = seq_lo[nodes] * tq
    rows_hi = seq_hi[nodes] * tq
    br = _block_rows_for(int((rows_hi - rows_lo).max()) if nodes.size else 1, group, max_m)
    items = []
    for u, lo, hi in zip(nodes, rows_lo, rows_hi):
        nt = -(-int(ln[u]) // block_kv)
        for rs in range(int(lo), int(hi), br):
            items.append((st[u], nt, rs, info["tin"][u], info["tout"][u], info["path_start"][u], ln[u], 0, 0))
    items_arr = np.asarray(items, np.int64).reshape(-1, len(ITEM_FIELDS))
    if items_arr.shape[0]:
        ilo = np.repeat(rows_lo, [len(range(int(a), int(b), br)) for a, b in zip(rows_lo, rows_hi)])
        ihi = np.repeat(rows_hi, [len(range(int(a), int(b), br)) for a, b in zip(rows_lo, rows_hi)])
        parts = _parts_map(items_arr[:, ROW_START], ilo, ihi, br, sorted_rows, n_rows)
        max_tiles = _next_pow2(int(items_arr[:, NTILES].max()))
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


def _flatten_schedule(tree: PrefixTree, info: dict, sorted_keys: np.ndarray, tq: int, group: int,
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
        tok = np.zeros((_next_pow2(n_chunks), 3, c), np.int64)
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
    br = _block_rows_for(int((rows_hi - rows_lo).max()) if n_chunks else 1, group, max_m)
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
        parts = _parts_map(items_arr[:, ROW_START], np.asarray(ilo), np.asarray(ihi), br, sorted_rows, n_rows)
    else:
        parts = np.full((n_rows, 1), -1, np.int32)
    w_real = int(items_arr.shape[0])
    starts = np.zeros((tok.shape[0],), np.int32)
    starts[:n_chunks] = ws
    stats = (("items", w_real), ("kv_tokens_read", int(items_arr[:, NTILES].sum()) * c if w_real else 0),
             ("max_item_tokens", k * c), ("partial_rows", int((parts >= 0).sum())), ("parts", int(parts.shape[1])),
             ("chunks", n_chunks), ("tokens", int(ntok.sum()) if n_chunks else 0), ("chunks_per_item", k))
    return Schedule(items=_pad_items(items_arr), tok=tok.astype(np.int32),
                    parts=parts, mode="flatten", block_rows=br, block_kv=c, max_tiles=_next_pow2(k),
                    stats=stats, chunk_start=starts)


# Cost model constants (H100/H200 class GPU; only their ratios matter for the choice).
COST_MODEL = {
    "num_sms": 132,          # programs running at once (one per SM at these tile sizes)
    "hbm_bytes_per_s": 3.0e12,
    "sm_bytes_per_s": 6.0e10,  # what one program streams alone (a long node read by one SM)
    "flops_per_s": 2.5e14,   # Pallas/Triton attention matmul rate
    "launch_s": 4e-6,        # per kernel launch
    "program_s": 1.5e-6,     # fixed cost of one program (scheduling, q load, partial store)
    "prefix_flops_per_s": 4.5e14,  # shared-prefix kernel on a Hopper GPU (Mosaic GPU, ncu 440-550 TF/s)
}


def schedule_cost(sched: Schedule, *, group: int, head_dim: int = 128, heads_kv: int = 8,
                  kv_bytes: int = 2) -> float:
    """Estimated seconds of one schedule's kernel plus its share of the reduction.

    ``time = launch + max(bytes / HBM, flops / rate, waves * program, longest item / SM rate)``
    + partial-state traffic, with ``bytes`` the KV tiles streamed (every item re-reads its
    KV; flatten items read a ``block_kv`` chunk, node items their whole span), ``flops`` the
    ``4 * D`` per (query vector, token), and the longest item bounding the critical path
    (this is what punishes node-granular schedules on unbalanced trees, DeFT section 3.3).
    """
    cm = COST_MODEL
    s = dict(sched.stats)
    if s.get("items", 0) == 0:
        return 0.0
    m = sched.block_rows * group
    kv_bytes_read = s["kv_tokens_read"] * heads_kv * head_dim * 2 * kv_bytes
    flops = s["kv_tokens_read"] * heads_kv * m * head_dim * 4
    programs = s["items"] * heads_kv
    waves = -(-programs // cm["num_sms"])
    longest = s["max_item_tokens"] * head_dim * 2 * kv_bytes / cm["sm_bytes_per_s"]
    partial_bytes = s["partial_rows"] * heads_kv * group * (head_dim * kv_bytes + 4) * 2  # write + read
    return (cm["launch_s"] + max(kv_bytes_read / cm["hbm_bytes_per_s"], flops / cm["flops_per_s"],
                                 waves * cm["program_s"], longest)
            + partial_bytes / cm["hbm_bytes_per_s"])


@functools.lru_cache(maxsize=64)
def _build_cached(tree: PrefixTree, tq: int, group: int, pool_size: int, block_kv: int,
                  max_block_m: int, chunks_per_item: int | None = None) -> TreeMetadata:
    info = tree.info
    b = tree.num_seqs
    n_rows = b * tq
    leaf = np.asarray(tree.leaf_of_seq, np.int64)
    keys = info["tin"][leaf]
    seq_order = np.argsort(keys, kind="stable")          # sorted position -> sequence
    sorted_keys = keys[seq_order]
    seq_lo = np.searchsorted(sorted_keys, info["tin"], side="left")
    seq_hi = np.searchsorted(sorted_keys, info["tout"], side="left")
    sorted_rows_real = (seq_order[:, None] * tq + np.arange(tq)[None, :]).reshape(-1)
    flat = _flatten_schedule(tree, info, sorted_keys, tq, group, block_kv, max_block_m, pool_size,
                             sorted_rows_real, n_rows, chunks_per_item=chunks_per_item)
    all_nodes = info["dfs_order"]
    nodes = _node_schedule(all_nodes, tree, info, seq_lo, seq_hi, tq, group, block_kv, max_block_m,
                           sorted_rows_real, n_rows)
    levels = []
    depth = info["depth"]
    for d in range(int(depth.max()) + 1):
        at = np.asarray([u for u in all_nodes if depth[u] == d], np.int64)
        if not any(tree.lengths[u] > 0 for u in at):
            continue
        levels.append(_node_schedule(at, tree, info, seq_lo, seq_hi, tq, group, block_kv, max_block_m,
                                     sorted_rows_real, n_rows))
    hyb = _hybrid_parts(tree, info, seq_lo, seq_hi, sorted_keys, tq, group, block_kv, max_block_m, pool_size,
                        sorted_rows_real, n_rows, chunks_per_item)
    max_br = max([flat.block_rows, nodes.block_rows] + [lv.block_rows for lv in levels]
                 + ([hyb["mid"].block_rows] if hyb["mid"] is not None else []))
    r_pad = n_rows + max_br
    sorted_rows = np.full((r_pad,), n_rows, np.int32)
    sorted_rows[:n_rows] = sorted_rows_real
    row_key = np.full((r_pad,), -1, np.int32)
    row_key[:n_rows] = np.repeat(sorted_keys, tq)
    cost_flat = schedule_cost(flat, group=group)
    cost_lvl = sum(schedule_cost(lv, group=group) for lv in levels)
    preferred = "flatten" if cost_flat < cost_lvl else "levelwise"
    hybrid = hyb["excl_span"] is not None and hyb["cost"] < min(cost_flat, cost_lvl)
    p_arr = np.asarray(tree.parents, np.int64)
    roots = np.nonzero(p_arr < 0)[0]
    root_index = np.full(tree.num_nodes, -1, np.int64)
    root_index[roots] = np.arange(roots.shape[0])
    seq_root = np.asarray([root_index[tree.path(i)[0]] for i in range(b)], np.int32)
    root_span = np.stack([np.asarray(tree.starts)[roots], np.asarray(tree.lengths)[roots]], axis=1).astype(np.int32)
    single = bool(np.all(p_arr[np.asarray(tree.leaf_of_seq)] < 0))
    root_len_of_seq = root_span[seq_root, 1].astype(np.int64)
    below = info["seq_path_len"].astype(np.int64) - root_len_of_seq    # path tokens below the root
    shallow_idx = shallow_len = None
    shallow_pad = 0
    if not single and 0 < int(below.max()) <= SHALLOW_MAX_TOKENS:
        shallow_pad = 16 if int(below.max()) <= 16 else SHALLOW_MAX_TOKENS  # two buckets
        shallow_idx = np.zeros((b, shallow_pad), np.int32)
        for i in range(b):
            toks = tree.path_token_indices(i)[int(root_len_of_seq[i]):]
            shallow_idx[i, :toks.shape[0]] = toks
        shallow_len = below.astype(np.int32)
    return TreeMetadata(flatten=flat, nodes=nodes, levels=tuple(levels), sorted_rows=sorted_rows,
                        row_key=row_key,
                        seq_path_len=info["seq_path_len"].astype(np.int32),
                        root_span=root_span, seq_root=seq_root,
                        num_seqs=b, tq=int(tq), group=int(group), pool_size=int(pool_size),
                        preferred=preferred, single_level=single,
                        root_pad=root_bucket(int(root_span[:, 1].max())),
                        shallow_idx=shallow_idx, shallow_len=shallow_len, shallow_pad=shallow_pad,
                        mid=hyb["mid"], excl_span=hyb["excl_span"], hybrid=bool(hybrid),
                        hybrid_root=hyb["root"], spans_overlap=tree.spans_overlap)


# Tiling of the hybrid schedule's tree-kernel launch (``mid``): 64-token key tiles and row blocks
# of at most 64 query vectors (16 sequences at Hq / Hkv = 4).  H200 sweep of 9 settings
# (bench/results/tree_mid_sweep_h200.json): the whole hybrid call took 0.452 ms
# instead of 0.535 with 128 / 128 on the tree-of-thought workload (inner nodes of 100-300
# tokens read by 10 or 100 sequences) and 0.503 instead of 0.514 on APPS-8.
HYBRID_MID_TILING = dict(block_kv=64, max_block_m=64)


def _hybrid_parts(tree: PrefixTree, info: dict, seq_lo, seq_hi, sorted_keys, tq: int, group: int, block_kv: int,
                  max_m: int, pool_size: int, sorted_rows: np.ndarray, n_rows: int, chunks_per_item) -> dict:
    """Hybrid decode schedule (see :class:`TreeMetadata`): ``excl_span``, ``mid``, ``root`` and its
    estimated ``cost`` (same units as :func:`schedule_cost`; the exclusive spans are streamed by
    the suffix launch that runs anyway, so they only add their bytes).  Only for ``tq == 1``."""
    none = dict(excl_span=None, mid=None, root=False, cost=math.inf)
    if tq != 1:
        return none
    cm = COST_MODEL
    b = tree.num_seqs
    ln = np.asarray(tree.lengths, np.int64)
    st = np.asarray(tree.starts, np.int64)
    count = (seq_hi - seq_lo).astype(np.int64)             # sequences below each node
    leaf = np.asarray(tree.leaf_of_seq, np.int64)
    excl = count[leaf] == 1
    excl_span = np.zeros((b, 2), np.int32)
    excl_span[excl, 0] = st[leaf[excl]]
    excl_span[excl, 1] = ln[leaf[excl]]
    roots = np.nonzero(np.asarray(tree.parents) < 0)[0]
    root = bool(roots.shape[0] == 1 and count[roots[0]] >= 2 and ln[roots[0]] > 0)
    keep = ln > 0
    keep[leaf[excl]] = False
    if root:
        keep[roots[0]] = False
    cost = 0.0
    mid = None
    block_kv = min(block_kv, HYBRID_MID_TILING["block_kv"])
    max_m = max(min(max_m, HYBRID_MID_TILING["max_block_m"]), 16)
    if keep.any():
        cands = [_node_schedule(np.nonzero(keep)[0], tree, info, seq_lo, seq_hi, tq, group, block_kv, max_m,
                                sorted_rows, n_rows),
                 _flatten_schedule(tree, info, sorted_keys, tq, group, block_kv, max_m, pool_size, sorted_rows,
                                   n_rows, chunks_per_item=chunks_per_item, keep=keep)]
        costs = [schedule_cost(c, group=group) for c in cands]
        mid = cands[int(np.argmin(costs))]
        cost += min(costs)
    heads_kv, head_dim, kv_bytes = 8, 128, 2              # schedule_cost's defaults
    head_tok_bytes = head_dim * 2 * kv_bytes                # K+V of one token, one kv head
    if root:
        r_len = int(ln[roots[0]])
        cost += cm["launch_s"] + max(r_len * heads_kv * head_tok_bytes / cm["hbm_bytes_per_s"],
                                     4.0 * b * group * heads_kv * r_len * head_dim / cm["prefix_flops_per_s"])
    # The spans ride in the suffix launch, one program per (sequence, kv head), unsplit: their
    # bytes, or the longest span streamed by one program when there are few sequences.
    cost += max(int(excl_span[:, 1].sum()) * heads_kv * head_tok_bytes / cm["hbm_bytes_per_s"],
                int(excl_span[:, 1].max()) * head_tok_bytes / cm["sm_bytes_per_s"])
    return dict(excl_span=excl_span, mid=mid, root=root, cost=cost)


def root_bucket(n: int) -> int:
    """Padded root length (static; bounds recompilation): a power of two up to 1024, above that
    the next multiple of a sixteenth of the next power of two (at most 12.5% padding, eight
    buckets per octave, always a multiple of 128, the Mosaic GPU prefix kernel's tile)."""
    p2 = _next_pow2(max(16, n))
    if p2 <= 1024:
        return p2
    step = p2 // 16
    return -(-n // step) * step


def build_tree_metadata(tree: PrefixTree, *, tq: int, group: int, pool_size: int, block_kv: int = 128,
                        max_block_m: int = 128, chunks_per_item: int | None = None,
                        device: bool = True) -> TreeMetadata:
    """Build (once per tree shape; cached) the device metadata of ``tree``.

    Args:
      tree: the forest.
      tq: query tokens per sequence (``q.shape[1]``).
      group: query heads per kv head (``Hq // Hkv``).
      pool_size: number of tokens in ``k_pool`` (chunk windows are clamped inside it).
      block_kv: tokens per chunk / tile (power of two >= 16; DeFT uses 128).
      max_block_m: largest query-vector block (``block_rows * group``) per item.
      chunks_per_item: consecutive chunks (same rows, adjacent windows) one flatten item may
        process; ``None`` picks the largest of 8/4/2/1 that leaves >= 64 items.
      device: return device arrays (``jax.device_put``; the default: pass them to the jitted
        step as an argument), else the cached host (numpy) arrays.
    """
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"tree must be a PrefixTree, got {type(tree).__name__}")
    for name, val in (("tq", tq), ("group", group), ("block_kv", block_kv), ("max_block_m", max_block_m)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")
    tree.check_pool(int(pool_size))
    if chunks_per_item is not None and (isinstance(chunks_per_item, bool) or int(chunks_per_item) < 1):
        raise ValueError(f"chunks_per_item must be None or a positive int, got {chunks_per_item!r}")
    meta = _build_cached(tree, int(tq), int(group), int(pool_size), int(block_kv), int(max_block_m),
                         None if chunks_per_item is None else int(chunks_per_item))
    # Device arrays: passing host (numpy) metadata to a jitted step would copy it every call.
    return jax.device_put(meta) if device else meta
