"""Leaf ``flat_own``: flat decode in the queries' own layout.

One launch of ``suffix_decode_merge`` reads each sequence's prefix as a span of the prefix pool
(no copy) and its suffix, keys cut into ``num_splits`` chunks (+ one ``merge_splits`` launch
when split).  It reads q and writes out in their own layout (no 16-row padding), which pays
except where few programs each stream a long prefix chunk (``flat_rows`` there).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import cost_model
from jax_prefix_attn.device_profile import default_profile, planning_profile
from jax_prefix_attn.leaves.base import (Shapes, SuffixTiling, planning_part, suffix_tiling,
                                         supported, tuning, two_per_sm)
from pallas_kernels._common import cdiv, split_chunk
from pallas_kernels.merge_splits import merge_splits
from pallas_kernels.suffix_attention import suffix_decode_merge

__all__ = ["FlatOwn", "PATH", "FAMILY", "PLAN", "flat_tilings", "flat_own_leaf", "busy_splits",
           "flat_own_tiling", "flat_layout", "unsupported", "why_not", "build", "seconds", "run"]


@dataclasses.dataclass(frozen=True)
class FlatOwn:
    """Flat decode in the queries' own layout: ``suffix_decode_merge`` with the prefix as a pool
    span, keys cut into ``num_splits`` chunks (+ one XLA merge when split)."""
    num_splits: int
    tiling: SuffixTiling
    path = "flat_own"


PATH = "flat_own"
FAMILY = "flat"
PLAN = FlatOwn


@functools.cache
def _tiles(flat_tiles: tuple) -> tuple:
    """``((max_programs or None, SuffixTiling), ...)`` of a data file's ``flat_tiles``."""
    return tuple((bound, suffix_tiling(t)) for bound, t in flat_tiles)


def flat_tilings(dev) -> tuple:
    """``((max_programs or None, SuffixTiling), ...)``: the flat decode tilings of ``dev`` (its
    ``flat_tiles``), by program count, that :func:`flat_own_tiling` chooses among."""
    return _tiles(tuning(dev).flat_tiles)


def flat_own_leaf(s: Shapes, dev, *, min_split_keys: int | None = None,
                  max_splits: int | None | str = "tuned") -> FlatOwn:
    """The leaf plan: key splits enough for ``2 * SMs`` (sequence, kv head, split) programs, at
    least ``min_split_keys`` keys per split, at most ``max_splits`` (``None``: no cap); the
    :func:`flat_own_tiling` of its programs and keys per split.  Key splits when the (sequence,
    kv head) programs cannot fill the GPU; no key tile longer than a split; splits the kernel
    would leave without keys are dropped (:func:`busy_splits`).  By default the device's tuned
    ``flat_own_min_split_keys`` and ``flat_own_max_splits``; the keyword arguments let a tuning
    sweep (``bench/flat_decode_sweep.py``) evaluate other values."""
    t = tuning(dev)
    min_split_keys = t.flat_own_min_split_keys if min_split_keys is None else min_split_keys
    max_splits = t.flat_own_max_splits if max_splits == "tuned" else max_splits
    programs = s.batch * s.heads_kv
    n = 1
    if programs < two_per_sm(dev):
        n = min(cdiv(two_per_sm(dev), programs), cdiv(s.prefix_len + s.suffix_len, min_split_keys))
        n = max(1, n if max_splits is None else min(n, max_splits))
    tiling = flat_own_tiling(s, n, t.flat_tiles)
    while n > 1 and (used := busy_splits(s.prefix_len, s.suffix_len, n, tiling.block_k)) < n:
        n = used                       # (splits past the last key would run idle programs)
        tiling = flat_own_tiling(s, n, t.flat_tiles)
    return FlatOwn(num_splits=n, tiling=tiling)


def busy_splits(prefix_len: int, suffix_len: int, num_splits: int, block_k: int) -> int:
    """How many of ``num_splits`` key splits hold keys: the decode kernel cuts the prefix and the
    suffix separately into chunks of whole ``block_k`` tiles (``_common.split_chunk``), so the
    last splits can be empty when a split's share is not a whole number of tiles."""
    def used(n: int) -> int:
        return cdiv(n, split_chunk(n, num_splits, block_k)) if n else 0
    return max(1, used(prefix_len), used(suffix_len))


