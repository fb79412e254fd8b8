"""The points of ``bench/peers.py``: their specs, run order, inputs and floor.

A point is a dict: ``kind`` ``"single"`` (one shared prefix of ``prefix`` keys, every suffix
full at ``suffix`` keys) or ``"tree"`` (a forest ``forest`` of node lengths, ``seqs_per_leaf``
sequences per leaf, suffixes of seeded random lengths in ``[1, suffix]``), ``heads_q``,
``heads_kv``, ``head_dim``, ``tags`` (``probe``, ``grid``, ``small_batch``, ``small_gqa``,
``two_level``) and a unique ``key``.

Sets (``--quick`` / the full grid):

* probes: the three probe points of ``bench/shared_prefix.py`` (Hq=32/Hkv=8, suffix 128);
* small batch: B in {1, 8, 16, 32} x P in {1K, 4K, 16K}, suffix 64, both head shapes (quick:
  Hq=32/Hkv=8, P in {1K, 4K});
* small GQA: Hq=8/Hkv=1, B=8, P=4000 (no multiple of any tile), suffixes 1, 64, 256, 1024
  (quick: 1 and 64);
* grid: the Hydragen grid of ``bench/shared_prefix.py`` (B 16-1024 x P 1K-16K x S 64-1K, both
  head shapes; full only);
* trees: ``apps8`` / ``apps16`` / ``tot`` / ``spec_t64`` of ``bench/tree_attention.py``
  (Hq=32/Hkv=8) and the two-level shape of ``bench/two_level.py`` (root 2400, 3 or 7 problems of
  300-800 tokens, 128 samples each, suffixes up to 512; CodeLlama-7B heads 32/32) against
  FlashInfer's cascade of one level per tree depth plus the suffix level (quick: ``apps8`` and
  ``two_level_p3``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import shared_prefix as sp
from bench import tree_attention as ta
from bench.peers_paged import single_prefix_tree
from jax_prefix_attn import PrefixTree

__all__ = ["plan_points", "make_inputs", "tree_of", "floor_of", "SMALL_BATCH", "SMALL_PREFIX"]

SMALL_BATCH = (1, 8, 16, 32)
SMALL_PREFIX = (1024, 4096, 16384)
SMALL_SUFFIX = 64
SMALL_GQA_SUFFIX = (1, 64, 256, 1024)
TREES_GQA = ("apps8", "apps16", "tot", "spec_t64")
TWO_LEVEL = dict(root=2400, problem_len=(300, 800), samples=128, suffix=512, heads=(32, 32, 128))


def _single(hq, hkv, d, b, p, s, tag):
    return dict(kind="single", heads_q=hq, heads_kv=hkv, head_dim=d, batch=b, prefix=p, suffix=s,
                tags=[tag], key=f"single:hq{hq}:hkv{hkv}:d{d}:b{b}:p{p}:s{s}")


def _tree(name, forest, seqs_per_leaf, smax, heads, tag):
    hq, hkv, d = heads
    return dict(kind="tree", name=name, forest=forest, seqs_per_leaf=seqs_per_leaf, suffix=smax,
                heads_q=hq, heads_kv=hkv, head_dim=d, tags=[tag], key=f"tree:{name}:hq{hq}:hkv{hkv}")


def _two_level(problems, scale):
    rng = np.random.default_rng(0)
    lo, hi = TWO_LEVEL["problem_len"]
    sc = lambda n: max(1, int(round(n * scale)))  # noqa: E731
    lens = [sc(int(x)) for x in rng.integers(lo, hi + 1, problems)]
    return ([[sc(TWO_LEVEL["root"])] + lens], sc(TWO_LEVEL["samples"]), sc(TWO_LEVEL["suffix"]))


def plan_points(quick: bool, smoke: bool = False) -> list[dict]:
    """The points in run order (deduplicated by key; a point in several sets carries every tag)."""
    pts = []
    if smoke:
        pts += [_single(4, 2, 16, 2, 32, 16, "probe"), _single(4, 1, 16, 3, 40, 5, "small_gqa")]
        forest, spl, smax = _two_level(2, 0.02)
        pts.append(_tree("two_level_p2", forest, spl, smax, (4, 4, 16), "two_level"))
        return pts
    hq0, hkv0, d0 = sp.HEADS[0]
    pts += [_single(hq0, hkv0, d0, b, p, s, "probe") for (b, p, s) in sp.PROBES]
    wls = {w["name"]: w for w in ta.workloads(False)}
    trees = ["apps8"] if quick else list(TREES_GQA)
    pts += [_tree(n, wls[n]["forest"], wls[n]["seqs_per_leaf"], wls[n]["smax"], (ta.HQ, ta.HKV, ta.D), "tree")
            for n in trees]
    for problems in ((3,) if quick else (3, 7)):
        forest, spl, smax = _two_level(problems, 1.0)
        pts.append(_tree(f"two_level_p{problems}", forest, spl, smax, TWO_LEVEL["heads"], "two_level"))
    heads = [sp.HEADS[0]] if quick else list(sp.HEADS)
    prefixes = SMALL_PREFIX[:2] if quick else SMALL_PREFIX
    pts += [_single(hq, hkv, d, b, p, SMALL_SUFFIX, "small_batch")
            for (hq, hkv, d) in heads for p in prefixes for b in SMALL_BATCH]
    ghq, ghkv, gd = sp.SMALL_GQA_HEADS
    pts += [_single(ghq, ghkv, gd, 8, 4000, s, "small_gqa")
            for s in (SMALL_GQA_SUFFIX[:2] if quick else SMALL_GQA_SUFFIX)]
    if not quick:
        grid = [_single(hq, hkv, d, b, p, s, "grid") for (hq, hkv, d) in sp.HEADS for b in sp.BATCH
                for p in sp.PREFIX for s in sp.SUFFIX]
        grid.sort(key=lambda x: (-(x["batch"] >= 256 and x["prefix"] >= 4096), x["heads_q"] != 32,
                                 -x["batch"], -x["prefix"], x["suffix"]))
        pts += grid
    out, seen = [], {}
    for p in pts:
        if p["key"] in seen:
            seen[p["key"]]["tags"] += [t for t in p["tags"] if t not in seen[p["key"]]["tags"]]
            continue
        seen[p["key"]] = p
        out.append(p)
    return out


def tree_of(point) -> PrefixTree:
    """The point's forest (a single prefix is a one-node tree at pool offset 0)."""
    if point["kind"] == "single":
        return single_prefix_tree(point["prefix"], point["batch"])
    return PrefixTree.from_nested(point["forest"], seqs_per_leaf=point["seqs_per_leaf"])


