"""Batch-size buckets: a :class:`~models.prefix_sharing.PromptBatch` padded with inert rows so
that calls with nearby batch sizes run the same compiled functions, and so that the batch splits
evenly over a mesh's ``data`` axis.

* :func:`batch_bucket` -- a count rounded up to a power of two up to 8, to a multiple of 8 above
  (at most 2x rows for tiny batches, fewer than 8 extra rows beyond), then to a multiple of
  ``multiple``.
* :func:`pad_batch` -- the padded batch (:class:`PaddedBatch`) and, for every row, the real row
  it copies.

What is padded keeps the prefix tree valid: when every prefix level has one node (or there is
no level), rows are appended to the batch; otherwise the shallowest level with several nodes
(one node per prompt in :func:`~models.prefix_sharing.plan_prompt_batch`) gets extra nodes,
each a copy of node 0 with its descendants and rows, so every node keeps its number of
children.  A padded row copies a real row's tokens (row 0, or group 0's rows) and is meant to
get that row's sampling key: it then draws the same tokens and ends when that row ends, so the
fused decode loop, which runs until every row has ended, takes no extra step for it.  Its
results are dropped.  Real rows keep their indices ``0 .. rows - 1``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from models.prefix_sharing import PromptBatch

__all__ = ["PaddedBatch", "batch_bucket", "pad_batch"]

POW2_UP_TO = 8   # powers of two up to this count, multiples of it above


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def batch_bucket(n: int, multiple: int = 1, *, pow2_up_to: int = POW2_UP_TO) -> int:
    """``n`` rounded up to a power of two up to ``pow2_up_to`` (a power of two, default 8), to a
    multiple of it above, then to a multiple of ``multiple``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"multiple must be an int >= 1, got {multiple!r}")
    n = int(n)
    b = 1 << (n - 1).bit_length() if n <= pow2_up_to else _round_up(n, pow2_up_to)
    return _round_up(b, int(multiple))


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """``batch``: the padded batch (``batch.batch >= rows``); ``rows``: the real rows, first;
    ``source [batch.batch]``: the real row each row copies (``source[r] == r`` for real rows)."""
    batch: PromptBatch
    rows: int
    source: np.ndarray


def pad_batch(batch: PromptBatch, *, multiple: int = 1) -> PaddedBatch:
    """``batch`` padded to a bucketed size that is a multiple of ``multiple`` (the ``data``
    axis of a mesh) with copies of real rows (see module docstring)."""
    if not isinstance(batch, PromptBatch):
        raise TypeError(f"batch must be a PromptBatch, got {type(batch).__name__}")
    b = batch.batch
    if b < 1:
        raise ValueError("batch must hold at least one sequence, got 0")
    split = next((l for l, lv in enumerate(batch.levels) if len(lv) > 1), None)
    if split is None:   # rows hang from one node per level (or none): append rows
        extra = batch_bucket(b, multiple) - b
        source = np.concatenate([np.arange(b), np.zeros(extra, np.int64)])
        return PaddedBatch(batch=PromptBatch(levels=batch.levels, suffixes=batch.suffixes + batch.suffixes[:1] * extra),
                           rows=b, source=source)
    groups = len(batch.levels[split])
    per_group = b // groups
    extra = batch_bucket(groups, multiple // math.gcd(multiple, per_group)) - groups
    levels = tuple(lv if l < split else lv + lv[:len(lv) // groups] * extra for l, lv in enumerate(batch.levels))
    source = np.concatenate([np.arange(b), np.tile(np.arange(per_group), extra)])
    return PaddedBatch(batch=PromptBatch(levels=levels, suffixes=batch.suffixes + batch.suffixes[:per_group] * extra),
                       rows=b, source=source)
