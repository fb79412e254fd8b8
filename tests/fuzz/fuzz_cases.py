"""Random cases of the differential fuzz harness: shape buckets and seeded draws.

A *bucket* fixes every static shape (so each implementation compiles once per bucket); a *case*
draws everything else inside it: values, lengths (0, 1, full, ragged, and, in out-of-range cases,
negative or past the capacity: traced values, expected to follow the clamp rule), prefix groups,
tree suffixes and draft trees, and NaN poisoning (one NaN in a query, or in a key or value at a
valid position: expected in exactly the rows that see it; NaN in every unused buffer region:
expected to have no effect).  Each draw returns the implementations' arguments and the float64
oracle's answer (:mod:`fuzz_oracle`) built from NumPy contexts.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

import fuzz_oracle as orc
from jax_prefix_attn import PrefixTree

POISONS = ("none", "none", "none", "unused", "unused", "q", "k", "v", "unused+k", "unused+v")


@dataclasses.dataclass(frozen=True)
class SharedBucket:
    """``shared_prefix_attention``: ``q [b, tq, hq, d]``, ``groups`` prefixes of ``p`` keys
    (``groups == 1``: the ``[P, Hkv, D]`` form), suffixes of capacity ``s``.
    ``prefix_tail_spills``: shapes the Mosaic GPU decode leaves may take (decoding, one prefix,
    16-bit; any GQA group: the two-launch leaf works on rows), whose documented
    exception lets NaN past the prefix length reach any row (as NaN, never a finite answer)."""
    b: int
    tq: int
    hq: int
    hkv: int
    d: int
    groups: int
    p: int
    s: int
    dtype: str
    prefix_tail_spills: bool = False
    family = "shared"


@dataclasses.dataclass(frozen=True)
class AttnBucket:
    """``attention``: ``q [b, tq, hq, d]``, ``k/v [b, tk, hkv, d]``, ``kv_lengths [b]``."""
    b: int
    tq: int
    tk: int
    hq: int
    hkv: int
    d: int
    causal: bool
    dtype: str
    family = "attention"


@dataclasses.dataclass(frozen=True)
class TreeBucket:
    """``tree_attention`` over a fixed random forest ``random_forest(seed, *forest)`` (n_trees,
    max_depth, max_branch, max_len, seqs_per_leaf), ``tq`` queries (a draft token tree when
    ``drafts``), suffixes of capacity ``s``; ``impls`` the implementations run on it (names of
    :func:`fuzz_run.tree_impls`)."""
    seed: int
    forest: tuple
    tq: int
    hq: int
    hkv: int
    d: int
    s: int
    dtype: str
    drafts: bool = False
    impls: tuple = ("reference", "flatten")
    family = "tree"


@dataclasses.dataclass(frozen=True)
class MergeBucket:
    """``merge_attention_states`` of ``n`` partial states ``[b, tq, hq, d]``."""
    n: int
    b: int
    tq: int
    hq: int
    d: int
    dtype: str
    family = "merge"


@dataclasses.dataclass
class Case:
    bucket: object
    args: tuple
    expected: orc.Expected
    notes: dict


def _values(rng, shape, dtype):
    """Standard normal values in ``dtype`` (NumPy; 16-bit through ml_dtypes, rounding to
    nearest even as XLA does)."""
    return rng.standard_normal(shape, np.float32).astype(dtype)


def _float64(arrays: dict) -> dict:
    """The oracle's copies of the (poisoned) inputs, converted once."""
    return {k: np.asarray(v, np.float64) for k, v in arrays.items()}


def _lengths(rng, n: int, cap: int, oob: bool):
    """``(raw, clamped)`` int32 lengths in ``[0, cap]``: 0, 1, full or ragged; with ``oob`` some
    raw values negative or past ``cap`` (the clamp rule maps them back)."""
    pick = rng.integers(0, 4, n)
    raw = np.where(pick == 0, 0, np.where(pick == 1, min(1, cap),
                                          np.where(pick == 2, cap, rng.integers(0, cap + 1, n))))
    if oob:
        hit = rng.random(n) < 0.5
        raw = np.where(hit & (rng.random(n) < 0.5), -rng.integers(1, 4, n), raw)
        raw = np.where(hit & (raw >= 0), cap + rng.integers(1, 6, n), raw)
    return raw.astype(np.int32), np.clip(raw, 0, cap).astype(np.int32)


def _poison(rng, mode: str, arrays: dict, unused: list, valid: list):
    """Apply poisoning mode ``mode`` in place: ``unused`` a list of ``(name, index)`` regions to
    fill with NaN; ``valid`` a list of ``(name, index)`` valid key positions (one is hit in a
    random kv head and element of ``k`` or ``v``); ``"q"`` hits one query element."""
    if "unused" in mode:
        for name, idx in unused:
            arrays[name][idx] = np.nan
            arrays[name.replace("k", "v", 1) if name.endswith("k") else name][idx] = np.nan
    kind = mode.split("+")[-1]
    if kind == "q":
        q = arrays["q"]
        arrays["q"][tuple(rng.integers(0, n) for n in q.shape)] = np.nan
    elif kind in ("k", "v") and valid:
        name, idx = valid[int(rng.integers(0, len(valid)))]
        arr = arrays[name if kind == "k" else name[:-1] + "v"]
        hkv, d = arr.shape[-2:]
        arr[idx + (int(rng.integers(0, hkv)), int(rng.integers(0, d)))] = np.nan


