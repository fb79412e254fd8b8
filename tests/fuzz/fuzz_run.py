"""Runs the differential fuzz harness: every implementation of each case's family against the
float64 oracle, and a summary.

Compilations are reused: every implementation is one ``jax.jit`` function per shape bucket
(:mod:`fuzz_buckets`) whose arguments carry everything a case varies (values, lengths, groups,
draft parents: all traced), so ``N`` cases compile ``#buckets x #implementations`` programs.

Checks per (case, implementation): rows that must be NaN (a NaN query, or a NaN key or value
the row sees) have NaN in ``out`` and ``lse``; rows that may be NaN (a NaN value of the same kv
head the row does not see) are NaN in both or correct; every other row is finite, within the
dtype's tolerance of the oracle (relative error of ``out`` over those rows; float32 1e-5 with
``HIGHEST`` matmuls, 16-bit 2e-2), with ``lse = -inf`` and ``out = 0`` exactly where the row
sees no key.
"""
from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import fuzz_buckets
import fuzz_cases as fc
import jax_prefix_attn as jpa
from pallas_kernels._common import flag_nonfinite, merge_partials, merge_stacked

OUT_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
LSE_TOL = {"float32": 1e-4, "bfloat16": 2e-3, "float16": 2e-3}


# ----------------------------------------------------------------------------- implementations

@functools.lru_cache(maxsize=None)
def shared_impls(bk: fc.SharedBucket, platform: str) -> dict:
    """``shared_prefix_attention`` per ``impl``: the kernels in interpret mode on the CPU, the
    compiled default paths (``"auto"`` and both families) on the GPU."""
    names = ("reference", "shared", "flat") if platform == "cpu" else (
        "reference", "auto", "shared", "flat")

    def make(impl):
        def f(q, pk, pv, sk, sv, sl, pl, s2p):
            return jpa.shared_prefix_attention(
                q, pk, pv, sk, sv, suffix_lengths=sl, prefix_lengths=pl, seq_to_prefix=s2p,
                impl=impl, interpret=platform == "cpu" and impl != "reference", return_lse=True)
        return jax.jit(f)
    return {n: make(n) for n in names}


@functools.lru_cache(maxsize=None)
def attention_impls(bk: fc.AttnBucket, platform: str) -> dict:
    kernel = "flash" if platform == "cpu" else "auto"

    def make(impl):
        def f(q, k, v, lengths):
            return jpa.attention(q, k, v, causal=bk.causal, kv_lengths=lengths, impl=impl,
                                 interpret=platform == "cpu" and impl == "flash")
        return jax.jit(f)
    return {n: make(n) for n in ("reference", kernel)}


# tree implementation name -> tree_attention's (impl, interpret, platform) on each platform;
# "auto_gpu" in interpret mode runs the GPU's automatic choice (single-level, shallow, hybrid or
# a schedule) through the kernels in interpret mode, "mirror" the pure-JAX schedule mirror
TREE_IMPLS = {"cpu": {"reference": ("reference", False, "cpu"), "mirror": ("flatten", False, "cpu"),
                      "flatten": ("flatten", True, "cpu"), "levelwise": ("levelwise", True, "cpu"),
                      "nodes": ("nodes", True, "cpu"), "hybrid": ("hybrid", True, "cpu"),
                      "auto_gpu": ("auto", True, "gpu")},
              "gpu": {"reference": ("reference", False, "gpu"), "auto": ("auto", False, "gpu"),
                      "flatten": ("flatten", False, "gpu"), "levelwise": ("levelwise", False, "gpu"),
                      "nodes": ("nodes", False, "gpu"), "hybrid": ("hybrid", False, "gpu")}}


@functools.lru_cache(maxsize=None)
def tree_impls(bk: fc.TreeBucket, platform: str) -> dict:
    tree = fc.forest(bk.seed, bk.forest)

    def make(impl, interpret, plat):
        def f(q, kp, vp, sk, sv, sl, dp):
            return jpa.tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl,
                                      interpret=interpret, platform=plat, draft_parents=dp,
                                      return_lse=True)
        return jax.jit(f)
    return {n: make(*TREE_IMPLS[platform][n]) for n in bk.impls}


@functools.lru_cache(maxsize=None)
def merge_impls(bk: fc.MergeBucket, platform: str) -> dict:
    del platform
    lists = lambda o, l: jpa.merge_attention_states(list(o), list(l))  # noqa: E731
    def f32(fn):
        """A kernel-side merge as the entry points use it: float32 parts, and the LSE of rows
        whose NaN came from a part's ``o`` flagged once at the end (``flag_nonfinite``)."""
        def merged(o, l):
            out, lse = fn(o.astype(jnp.float32), l)
            return out, flag_nonfinite(out, lse)
        return merged
    return {"merge_list": jax.jit(lists), "merge_stacked": jax.jit(jpa.merge_attention_states),
            "xla_unrolled": jax.jit(f32(merge_partials)), "xla_reduce": jax.jit(f32(merge_stacked))}


IMPLS = {"shared": shared_impls, "attention": attention_impls, "tree": tree_impls,
         "merge": merge_impls}