def flat_own_tiling(s: Shapes, num_splits: int, flat_tiles: tuple | None = None) -> SuffixTiling:
    """The tiling of ``flat_tiles`` (a data file's, by program count: up to each bound that
    tiling, ``None`` any count; default the planning device's) with ``num_splits`` key splits:
    the one for its ``B * Hkv * num_splits`` programs, or, where that tiling's key tile is
    longer than a split's keys (prefix and suffix), the tiling with the longest tile that fits
    one (a split shorter than one tile would leave the last splits without keys)."""
    table = _tiles(default_profile().tuning.flat_tiles if flat_tiles is None else flat_tiles)
    programs = s.batch * s.heads_kv * num_splits
    tiling = next(t for bound, t in table if bound is None or programs <= bound)
    split_keys = cdiv(s.prefix_len + s.suffix_len, num_splits)
    if num_splits == 1 or tiling.block_k <= split_keys:
        return tiling
    tiles = sorted((t for _, t in table), key=lambda t: t.block_k)
    shorter = [t for t in tiles if t.block_k <= split_keys]
    return shorter[-1] if shorter else tiles[0]


def flat_layout(s: Shapes, dev) -> str:
    """``"own"`` or ``"rows"`` for the flat decode (``Tq == 1``): the row layout where the own
    layout's programs (:func:`flat_own_leaf`) are few and each streams a long prefix chunk."""
    t = tuning(dev)
    n = flat_own_leaf(s, dev).num_splits
    programs = s.batch * s.heads_kv * n
    return ("rows" if programs <= t.flat_tiles[0][0]
            and cdiv(s.prefix_len, n) > t.flat_own_max_chunk else "own")


def unsupported(s: Shapes, dev, interpret: bool) -> str | None:
    why = supported(s)
    if why is None and s.tq != 1:
        why = f"flat_own decodes one query per sequence, got Tq={s.tq}"
    return why


def why_not(s: Shapes, dev, interpret: bool = False) -> str | None:
    why = unsupported(s, dev, interpret)
    if why is None and flat_layout(s, planning_part(dev)) != "own":
        why = (f"few programs each stream more than {tuning(dev).flat_own_max_chunk} prefix "
               f"keys: the row "
               f"layout (flat_rows) is faster there")
    return why


def build(s: Shapes, dev, interpret: bool) -> FlatOwn:
    return flat_own_leaf(s, dev)


def seconds(s: Shapes, dev, interpret: bool) -> float:
    return cost_model.flat_seconds(s, build(s, dev, interpret).num_splits,
                                   planning_profile(dev))


def run(leaf: FlatOwn, q, prefix_k, prefix_v, suffix_k, suffix_v, seq_to_prefix, lim_p, lim_s,
        *, scale, interpret, prefix_len_g):
    """Every sequence reads its prefix (through ``seq_to_prefix``, no copy) and its suffix in
    one launch (plus one merge launch of the key splits).  With one prefix the kernel takes the
    prefix length ``prefix_len_g [1]`` as it is."""
    b, _, hq, d = q.shape
    g, p, hkv, _ = prefix_k.shape
    # the prefix pool as one span per sequence: entry g's keys start at g * P (one prefix:
    # start 0 and its length, each one [1] array for every sequence: no [B] array to build)
    start = np.zeros((1,), np.int32) if g == 1 else seq_to_prefix.astype(jnp.int32) * p
    span_len = prefix_len_g if g == 1 and prefix_len_g is not None else lim_p[:, 0]
    span = (prefix_k.reshape(g * p, hkv, d), prefix_v.reshape(g * p, hkv, d), start, span_len)
    t = leaf.tiling
    o, lse = suffix_decode_merge(q[:, 0].astype(prefix_k.dtype), suffix_k, suffix_v, lim_s[:, 0],
                                 span=span, span_max=p, num_splits=leaf.num_splits, scale=scale,
                                 interpret=interpret, block_k=t.block_k, num_warps=t.num_warps,
                                 num_stages=t.num_stages)
    if leaf.num_splits > 1:   # one launch for the whole merge (latency-bound sizes)
        n = leaf.num_splits
        o, lse = merge_splits(o.reshape(n, b * hq, d), lse.reshape(n, b * hq), out_dtype=q.dtype,
                              interpret=interpret)
        o, lse = o.reshape(b, hq, d), lse.reshape(b, hq)
    return o.astype(q.dtype)[:, None], lse[:, None]