# ----------------------------------------------------------------------------- shared prefix

def draw_shared(rng, bk: SharedBucket, scale_of) -> Case:
    dt = jnp.dtype(bk.dtype)
    oob = rng.random() < 0.25
    mode = POISONS[int(rng.integers(0, len(POISONS)))]
    a = {"q": _values(rng, (bk.b, bk.tq, bk.hq, bk.d), dt),
         "pk": _values(rng, (bk.groups, bk.p, bk.hkv, bk.d), dt),
         "pv": _values(rng, (bk.groups, bk.p, bk.hkv, bk.d), dt),
         "sk": _values(rng, (bk.b, bk.s, bk.hkv, bk.d), dt),
         "sv": _values(rng, (bk.b, bk.s, bk.hkv, bk.d), dt)}
    sl_raw, sl = _lengths(rng, bk.b, bk.s, oob)
    pl_raw, pl = _lengths(rng, bk.groups, bk.p, oob)
    s2p_raw = rng.integers(0, bk.groups, bk.b).astype(np.int32)
    if oob and bk.groups > 1:
        s2p_raw = np.where(rng.random(bk.b) < 0.3, rng.integers(-2, bk.groups + 3, bk.b),
                           s2p_raw).astype(np.int32)
    s2p = np.clip(s2p_raw, 0, bk.groups - 1)
    used = set(int(x) for x in s2p)
    unused = [("pk", (g, slice(int(pl[g]), None))) for g in range(bk.groups)]
    unused += [("sk", (i, slice(int(sl[i]), None))) for i in range(bk.b)]
    valid = [("pk", (g, j)) for g in sorted(used) for j in range(int(pl[g]))]
    valid += [("sk", (i, j)) for i in range(bk.b) for j in range(int(sl[i]))]
    _poison(rng, mode, a, unused, valid)
    f = _float64(a)

    def context(i):   # [prefix[:pl]; suffix[:sl]], bottom-right causal
        g = s2p[i]
        k = np.concatenate([f["pk"][g, :pl[g]], f["sk"][i, :sl[i]]])
        v = np.concatenate([f["pv"][g, :pl[g]], f["sv"][i, :sl[i]]])
        return k, v, orc.causal_mask(bk.tq, k.shape[0])
    exp = orc.attend_batch(f["q"], context, scale_of(bk.d))
    if bk.prefix_tail_spills and "unused" in mode and pl.min() < bk.p:
        exp.may_nan[:] = True
    pk, pv = (a["pk"][0], a["pv"][0]) if bk.groups == 1 else (a["pk"], a["pv"])
    args = (a["q"], pk, pv, a["sk"], a["sv"], sl_raw, pl_raw, s2p_raw)
    return Case(bk, args, exp, dict(poison=mode, oob=oob))


# ----------------------------------------------------------------------------- attention

def draw_attention(rng, bk: AttnBucket, scale_of) -> Case:
    dt = jnp.dtype(bk.dtype)
    oob = rng.random() < 0.25
    mode = POISONS[int(rng.integers(0, len(POISONS)))]
    a = {"q": _values(rng, (bk.b, bk.tq, bk.hq, bk.d), dt),
         "k": _values(rng, (bk.b, bk.tk, bk.hkv, bk.d), dt),
         "v": _values(rng, (bk.b, bk.tk, bk.hkv, bk.d), dt)}
    raw, ln = _lengths(rng, bk.b, bk.tk, oob)
    unused = [("k", (i, slice(int(ln[i]), None))) for i in range(bk.b)]
    valid = [("k", (i, j)) for i in range(bk.b) for j in range(int(ln[i]))]
    _poison(rng, mode, a, unused, valid)
    f = _float64(a)

    def context(i):
        n = int(ln[i])
        mask = orc.causal_mask(bk.tq, n) if bk.causal else np.ones((bk.tq, n), bool)
        return f["k"][i, :n], f["v"][i, :n], mask
    exp = orc.attend_batch(f["q"], context, scale_of(bk.d))
    return Case(bk, (a["q"], a["k"], a["v"], raw), exp, dict(poison=mode, oob=oob))


# ----------------------------------------------------------------------------- tree

@functools.lru_cache(maxsize=None)
def forest(seed: int, params: tuple) -> PrefixTree:
    """The bucket's random forest (parents shuffled, sequences on leaves and inner nodes)."""
    from helpers import random_forest
    n_trees, depth, branch, max_len, per_leaf = params
    return random_forest(np.random.default_rng(seed), n_trees, depth, branch, max_len,
                         seqs_per_leaf=per_leaf)