# ----------------------------------------------------------------------------- checks

def check(out, lse, exp, dtype: str) -> dict:
    """Compare one implementation's ``(out, lse)`` with the oracle (see the module docstring)."""
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    nan_out = np.isnan(out).any(-1)
    nan_row = nan_out | np.isnan(lse)
    missing = exp.must_nan & ~(nan_out & np.isnan(lse))
    unexpected = nan_row & ~exp.may_nan
    inconsistent = nan_out & ~np.isnan(lse)
    rows = ~nan_row & ~exp.must_nan
    got, want = out[rows], exp.out[rows]
    nonfinite = int((~np.isfinite(got)).any(-1).sum())
    den = np.linalg.norm(want)
    err = np.linalg.norm(np.nan_to_num(got) - want)
    rel = float(err / den) if den > 0 else float(err)
    wl, gl = exp.lse[rows], lse[rows]
    empty = wl == -np.inf
    empty_bad = int((gl[empty] != -np.inf).sum() + (got[empty] != 0).any(-1).sum())
    fin = ~empty
    lse_bad = int(((~np.isfinite(gl[fin]))
                   | (np.abs(gl[fin] - wl[fin]) > LSE_TOL[dtype] * (1 + np.abs(wl[fin])))).sum())
    res = dict(rel=rel, missing_nan=int(missing.sum()), unexpected_nan=int(unexpected.sum()),
               inconsistent=int(inconsistent.sum()), nonfinite=nonfinite, lse_bad=lse_bad,
               empty_bad=empty_bad)
    res["mismatch"] = bool(rel >= OUT_TOL[dtype] or nonfinite or lse_bad or empty_bad
                           or inconsistent.any())
    return res


# ----------------------------------------------------------------------------- the run

def schedule(n_cases: int, platform: str, shard: tuple[int, int] = (0, 1)):
    """``[(case index, bucket)]``: families in the proportions of ``fuzz_buckets.SHARE``, buckets
    of a family round robin; of those, the cases ``i`` with ``i % n == k`` for ``shard = (k,
    n)`` (the shards of a run together hold its cases once each)."""
    by_family = fuzz_buckets.buckets(platform)
    pattern = [f for f, k in fuzz_buckets.SHARE for _ in range(k)]
    seen = collections.Counter()
    out = []
    for i in range(n_cases):
        fam = pattern[i % len(pattern)]
        lst = by_family[fam]
        if i % shard[1] == shard[0]:
            out.append((i, lst[seen[fam] % len(lst)]))
        seen[fam] += 1
    return out


def run(n_cases: int, platform: str = "cpu", seed: int = 0, log=None,
        shard: tuple[int, int] = (0, 1)) -> dict:
    """Run shard ``shard = (k, n)`` of ``n_cases`` seeded cases (:func:`schedule`); returns the
    summary (JSON-ready)."""
    t0 = time.time()
    stats = {}
    failures = []
    fam_cases, modes = collections.Counter(), collections.Counter()
    cases = schedule(n_cases, platform, shard)
    for i, bk in cases:
        rng = np.random.default_rng([seed, i])
        case = fc.DRAW[bk.family](rng, bk, fc.default_scale)
        fam_cases[bk.family] += 1
        modes[f"poison={case.notes['poison']}"] += 1
        modes["out_of_range"] += int(case.notes["oob"])
        for name, fn in IMPLS[bk.family](bk, platform).items():
            try:
                out, lse = fn(*case.args)
                res = check(out, lse, case.expected, bk.dtype)
            except Exception as e:  # noqa: BLE001 (an implementation that cannot run a case)
                res = dict(rel=float("inf"), mismatch=True, missing_nan=0, unexpected_nan=0,
                           error=f"{type(e).__name__}: {str(e)[:300]}")
            key = f"{bk.family}/{name}/{bk.dtype}"
            st = stats.setdefault(key, dict(checks=0, max_rel_err=0.0, mismatches=0,
                                            unexpected_nan=0, missing_nan=0))
            st["checks"] += 1
            st["max_rel_err"] = max(st["max_rel_err"], res["rel"])
            st["mismatches"] += int(res["mismatch"])
            st["unexpected_nan"] += res["unexpected_nan"]
            st["missing_nan"] += res["missing_nan"]
            if res["mismatch"] or res["unexpected_nan"] or res["missing_nan"]:
                failures.append(dict(case=i, impl=name, bucket=repr(bk), notes=case.notes, **res))
                if log:
                    log(f"FAIL case {i} {name} {bk} {case.notes} {res}")
    total = lambda k: sum(s[k] for s in stats.values())  # noqa: E731
    return dict(platform=platform, device=str(jax.devices()[0].device_kind),
                jax_version=jax.__version__, seed=seed, cases=len(cases), shard=list(shard),
                checks=total("checks"), families=dict(fam_cases), modes=dict(sorted(modes.items())),
                mismatches=total("mismatches"), unexpected_nan=total("unexpected_nan"),
                missing_nan=total("missing_nan"), wall_s=round(time.time() - t0, 1),
                impls=stats, failures=failures[:20])
