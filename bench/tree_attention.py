"""Benchmark: tree attention (Hydragen hierarchical / DeFT-Flatten) on tree-shaped decoding.

Llama-3-8B attention heads (``Hq=32, Hkv=8, D=128``), bf16, one decode step (``Tq=1``).
Workloads:

* ``apps8`` / ``apps16``: few-shot root of 2400 tokens, 8 or 16 problems of 300-800 tokens,
  128 samples each, suffixes 0-512;
* ``fewshot_w{20,30,50}`` (DeFT): one 4000-token prompt, width 20/30/50, suffixes 0-400;
* ``spec_t{32,64,128,256}`` (DeFT speculative decoding, modelled as single-token leaves):
  prefix 4000-6000 tokens, ``t`` draft tokens each a one-token leaf with one query;
* ``tot`` (tree-of-thought): prompt 1500, 3 levels of branching 10, thoughts 100-300
  tokens, 1000 leaves, suffixes 0-64.

Columns (one run, same inputs): ``auto`` (``auto_path`` says which schedule it ran),
``hybrid`` (root through the shared-prefix kernel, shared inner nodes through the tree kernel,
exclusive nodes streamed with the suffix), ``levelwise``, ``flatten``, ``nodes`` (node-by-node
without chunking, the DeFT-Node analogue: one launch, one item per node), ``single_level``
(``shared_prefix_attention`` with the root as the shared prefix and the rest of every path
materialised into the per-sequence suffix; falls back to our tree kernel on a one-level tree
if that function fails), ``flat`` (every sequence's full context materialised, then our
split-KV suffix kernel: plain per-sequence decoding), and ``floor`` =
``max(distinct KV bytes / copy bandwidth, flops / matmul rate)`` with both rates measured in
the same run.  Materialisation is done before timing.  Every column's output is checked
against ``flat`` (bf16 tolerance).

Usage: ``python bench/tree_attention.py --out bench/results/tree_attention_h100.json [--quick]``
(a PNG with the same stem is written next to the JSON).

Timing: :func:`bench.timing.loop_time` (dependent calls inside one jitted loop, no per-call
dispatch).

Results: ``bench/results/tree_attention_h200.json`` (the device, versions and rates measured in
the run are recorded in the file; ``auto_path`` records which path ``auto`` took: the hybrid
schedule on APPS-like and tree-of-thought trees, the shallow path on speculative trees, the
shared-prefix path on one-level trees).  The hybrid schedule's launches timed apart:
``bench/tree_breakdown.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from jax_prefix_attn import (PrefixTree, auto_path, build_tree_metadata, shared_prefix_attention,  # noqa: E402
                             tree_attention)

HQ, HKV, D = 32, 8, 128
DT = jnp.bfloat16


def workloads(quick: bool, scale: float = 1.0):
    """Workload specs; ``scale < 1`` shrinks token counts and widths (CPU smoke runs only)."""
    rng = np.random.default_rng(0)
    out = []
    sc = lambda n: max(1, int(round(n * scale)))  # noqa: E731

    def apps(n_problems):
        probs = [sc(int(x)) for x in rng.integers(300, 801, n_problems)]
        return dict(name=f"apps{n_problems}", forest=[[sc(2400)] + probs], seqs_per_leaf=sc(128), smax=sc(512))

    def fewshot(w):
        return dict(name=f"fewshot_w{w}", forest=[sc(4000)], seqs_per_leaf=w, smax=sc(400))

    def spec(t):
        return dict(name=f"spec_t{t}", forest=[[sc(int(rng.integers(4000, 6001)))] + [1] * t], seqs_per_leaf=1,
                    smax=0)

    def tot():
        def lvl(depth):
            n = sc(int(rng.integers(100, 301)))
            return n if depth == 3 else [n] + [lvl(depth + 1) for _ in range(br)]
        br = max(2, sc(10))
        return dict(name="tot", forest=[[sc(1500)] + [lvl(1) for _ in range(br)]], seqs_per_leaf=1, smax=sc(64))

    if quick:
        return [apps(8), fewshot(30), spec(64), spec(256), tot()]
    return [apps(8), apps(16), fewshot(20), fewshot(50), spec(32), spec(64), spec(256), tot()]


def make_case(wl, seed=0):
    tree = PrefixTree.from_nested(wl["forest"], seqs_per_leaf=wl["seqs_per_leaf"])
    b = tree.num_seqs
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    n = tree.pool_extent
    q = jax.random.normal(ks[0], (b, 1, HQ, D), jnp.float32).astype(DT)
    kp = jax.random.normal(ks[1], (n, HKV, D), jnp.float32).astype(DT)
    vp = jax.random.normal(ks[2], (n, HKV, D), jnp.float32).astype(DT)
    smax = wl["smax"]
    sk = jax.random.normal(ks[3], (b, smax, HKV, D), jnp.float32).astype(DT)
    sv = jax.random.normal(ks[4], (b, smax, HKV, D), jnp.float32).astype(DT)
    sl = jnp.asarray(np.random.default_rng(seed).integers(0, smax + 1, b), jnp.int32)
    return tree, (q, kp, vp, sk, sv, sl)


def materialise(tree, kp, vp, sk, sv, sl, skip_root: bool):
    """Per-sequence contexts ``[B, L_max, Hkv, D]`` (path [minus root] then suffix)."""
    b = tree.num_seqs
    smax = sk.shape[1]
    paths = []
    for i in range(b):
        nodes = tree.path(i)[1:] if skip_root else tree.path(i)
        idx = [np.arange(tree.starts[u], tree.starts[u] + tree.lengths[u]) for u in nodes]
        paths.append(np.concatenate(idx) if idx else np.zeros((0,), np.int64))
    plen = np.array([p.shape[0] for p in paths], np.int32)
    lmax = int(plen.max()) + smax
    lmax = max(16, -(-lmax // 16) * 16)
    idx = np.zeros((b, lmax), np.int64)
    src_suffix = np.zeros((b, lmax), bool)
    sidx = np.zeros((b, lmax), np.int64)
    for i, p in enumerate(paths):
        idx[i, : p.shape[0]] = p
        src_suffix[i, p.shape[0]:] = True
        sidx[i, p.shape[0]:] = np.minimum(np.arange(lmax - p.shape[0]), max(smax - 1, 0))
    idx_j, sidx_j, src_j = jnp.asarray(idx), jnp.asarray(sidx), jnp.asarray(src_suffix)

    @jax.jit
    def build(kp, vp, sk, sv):
        kk = kp[idx_j]
        vv = vp[idx_j]
        if smax > 0:
            ks_ = jnp.take_along_axis(sk, sidx_j[:, :, None, None], axis=1)
            vs_ = jnp.take_along_axis(sv, sidx_j[:, :, None, None], axis=1)
            kk = jnp.where(src_j[..., None, None], ks_, kk)
            vv = jnp.where(src_j[..., None, None], vs_, vv)
        return kk, vv

    kk, vv = build(kp, vp, sk, sv)
    return kk, vv, jnp.asarray(plen) + sl


def floor_seconds(tree, sl, bw, rate):
    b = tree.num_seqs
    kv_tokens = sum(tree.lengths) + int(np.asarray(sl).sum())
    bytes_ = kv_tokens * HKV * D * 2 * 2 + 2 * b * HQ * D * 2
    ctx = np.asarray(tree.info["seq_path_len"]) + np.asarray(sl)
    flops = float(ctx.sum()) * HQ * D * 4
    return max(bytes_ / bw, flops / rate), bytes_, flops


def bench_workload(wl, bw, rate, iters, block_kv=128, max_block_m=128):
    tree, (q, kp, vp, sk, sv, sl) = make_case(wl)
    b = tree.num_seqs
    meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0], block_kv=block_kv,
                               max_block_m=max_block_m)
    rec = {"name": wl["name"], "batch": b, "nodes": tree.num_nodes, "tree_tokens": int(sum(tree.lengths)),
           "suffix_tokens": int(np.asarray(sl).sum()), "preferred": meta.preferred, "times_ms": {},
           "errors": {}, "max_abs_err_vs_flat": {}}
    fl, by, fp = floor_seconds(tree, sl, bw, rate)
    rec.update(floor_ms=fl * 1e3, floor_bytes=by, floor_flops=fp)
    outs = {}

    def tree_fn(impl):
        return lambda q, m, kp, vp, sk, sv, sl: tree_attention(q, m, kp, vp, sk, sv, suffix_lengths=sl, impl=impl)

    # flat: materialise full contexts, then a one-node (empty) tree -> pure suffix decode.
    try:
        fk, fv, flen = materialise(tree, kp, vp, sk, sv, sl, skip_root=False)
        empty = PrefixTree(parents=[-1], starts=[0], lengths=[0], leaf_of_seq=[0] * b)
        dummy = jnp.zeros((16, HKV, D), DT)
        fmeta = build_tree_metadata(empty, tq=1, group=HQ // HKV, pool_size=16)
        f = tree_fn("flatten")
        args = (fmeta, dummy, dummy, fk, fv, flen)
        outs["flat"] = jax.jit(f)(q, *args)
        rec["times_ms"]["flat"] = loop_time(f, q, args) * 1e3
        del fk, fv
    except Exception as e:  # noqa: BLE001
        rec["errors"]["flat"] = f"{type(e).__name__}: {e}"[:400]
    try:
        rec["auto_path"] = auto_path(meta, q, sk)
    except Exception as e:  # noqa: BLE001
        rec["errors"]["auto_path"] = f"{type(e).__name__}: {e}"[:400]
    for impl in ("auto", "hybrid", "levelwise", "flatten", "nodes"):
        try:
            f = tree_fn(impl)
            args = (meta, kp, vp, sk, sv, sl)
            outs[impl] = jax.jit(f)(q, *args)
            rec["times_ms"][impl] = loop_time(f, q, args) * 1e3
        except Exception as e:  # noqa: BLE001
            rec["errors"][impl] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
    # single level: root shared, rest of the path + suffix per sequence.
    try:
        rk, rv, rlen = materialise(tree, kp, vp, sk, sv, sl, skip_root=True)
        root = tree.path(0)[0]
        pk = kp[tree.starts[root]: tree.starts[root] + tree.lengths[root]][None]
        pv = vp[tree.starts[root]: tree.starts[root] + tree.lengths[root]][None]
        try:
            f = lambda q, pk, pv, rk, rv, rlen: shared_prefix_attention(  # noqa: E731
                q, pk, pv, rk, rv, suffix_lengths=rlen, impl="auto")
            args = (pk, pv, rk, rv, rlen)
            outs["single_level"] = jax.jit(f)(q, *args)
            rec["single_level_impl"] = "shared_prefix_attention(impl='auto')"
        except Exception as e:  # noqa: BLE001
            rec["errors"]["single_level_shared_prefix"] = f"{type(e).__name__}: {e}"[:400]
            one = PrefixTree(parents=[-1], starts=[int(tree.starts[root])], lengths=[int(tree.lengths[root])],
                             leaf_of_seq=[0] * b)
            m1 = build_tree_metadata(one, tq=1, group=HQ // HKV, pool_size=kp.shape[0])
            g = tree_fn("levelwise")
            f = lambda q, pk, pv, rk, rv, rlen: g(q, m1, kp, vp, rk, rv, rlen)  # noqa: E731
            args = (pk, pv, rk, rv, rlen)
            outs["single_level"] = jax.jit(f)(q, *args)
            rec["single_level_impl"] = "tree_attention on a one-level tree (fallback)"
        rec["times_ms"]["single_level"] = loop_time(f, q, args) * 1e3
        del rk, rv
    except Exception as e:  # noqa: BLE001
        rec["errors"]["single_level"] = f"{type(e).__name__}: {e}"[:400]
    if "flat" in outs:
        ref = np.asarray(outs["flat"], np.float32)
        for k_, o in outs.items():
            rec["max_abs_err_vs_flat"][k_] = float(np.max(np.abs(np.asarray(o, np.float32) - ref)))
    t = rec["times_ms"]
    if "auto" in t:
        if "single_level" in t:
            rec["auto_speedup_vs_single_level"] = t["single_level"] / t["auto"]
        if "flat" in t:
            rec["auto_speedup_vs_flat"] = t["flat"] / t["auto"]
        rec["auto_over_floor"] = t["auto"] / rec["floor_ms"]
    if "flatten" in t and "nodes" in t:
        rec["flatten_speedup_vs_nodes"] = t["nodes"] / t["flatten"]
    return rec


def sweep(wls, iters):
    """Time flatten / levelwise for a few (block_kv, max_block_m) on some workloads."""
    out = []
    for wl in wls:
        tree, (q, kp, vp, sk, sv, sl) = make_case(wl)
        for c, mm in ((64, 64), (64, 128), (128, 64), (128, 128)):
            meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0], block_kv=c,
                                       max_block_m=mm)
            for impl in ("flatten", "levelwise"):
                try:
                    f = lambda q, m, kp, vp, sk, sv, sl, impl=impl: tree_attention(  # noqa: E731
                        q, m, kp, vp, sk, sv, suffix_lengths=sl, impl=impl)
                    t = loop_time(f, q, (meta, kp, vp, sk, sv, sl), target_s=0.02) * 1e3
                except Exception as e:  # noqa: BLE001
                    t = f"{type(e).__name__}: {e}"[:200]
                rec = dict(workload=wl["name"], block_kv=c, max_block_m=mm, impl=impl, ms=t)
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    cols = ["auto", "hybrid", "levelwise", "flatten", "nodes", "single_level", "flat", "floor"]
    names = [r["name"] for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(names)), 4.5))
    width = 0.8 / len(cols)
    for i, c in enumerate(cols):
        vals = [(r["floor_ms"] if c == "floor" else r["times_ms"].get(c, np.nan)) for r in results]
        ax.bar(np.arange(len(names)) + (i - len(cols) / 2 + 0.5) * width, vals, width, label=c)
    ax.set_xticks(np.arange(len(names)), names, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_title(f"tree attention, Llama-3-8B heads bf16, {device_info()['device']}")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=20, help="unused (loop_time picks the trip count)")
    ap.add_argument("--sweep", action="store_true", help="also time a few block sizes first")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink workloads (CPU smoke test)")
    ap.add_argument("--block-kv", type=int, default=128)
    ap.add_argument("--max-block-m", type=int, default=128)
    a = ap.parse_args()
    t0 = time.time()
    small = a.scale < 1
    bw = measure_copy_bandwidth((1 << 24) if small else (1 << 30))
    rate = measure_matmul_rate(512 if small else 8192)
    res = {"device": device_info(), "copy_bandwidth_Bps": bw, "matmul_flops": rate,
           "heads": dict(hq=HQ, hkv=HKV, d=D, dtype="bfloat16", tq=1), "workloads": []}
    print(f"bw {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    res["block_kv"], res["max_block_m"] = a.block_kv, a.max_block_m
    if a.sweep:
        wls = {w["name"]: w for w in workloads(True, a.scale)}
        res["sweep"] = sweep([wls["apps8"], wls["spec_t256"], wls["tot"]], max(5, a.iters // 2))
    for wl in workloads(a.quick, a.scale):
        t1 = time.time()
        try:
            rec = bench_workload(wl, bw, rate, a.iters, a.block_kv, a.max_block_m)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rec = {"name": wl["name"], "fatal": f"{type(e).__name__}: {e}"[:400]}
        rec["bench_s"] = time.time() - t1
        res["workloads"].append(rec)
        print(json.dumps(rec), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    summary = {}
    for r in res["workloads"]:
        if "times_ms" not in r:
            continue
        e = {k: round(v, 3) for k, v in r.items() if k.endswith(("speedup_vs_single_level", "over_floor",
                                                                  "speedup_vs_nodes", "speedup_vs_flat"))}
        if r["name"].startswith(("apps", "tot")):
            e["target_auto_ge_1.5x_single_level"] = r.get("auto_speedup_vs_single_level", 0) >= 1.5
            e["target_auto_within_2x_floor"] = r.get("auto_over_floor", 1e9) <= 2.0
        if r["name"].startswith("spec"):
            e["target_flatten_ge_1.5x_nodes"] = r.get("flatten_speedup_vs_nodes", 0) >= 1.5
        summary[r["name"]] = e
    res["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)
    res["total_s"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot([r for r in res["workloads"] if "times_ms" in r], os.path.splitext(a.out)[0] + ".png")


if __name__ == "__main__":
    main()