def _draft_parents(rng, b: int, tq: int, oob: bool):
    """``(raw [B, Tq], clamped)``: parent of draft ``t`` in ``[-1, t - 1]``."""
    t = np.arange(tq)[None, :]
    dp = np.floor(rng.random((b, tq)) * (t + 1)).astype(np.int32) - 1
    raw = dp.copy()
    if oob:
        raw = np.where(rng.random((b, tq)) < 0.2, raw + rng.integers(-3, 4, (b, tq)), raw)
    return raw.astype(np.int32), np.clip(raw, -1, t - 1).astype(np.int32)


def _ancestors(parents_t: np.ndarray) -> np.ndarray:
    """``anc [Tq, Tq]``: ``anc[t, u]`` iff draft ``u`` is ``t`` or an ancestor of it."""
    tq = parents_t.shape[0]
    anc = np.eye(tq, dtype=bool)
    for t in range(tq):
        p = parents_t[t]
        if p >= 0:
            anc[t] |= anc[p]
    return anc


def draw_tree(rng, bk: TreeBucket, scale_of) -> Case:
    tree = forest(bk.seed, bk.forest)
    dt = jnp.dtype(bk.dtype)
    oob = rng.random() < 0.25
    mode = POISONS[int(rng.integers(0, len(POISONS)))]
    b = tree.num_seqs
    n = tree.pool_extent + 5
    a = {"q": _values(rng, (b, bk.tq, bk.hq, bk.d), dt),
         "pk": _values(rng, (n, bk.hkv, bk.d), dt), "pv": _values(rng, (n, bk.hkv, bk.d), dt),
         "sk": _values(rng, (b, bk.s, bk.hkv, bk.d), dt),
         "sv": _values(rng, (b, bk.s, bk.hkv, bk.d), dt)}
    raw, sl = _lengths(rng, b, bk.s, oob)
    dp_raw = dp = None
    if bk.drafts:   # the drafts are the last Tq suffix tokens: lengths clamp to [Tq, S]
        sl = np.clip(raw, bk.tq, bk.s).astype(np.int32)
        raw = raw if oob else sl
        dp_raw, dp = _draft_parents(rng, b, bk.tq, oob)
    used = np.zeros(n, bool)
    for st, ln in zip(tree.starts, tree.lengths):
        used[st:st + ln] = True
    unused = [("pk", (np.nonzero(~used)[0],))] + [("sk", (i, slice(int(sl[i]), None)))
                                                  for i in range(b)]
    valid = [("pk", (int(j),)) for j in np.nonzero(used)[0]]
    valid += [("sk", (i, j)) for i in range(b) for j in range(int(sl[i]))]
    _poison(rng, mode, a, unused, valid)
    f = _float64(a)

    def context(i):   # [path spans; suffix[:sl]]: causal, or the draft tree's ancestors
        idx = tree.path_token_indices(i)
        k = np.concatenate([f["pk"][idx], f["sk"][i, :sl[i]]])
        v = np.concatenate([f["pv"][idx], f["sv"][i, :sl[i]]])
        if dp is None:
            return k, v, orc.causal_mask(bk.tq, k.shape[0])
        first = k.shape[0] - bk.tq
        m = np.zeros((bk.tq, k.shape[0]), bool)
        m[:, :first] = True
        m[:, first:] = _ancestors(dp[i])
        return k, v, m
    exp = orc.attend_batch(f["q"], context, scale_of(bk.d))
    args = (a["q"], a["pk"], a["pv"], a["sk"], a["sv"], raw, dp_raw)
    return Case(bk, args, exp, dict(poison=mode, oob=oob))


# ----------------------------------------------------------------------------- merge

def draw_merge(rng, bk: MergeBucket, scale_of) -> Case:
    del scale_of
    dt = jnp.dtype(bk.dtype)
    shape = (bk.n, bk.b, bk.tq, bk.hq)
    outs = _values(rng, shape + (bk.d,), dt)
    lses = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    lses[rng.random(shape) < 0.3] = -np.inf                          # empty parts
    lses[:, 0, 0, 0] = -np.inf                                       # a row with no part at all
    mode = ("none", "none", "lse", "live_out", "empty_out")[int(rng.integers(0, 5))]
    pos = tuple(int(rng.integers(0, x)) for x in shape)
    if mode == "lse":
        lses[pos] = np.nan
    elif mode in ("live_out", "empty_out"):
        lses[pos] = -np.inf if mode == "empty_out" else 0.5
        outs[pos + (int(rng.integers(0, bk.d)),)] = np.nan
    out, lse, must = orc.merge(np.asarray(outs, np.float64), lses)
    exp = orc.Expected(out, lse, must, must.copy())
    return Case(bk, (outs, lses), exp, dict(poison=mode, oob=False))


DRAW = {"shared": draw_shared, "attention": draw_attention, "tree": draw_tree,
        "merge": draw_merge}


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
