"""Ratios, targets and the stated methodology of ``bench/peers.py`` results (no GPU needed).

* :data:`METHODOLOGY` -- how every column is timed, as stored in the result JSON;
* :func:`finish_point` -- a point's best FlashInfer columns and its ratios to ours and the floor;
* :func:`summarize` -- the targets over all points: at B >= 256, P >= 4K FlashInfer's cascade at
  least 3x ours; at every point ours within 5% of the faster of the cascade and paged decode;
  trees: the cascade at least 2x ours; the worst parity error.
"""
from __future__ import annotations

import statistics
import types

__all__ = ["METHODOLOGY", "finish_point", "summarize", "num", "TARGETS"]

METHODOLOGY = types.MappingProxyType({
    "ours": "bench.timing.loop_time: n dependent calls in one jitted fori_loop (each output perturbs the "
            "next query: q + 1e-3 * out), the loop body compiled as one CUDA graph "
            "(xla_gpu_graph_min_graph_size=1); n (16-2048, a compile-time constant) chosen from the "
            "point's floor for ~30 ms per timed call; median of 3 timed calls / n.  ours_auto_u8: the "
            "same with 8 dependent calls per loop iteration (one CUDA graph of 8 calls).",
    "flashinfer": "plan() outside the timed region; 3 eager warm-up calls on a side stream, then "
                  "torch.cuda.CUDAGraph capturing `calls` calls of wrapper.run(q, cache) (10-200, ~30 ms "
                  "per replay); median of 7 replays timed with CUDA events / calls.  The calls read the "
                  "same q (independent), as FlashInfer's own benchmarks do.",
    "harness_overheads": "jax_loop_identity_ms: the JAX loop with an identity body (loop iteration + the "
                         "query perturbation), per call, at small points (B <= 32, small GQA) and once per "
                         "run (runs[i].harness.jax_loop_identity, q [8, Hq, D]); jax_loop_identity_u8_ms: 8 "
                         "identity bodies per iteration, per body.  runs[i].harness.torch_graph_empty_kernel: "
                         "the CUDA-graph harness around one trivial kernel (a one-element add_), per call.",
    "data": "inputs made once in JAX (bf16 standard normal, seeded), handed to torch by DLPack (same "
            "bytes); FlashInfer's paged caches (NHD [pages, 2, page, Hkv, D]) gathered from the same "
            "arrays (bench/peers_paged.py): cascade level l = one request per tree node at depth l over "
            "its pages, last level = each sequence's suffix pages; paged decode = per sequence its "
            "shared full pages then its own pages (a partly filled shared page is copied per sequence).",
    "floor": "max(bytes / copy bandwidth, flops / bf16 matmul rate); bytes = every distinct key and value "
             "once + q + out, flops = 4 Hq D per (query, visible key); both rates measured in the run "
             "(runs[i].copy_bw_Bps, runs[i].matmul_flops; a point's `run` names its run).",
    "parity": "<fi column>_maxabs_vs_ours / _maxrel_vs_ours: max |FlashInfer - ours(auto)| over the "
              "output (relative to max |ours|); ours_auto_maxabs_vs_reference: ours against the library's "
              "pure-JAX reference where the point is small enough.",
})

TARGETS = types.MappingProxyType({"cascade_over_ours_large": 3.0, "ours_over_fi_best": 1.05,
                                  "tree_cascade_over_ours": 2.0})