def suffix_lengths(point, tree) -> np.ndarray:
    """Host suffix lengths ``[B]``: full for single-prefix points, seeded in ``[1, S]`` for trees."""
    b, s = tree.num_seqs, point["suffix"]
    if point["kind"] == "single":
        return np.full(b, s, np.int64)
    if s == 0:
        return np.zeros(b, np.int64)
    return np.random.default_rng(1).integers(1, s + 1, b).astype(np.int64)


def make_inputs(point, seed: int = 0, *, host: bool = False):
    """``(tree, sl_host, q [B, Hq, D], pool_k, pool_v [N, Hkv, D], suffix_k, suffix_v
    [B, S, Hkv, D], sl [B] int32)``, bf16 standard normal (the same values for a given point
    and seed, so a point measured in two passes reads the same data).  ``host``: drawn with
    numpy (tiny CPU runs: no compile per shape)."""
    tree = tree_of(point)
    hq, hkv, d = point["heads_q"], point["heads_kv"], point["head_dim"]
    b, s = tree.num_seqs, point["suffix"]
    n = tree.pool_extent
    shapes = ((b, hq, d), (n, hkv, d), (n, hkv, d), (b, s, hkv, d), (b, s, hkv, d))
    if host:
        rng = np.random.default_rng(seed)
        arrays = [jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16) for shape in shapes]
    else:
        keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
        arrays = [jax.random.normal(k, shape, jnp.bfloat16) for k, shape in zip(keys, shapes)]
    sl = suffix_lengths(point, tree)
    arrays = jax.block_until_ready(arrays + [jnp.asarray(sl, jnp.int32)])   # JAX idle before torch runs
    return (tree, sl, *arrays)


def floor_of(point, tree, sl, bw: float, mma: float, itemsize: int = 2) -> dict:
    """``max(bytes / bw, flops / mma)`` with bytes = every distinct key and value once (nodes +
    suffixes) + q and out, flops = ``4 Hq D`` per (query, visible key); for a single prefix the
    floor of ``bench/shared_prefix.py``."""
    hq, hkv, d = point["heads_q"], point["heads_kv"], point["head_dim"]
    b = tree.num_seqs
    kv_tokens = int(sum(tree.lengths)) + int(np.sum(sl))
    nbytes = kv_tokens * 2 * hkv * d * itemsize + 2 * b * hq * d * itemsize
    ctx = np.asarray(tree.info["seq_path_len"], np.int64) + np.asarray(sl, np.int64)
    flops = 4.0 * hq * d * float(ctx.sum())
    return {"floor_ms": max(nbytes / bw, flops / mma) * 1e3, "bytes": nbytes, "flops": flops,
            "batch": b, "kv_tokens": kv_tokens}
