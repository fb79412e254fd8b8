"""Device metadata of a :class:`PrefixTree`: the padded int32 tables that drive tree attention.

:func:`build_tree_metadata` turns a tree into a :class:`TreeMetadata`: static-shaped, padded
int32 arrays (a registered pytree; numpy on the host, device arrays once passed to a jitted
function), so a decode step under ``jax.jit`` does no host work and growing suffixes never need
a rebuild.  It holds the schedules of :mod:`jax_prefix_attn.tree_schedule` over the same tree:
``flatten`` (DeFT-Flatten), ``levels`` (Hydragen hierarchical: one node schedule per depth),
``nodes`` (every node one item, one launch), the hybrid decode schedule's pieces, the tables of
the single-level and shallow paths, and the modelled times of the schedules
(:mod:`jax_prefix_attn.tree_cost`) with the planner's choice among them
(:func:`jax_prefix_attn.tree_plan.choose_schedules`).

Padding buckets (metadata of trees whose bucketed sizes agree has identical shapes and static
fields, so they share one compilation): items per schedule, chunks and parts per row are
powers of two; ``block_rows`` is a power of two chosen from the largest row count of a
chunk/node; ``max_tiles`` of node schedules a power of two; roots are padded by
:func:`root_bucket`.  The remaining shapes (``B * Tq`` query rows) are fixed by the query shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Mapping

import jax
import numpy as np

from jax_prefix_attn.device import planning_device_info
from jax_prefix_attn.device_profile import DeviceProfile, planning_profile
from jax_prefix_attn.prefix_tree import PrefixTree
from jax_prefix_attn.tree_cost import exclusive_spans_cost, root_launch_cost, schedule_cost
from jax_prefix_attn.tree_plan import ScheduleCosts, choose_schedules
from jax_prefix_attn.tree_schedule import Schedule, flatten_schedule, next_pow2, node_schedule
from pallas_kernels._common import kernel_group

__all__ = ["TreeMetadata", "build_tree_metadata", "root_bucket", "SHALLOW_MAX_TOKENS", "HYBRID_MID_TILING"]

# A tree whose sequences have at most this many path tokens below their root is "shallow"
# (speculative-decoding token trees, short branches): ``tree_attention(impl="auto")`` then runs
# the roots through the shared-prefix path and gathers those few tokens per sequence.
SHALLOW_MAX_TOKENS = 64

# Tiling of the hybrid schedule's tree-kernel launch (``mid``): 64-token key tiles and row blocks
# of at most 64 query vectors (16 sequences at Hq / Hkv = 4).
HYBRID_MID_TILING = types.MappingProxyType(dict(block_kv=64, max_block_m=64))


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
    ``costs`` (:class:`~jax_prefix_attn.tree_plan.ScheduleCosts`, host only): the modelled times
    behind ``preferred`` and ``hybrid``, for the plan's reason; not pytree data (like
    ``Schedule.stats``), so device metadata has ``None``.
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
    costs: Any = None

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


@functools.lru_cache(maxsize=64)
def _build_cached(tree: PrefixTree, tq: int, group: int, pool_size: int, block_kv: int,
                  max_block_m: int, chunks_per_item: int | None, mid_tiling: tuple,
                  mid_mode: str | None, sm_count: int, profile: DeviceProfile) -> TreeMetadata:
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
    flat = flatten_schedule(tree, info, sorted_keys, tq, group, block_kv, max_block_m, pool_size,
                            sorted_rows_real, n_rows, chunks_per_item=chunks_per_item)
    all_nodes = info["dfs_order"]
    nodes = node_schedule(all_nodes, tree, info, seq_lo, seq_hi, tq, group, block_kv, max_block_m,
                          sorted_rows_real, n_rows)
    levels = []
    depth = info["depth"]
    for d in range(int(depth.max()) + 1):
        at = np.asarray([u for u in all_nodes if depth[u] == d], np.int64)
        if not any(tree.lengths[u] > 0 for u in at):
            continue
        levels.append(node_schedule(at, tree, info, seq_lo, seq_hi, tq, group, block_kv, max_block_m,
                                    sorted_rows_real, n_rows))
    hyb = hybrid_parts(tree, info, seq_lo, seq_hi, sorted_keys, tq, group, block_kv, max_block_m, pool_size,
                       sorted_rows_real, n_rows, chunks_per_item, mid_tiling, mid_mode, sm_count, profile)
    max_br = max([flat.block_rows, nodes.block_rows] + [lv.block_rows for lv in levels]
                 + ([hyb["mid"].block_rows] if hyb["mid"] is not None else []))
    r_pad = n_rows + max_br
    sorted_rows = np.full((r_pad,), n_rows, np.int32)
    sorted_rows[:n_rows] = sorted_rows_real
    row_key = np.full((r_pad,), -1, np.int32)
    row_key[:n_rows] = np.repeat(sorted_keys, tq)
    costs = ScheduleCosts(flatten=schedule_cost(flat, group=group, sm_count=sm_count, profile=profile),
                          levelwise=sum(schedule_cost(lv, group=group, sm_count=sm_count, profile=profile)
                                        for lv in levels),
                          hybrid=hyb["cost"])
    preferred, hybrid = choose_schedules(costs)
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
                        hybrid_root=hyb["root"], spans_overlap=tree.spans_overlap, costs=costs)




def hybrid_parts(tree: PrefixTree, info: dict, seq_lo, seq_hi, sorted_keys, tq: int, group: int, block_kv: int,
                 max_m: int, pool_size: int, sorted_rows: np.ndarray, n_rows: int, chunks_per_item,
                 mid_tiling: tuple, mid_mode: str | None, sm_count: int, profile: DeviceProfile) -> dict:
    """Hybrid decode schedule (see :class:`TreeMetadata`): ``excl_span``, ``mid``, ``root`` and its
    estimated ``cost`` (same units as :func:`schedule_cost`; the exclusive spans are streamed by
    the suffix launch that runs anyway, so they only add their bytes; ``sm_count`` SMs and
    ``profile``'s tree rates).  Only for ``tq == 1``.
    ``mid_tiling`` (``(key, value)`` pairs) overrides :data:`HYBRID_MID_TILING`; ``mid_mode``
    (``"node"`` / ``"flatten"``) forces the ``mid`` schedule's mode instead of the cheaper one."""
    none = dict(excl_span=None, mid=None, root=False, cost=math.inf)
    if tq != 1:
        return none
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
    tiling = {**HYBRID_MID_TILING, **dict(mid_tiling)}
    block_kv = min(block_kv, tiling["block_kv"])
    max_m = max(min(max_m, tiling["max_block_m"]), 16)
    if keep.any():
        cands = [node_schedule(np.nonzero(keep)[0], tree, info, seq_lo, seq_hi, tq, group, block_kv, max_m,
                               sorted_rows, n_rows),
                 flatten_schedule(tree, info, sorted_keys, tq, group, block_kv, max_m, pool_size, sorted_rows,
                                  n_rows, chunks_per_item=chunks_per_item, keep=keep)]
        costs = [schedule_cost(c, group=group, sm_count=sm_count, profile=profile) for c in cands]
        pick = int(np.argmin(costs)) if mid_mode is None else ("node", "flatten").index(mid_mode)
        mid = cands[pick]
        cost += costs[pick]
    if root:
        cost += root_launch_cost(int(ln[roots[0]]), b, group, profile=profile)
    cost += exclusive_spans_cost(int(excl_span[:, 1].sum()), int(excl_span[:, 1].max()), profile=profile)
    return dict(excl_span=excl_span, mid=mid, root=root, cost=cost)


def root_bucket(n: int) -> int:
    """Padded root length (static; bounds recompilation): a power of two up to 1024, above that
    the next multiple of a sixteenth of the next power of two (at most 12.5% padding, eight
    buckets per octave, always a multiple of 128, the Mosaic GPU prefix kernel's tile)."""
    p2 = next_pow2(max(16, n))
    if p2 <= 1024:
        return p2
    step = p2 // 16
    return -(-n // step) * step


def build_tree_metadata(tree: PrefixTree, *, tq: int, group: int, pool_size: int, block_kv: int = 128,
                        max_block_m: int = 128, chunks_per_item: int | None = None,
                        mid_tiling: Mapping[str, int] | None = None, mid_mode: str | None = None,
                        device: bool = True) -> TreeMetadata:
    """Build (once per tree shape; cached) the device metadata of ``tree``.  Its schedules are
    costed (:mod:`jax_prefix_attn.tree_cost`) for the planning device
    (:func:`jax_prefix_attn.device.planning_device_info`): its SM count and its profile
    (:func:`jax_prefix_attn.device_profile.planning_profile`).

    Args:
      tree: the forest.
      tq: query tokens per sequence (``q.shape[1]``).
      group: query heads per kv head (``Hq // Hkv``).  The metadata is built for the kernels'
        group, the next power of two (``meta.group``; :func:`jax_prefix_attn.tree_attention`
        pads each kv head's query heads with zero dummy heads to it and drops their outputs).
      pool_size: number of tokens in ``k_pool`` (chunk windows are clamped inside it).
      block_kv: tokens per chunk / tile (power of two >= 16; DeFT uses 128).
      max_block_m: largest query-vector block (``block_rows * group``) per item.
      chunks_per_item: consecutive chunks (same rows, adjacent windows) one flatten item may
        process; ``None`` picks the largest of 8/4/2/1 that leaves >= 64 items.
      mid_tiling: ``block_kv`` / ``max_block_m`` caps of the hybrid schedule's tree-kernel
        launch (default :data:`HYBRID_MID_TILING`).
      mid_mode: ``"node"`` or ``"flatten"`` forces the mode of that launch (default: the one
        the cost model prefers).
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
    if mid_mode not in (None, "node", "flatten"):
        raise ValueError(f"mid_mode must be None, 'node' or 'flatten', got {mid_mode!r}")
    mid = tuple(sorted((str(k), int(v)) for k, v in (mid_tiling or {}).items()))
    if any(k not in HYBRID_MID_TILING for k, _ in mid):
        raise ValueError(f"mid_tiling keys must be in {tuple(HYBRID_MID_TILING)}, got {dict(mid)}")
    dev = planning_device_info()
    meta = _build_cached(tree, int(tq), kernel_group(int(group)), int(pool_size), int(block_kv), int(max_block_m),
                         None if chunks_per_item is None else int(chunks_per_item), mid, mid_mode,
                         dev.sm_count, planning_profile(dev))
    # Device arrays: passing host (numpy) metadata to a jitted step would copy it every call.
    return jax.device_put(meta) if device else meta
