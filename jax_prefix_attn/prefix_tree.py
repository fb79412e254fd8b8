"""Prefix trees (forests) over a flat KV pool: the host-side data structure.

A :class:`PrefixTree` describes hierarchical prefix sharing (Hydragen section 3.3, DeFT):
node ``i`` has a parent ``parents[i]`` (``-1`` for a root) and a span
``[starts[i], starts[i] + lengths[i])`` of a flat KV pool ``k_pool/v_pool [N_tokens, Hkv, D]``;
sequence ``b`` is attached to node ``leaf_of_seq[b]`` and its context is the concatenation
of the spans on the root-to-node path (then its own suffix, see ``tree_attention``).
Several independent trees (a forest) are batched in one object.  The device-side metadata
that drives the kernels is built from it by :func:`jax_prefix_attn.tree_metadata.build_tree_metadata`.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["PrefixTree"]


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