def num(x):
    """``x`` if it is a measured time (a number), else None."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _best(rec, prefix):
    vals = [num(v) for k, v in rec.items() if k.startswith(prefix) and k.endswith("_ms") and "_best" not in k]
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def finish_point(rec: dict) -> dict:
    """Adds ``fi_cascade_best_ms``, ``fi_decode_best_ms``, ``fi_best_ms``, ``ours_best_ms`` (the
    faster of ``ours_auto`` and its unrolled loop), ``fi_cascade_over_ours``,
    ``fi_decode_over_ours``, ``ours_over_fi_best``, ``ours_best_over_fi_best``,
    ``ours_over_floor`` and ``status: "ok"``."""
    cas, dec = _best(rec, "fi_cascade_p"), _best(rec, "fi_decode_")
    rec["fi_cascade_best_ms"], rec["fi_decode_best_ms"] = cas, dec
    fis = [v for v in (cas, dec) if v is not None]
    rec["fi_best_ms"] = min(fis) if fis else None
    ours = num(rec.get("ours_auto_ms"))
    unrolled = [num(v) for k, v in rec.items() if k.startswith("ours_auto_u") and k.endswith("_ms")]
    both = [v for v in [ours] + unrolled if v is not None]
    rec["ours_best_ms"] = min(both) if both else None
    if ours is not None:
        if cas is not None:
            rec["fi_cascade_over_ours"] = cas / ours
        if dec is not None:
            rec["fi_decode_over_ours"] = dec / ours
        if fis:
            rec["ours_over_fi_best"] = ours / min(fis)
        rec["ours_over_floor"] = ours / rec["floor_ms"]
    if rec["ours_best_ms"] is not None and fis:
        rec["ours_best_over_fi_best"] = rec["ours_best_ms"] / min(fis)
    rec["status"] = "ok"
    return rec


def _label(r) -> str:
    if r["kind"] == "tree":
        return f"{r['name']} (Hq={r['heads_q']}/{r['heads_kv']}, B={r['batch']})"
    return f"Hq={r['heads_q']}/{r['heads_kv']} B={r['batch']} P={r['prefix']} S={r['suffix']}"


def summarize(doc: dict) -> dict:
    """The targets (see the module doc) over ``doc["results"]``; ``lines``: one text line each."""
    res = [r for r in doc.get("results", []) if r.get("status") == "ok"]
    out: dict = {"lines": []}
    lines = out["lines"]

    def worst(rows, key, fn):
        rows = [r for r in rows if num(r.get(key)) is not None]
        return (fn(rows, key=lambda r: r[key]), len(rows)) if rows else (None, 0)

    large = [r for r in res if r["kind"] == "single" and r["batch"] >= 256 and r["prefix"] >= 4096]
    w, n = worst(large, "fi_cascade_over_ours", min)
    if w is not None:
        met = w["fi_cascade_over_ours"] >= TARGETS["cascade_over_ours_large"]
        out["cascade_over_ours_large"] = {"min": w["fi_cascade_over_ours"], "at": w["key"], "points": n, "met": met}
        lines.append(f"B>=256, P>=4K: FlashInfer cascade / ours min {w['fi_cascade_over_ours']:.2f}x at {_label(w)} "
                     f"over {n} points (target >= {TARGETS['cascade_over_ours_large']}) -> {'MET' if met else 'NOT MET'}")
    for key, what in (("ours_over_fi_best", "ours (loop)"), ("ours_best_over_fi_best", "ours (best harness)")):
        w, n = worst(res, key, max)
        if w is not None:
            met = w[key] <= TARGETS["ours_over_fi_best"]
            out[key] = {"max": w[key], "at": w["key"], "points": n, "met": met,
                        "points_missing": [r["key"] for r in res if (num(r.get(key)) or 0) > TARGETS["ours_over_fi_best"]]}
            lines.append(f"every point: {what} / faster of FlashInfer cascade and decode, max {w[key]:.2f} at "
                         f"{_label(w)} over {n} points (target <= {TARGETS['ours_over_fi_best']}) -> "
                         f"{'MET' if met else 'NOT MET'}")
    w, n = worst([r for r in res if r["kind"] == "tree"], "fi_cascade_over_ours", min)
    if w is not None:
        met = w["fi_cascade_over_ours"] >= TARGETS["tree_cascade_over_ours"]
        out["tree_cascade_over_ours"] = {"min": w["fi_cascade_over_ours"], "at": w["key"], "points": n, "met": met}
        lines.append(f"trees: FlashInfer {w.get('fi_cascade_levels', '?')}-level cascade / ours min "
                     f"{w['fi_cascade_over_ours']:.2f}x at {_label(w)} (target >= {TARGETS['tree_cascade_over_ours']}) "
                     f"-> {'MET' if met else 'NOT MET'}")
    rel = [(v, k, r["key"]) for r in res for k, v in r.items() if k.endswith("_maxrel_vs_ours") and num(v) is not None]
    if rel:
        v, k, at = max(rel)
        out["parity_max_rel"] = {"value": v, "column": k[:-len("_maxrel_vs_ours")], "at": at}
        lines.append(f"parity: largest |FlashInfer - ours| / max|ours| = {v:.3g} ({k[:-len('_maxrel_vs_ours')]} at {at})")
    ident = [num(r.get("jax_loop_identity_ms")) for r in res if num(r.get("jax_loop_identity_ms")) is not None]
    if ident:
        out["jax_loop_identity_ms_median"] = statistics.median(ident)
        lines.append(f"harness: JAX loop with an identity body {1e3 * statistics.median(ident):.1f} us per call (median)")
    errs = sorted({k[:-len("_error")] for r in res for k in r if k.endswith("_error")})
    if errs:
        lines.append(f"columns with errors somewhere (see <col>_error): {', '.join(errs)}")
    return out
