"""Tables, plots and target ratios of the end-to-end benchmarks, from their JSON alone (no GPU).

Reads ``bench/results/{e2e_decode,long_document,two_level}_<gpu>.json`` and

* writes ``bench/plots/*.png`` (matplotlib, Agg backend): throughput vs batch at prefix 2K and
  throughput vs prefix at the largest batch (``e2e_decode_<gpu>_vs_batch.png`` /
  ``_vs_prefix.png``), the share of the decode step's roofline reached vs prefix, one line per
  batch (``e2e_decode_<gpu>_roofline.png``, where the points carry it: ``bench/roofline.py``),
  time vs number of questions (``long_document_<gpu>.png``), the two-level bars
  (``two_level_<gpu>.png``);
* rewrites the part of ``bench/README.md`` between ``<!-- results:begin -->`` and
  ``<!-- results:end -->``: per device, the tables (Hydragen Table 1 layout: thousands of
  tokens/s, "X" = out of memory) and the four target ratios -- or "not yet run on GPU";
* prints the target ratios.

Usage: ``python bench/plots.py`` (``--results DIR --plots DIR --readme PATH``; ``--include-smoke``
also renders CPU smoke results, which are skipped otherwise).  The target functions
(:func:`e2e_targets`, :func:`two_level_targets`, :func:`long_document_summary`) need no matplotlib.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ("e2e_decode", "long_document", "two_level")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COLORS = {"shared": "tab:blue", "flat": "tab:red", "none": "tab:gray", "single": "tab:orange", "tree": "tab:blue"}
PART_TITLES = {"gqa": "Llama-3.1-8B shapes (GQA)", "mha": "CodeLlama-7B shapes (MHA)",
               "flat-probe": "flat probe: Llama-3.1-8B shapes (GQA)"}
TARGET_SHARED_VS_NONE = 0.8
TARGET_PREFIX_LOSS = 0.10
TARGET_SHARED_VS_FLAT = 10.0
TARGET_TREE_VS_SINGLE = 1.3
TARGET_ROOFLINE = 0.9


# ---------------------------------------------------------------------------------------- loading
def load_results(results_dir: str, include_smoke: bool = False) -> dict:
    """``{benchmark: {gpu_slug: data}}`` of the result files found."""
    out: dict = {b: {} for b in BENCHMARKS}
    for bench in BENCHMARKS:
        for path in sorted(glob.glob(os.path.join(results_dir, f"{bench}_*.json"))):
            with open(path) as f:
                data = json.load(f)
            if data.get("benchmark") != bench:
                continue
            if data.get("fixed", {}).get("smoke") and not include_smoke:
                continue
            slug = os.path.basename(path)[len(bench) + 1:-len(".json")]
            out[bench][slug] = data
    return out


def _ok(p) -> bool:
    return p is not None and p.get("status") == "ok"


def _fmt_k(v) -> str:
    return f"{v / 1e3:.1f}" if v >= 100 else f"{v / 1e3:.3f}"


def _cell(p, field="tokens_per_s", fmt=_fmt_k) -> str:
    if p is None:
        return "-"
    if p.get("status") == "oom":
        return "X"
    if p.get("status") != "ok":
        return "err"
    if p.get(field) is None:
        return "n/a"
    return fmt(p[field])


def _prefix_label(p) -> str:
    if p is None:
        return "all"
    return f"{round(p / 1024)}K" if p >= 1024 else str(p)


# ---------------------------------------------------------------------------------------- e2e
def e2e_index(data) -> dict:
    """``{label: {"part", "model", "layers", "batches", "prefixes", "pts": {(batch, prefix, backend): point}}}``.

    ``label`` is the part name (``gqa``, ``mha``, ``flat-probe``), or ``"<part> (<N> layers)"``
    when a file holds the same part at several layer counts.
    """
    depths: dict = {}
    for p in data.get("points", []):
        depths.setdefault(p["part"], set()).add(p["layers"])
    parts: dict = {}
    for p in data.get("points", []):
        label = p["part"] if len(depths[p["part"]]) == 1 else f"{p['part']} ({p['layers']} layers)"
        d = parts.setdefault(label, {"part": p["part"], "model": p["model"], "layers": p["layers"],
                                     "batches": set(), "prefixes": set(), "pts": {}})
        d["batches"].add(p["batch"])
        if p["prefix"] is not None:
            d["prefixes"].add(p["prefix"])
        d["pts"][(p["batch"], p["prefix"], p["backend"])] = p
    for d in parts.values():
        d["batches"], d["prefixes"] = sorted(d["batches"]), sorted(d["prefixes"])
    return parts


def _part_order(item):
    """Sort key of an ``e2e_index`` item: gqa, mha, flat-probe, then by depth."""
    label, d = item
    order = list(PART_TITLES)
    return (order.index(d["part"]) if d["part"] in order else len(order), d["layers"], label)


def _tps(d, b, p, backend):
    """Tokens/s of a measured point (None: missing, out of memory, or timing not valid)."""
    pt = d["pts"].get((b, None if backend == "none" else p, backend))
    return pt.get("tokens_per_s") if _ok(pt) else None


def e2e_targets(data) -> dict:
    """The three decode targets (see ``bench/README.md``), computed from one ``e2e_decode`` result file."""
    idx = e2e_index(data)
    res: dict = {"lines": []}
    lines = res["lines"]
    # 1. shared >= 80% of none at every point that fits
    ratios = []
    for part, d in idx.items():
        for b in d["batches"]:
            for p in d["prefixes"]:
                s, n = _tps(d, b, p, "shared"), _tps(d, b, p, "none")
                if s is not None and n is not None:
                    ratios.append((s / n, part, b, p))
    if ratios:
        worst = min(ratios)
        n_ok = sum(r[0] >= TARGET_SHARED_VS_NONE for r in ratios)
        res["shared_vs_none"] = {"min": worst[0], "at": {"part": worst[1], "batch": worst[2], "prefix": worst[3]},
                                 "median": statistics.median(r[0] for r in ratios), "points": len(ratios),
                                 "points_meeting": n_ok, "met": n_ok == len(ratios)}
        lines.append(f"shared / none throughput: min {worst[0]:.2f} (part {worst[1]}, B={worst[2]}, "
                     f"P={_prefix_label(worst[3])}), median {res['shared_vs_none']['median']:.2f}; "
                     f"{n_ok}/{len(ratios)} points >= {TARGET_SHARED_VS_NONE} -> "
                     f"{'MET' if n_ok == len(ratios) else 'NOT MET'}")
    else:
        lines.append("shared / none: no point with both backends measured")
    # 2. largest batch: prefix smallest -> largest costs shared < 10%
    res["prefix_loss_at_largest_batch"] = {}
    for part, d in sorted(idx.items(), key=_part_order):
        if d["part"] == "flat-probe" or len(d["prefixes"]) < 2 or not d["batches"]:
            continue
        b, p0, p1 = d["batches"][-1], d["prefixes"][0], d["prefixes"][-1]
        entry = {"batch": b, "from_prefix": p0, "to_prefix": p1}
        for backend in ("shared", "flat", "none"):
            a, z = _tps(d, b, p0, backend), _tps(d, b, p1, backend)
            entry[backend] = None if a is None or z is None else 1 - z / a
        entry["met"] = entry["shared"] is not None and entry["shared"] < TARGET_PREFIX_LOSS
        res["prefix_loss_at_largest_batch"][part] = entry
        fl = entry["flat"]
        lines.append(f"[{part}] B={b}: prefix {_prefix_label(p0)} -> {_prefix_label(p1)} costs shared "
                     + (f"{100 * entry['shared']:.1f}%" if entry["shared"] is not None else "n/a")
                     + f" of its throughput (target < {100 * TARGET_PREFIX_LOSS:.0f}%; flat "
                     + (f"{100 * fl:.0f}%" if fl is not None else "X/n.a.") + ") -> "
                     + ("MET" if entry["met"] else "NOT MET" if entry["shared"] is not None else "n/a"))
    # 2b. shared >= 90% of the decode step's roofline (none + layers x attention floor)
    roof = [(pt["roofline_fraction"], part, b, p) for part, d in idx.items() for (b, p, backend), pt in d["pts"].items()
            if backend == "shared" and _ok(pt) and pt.get("roofline_fraction") is not None]
    if roof:
        worst = min(roof)
        n_ok = sum(r[0] >= TARGET_ROOFLINE for r in roof)
        res["shared_vs_roofline"] = {"min": worst[0], "at": {"part": worst[1], "batch": worst[2], "prefix": worst[3]},
                                     "points": len(roof), "points_meeting": n_ok, "met": n_ok == len(roof)}
        lines.append(f"shared / roofline (none + layers x attention floor): min {worst[0]:.2f} (part {worst[1]}, "
                     f"B={worst[2]}, P={_prefix_label(worst[3])}); {n_ok}/{len(roof)} points >= {TARGET_ROOFLINE} -> "
                     f"{'MET' if n_ok == len(roof) else 'NOT MET'}")
    # 3. shared >= 10x flat where flat fits, batch >= 256, prefix >= 8K
    sf = []
    for part, d in idx.items():
        for b in d["batches"]:
            for p in d["prefixes"]:
                if b >= 256 and p >= 8192:
                    s, f = _tps(d, b, p, "shared"), _tps(d, b, p, "flat")
                    if s is not None and f is not None:
                        sf.append((s / f, part, b, p, d["layers"]))
    if sf:
        worst = min(sf)
        res["shared_vs_flat"] = {"min": worst[0], "at": {"part": worst[1], "batch": worst[2], "prefix": worst[3],
                                                         "layers": worst[4]},
                                 "points": len(sf), "met": worst[0] >= TARGET_SHARED_VS_FLAT}
        lines.append(f"shared / flat at B>=256, P>=8K where flat fits: min {worst[0]:.1f}x over {len(sf)} points "
                     f"(part {worst[1]}, {worst[4]} layers, B={worst[2]}, P={_prefix_label(worst[3])}) -> "
                     f"{'MET' if worst[0] >= TARGET_SHARED_VS_FLAT else 'NOT MET'}")
    else:
        lines.append("shared / flat at B>=256, P>=8K: flat fits at no such point (or not measured)")
    return res


def e2e_table_md(d) -> str:
    """Hydragen Table 1 layout: rows batch, columns flat / shared per prefix, none."""
    pre = d["prefixes"]
    head = ["batch"] + [f"flat {_prefix_label(p)}" for p in pre] + [f"shared {_prefix_label(p)}" for p in pre] \
        + ["none (all)", "shared/none min", "shared/roofline min"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in d["batches"]:
        cells = [str(b)]
        cells += [_cell(d["pts"].get((b, p, "flat"))) for p in pre]
        cells += [_cell(d["pts"].get((b, p, "shared"))) for p in pre]
        cells.append(_cell(d["pts"].get((b, None, "none"))))
        rs = [_tps(d, b, p, "shared") / _tps(d, b, p, "none") for p in pre
              if _tps(d, b, p, "shared") and _tps(d, b, p, "none")]
        cells.append(f"{min(rs):.2f}" if rs else "-")
        fr = [d["pts"][(b, p, "shared")]["roofline_fraction"] for p in pre
              if _ok(d["pts"].get((b, p, "shared"))) and d["pts"][(b, p, "shared")].get("roofline_fraction")]
        cells.append(f"{min(fr):.2f}" if fr else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------- long document
def long_document_summary(data) -> dict:
    pts = {(p["questions"], p["backend"]): p for p in data.get("points", [])}
    qs = sorted({p["questions"] for p in data.get("points", [])})
    res: dict = {"lines": [], "shared_time_vs_none": {}, "flat_time_vs_shared": {}}
    for q in qs:
        s, n, f = pts.get((q, "shared")), pts.get((q, "none")), pts.get((q, "flat"))
        if _ok(s) and _ok(n):
            res["shared_time_vs_none"][q] = s["time_s"] / n["time_s"]
        if _ok(s) and _ok(f):
            res["flat_time_vs_shared"][q] = f["time_s"] / s["time_s"]
    if res["shared_time_vs_none"]:
        worst = max(res["shared_time_vs_none"].items(), key=lambda kv: kv[1])
        res["lines"].append(f"long document: shared time / none time at most {worst[1]:.2f} (Q={worst[0]}) "
                            f"(Hydragen: within 60% of no-attention)")
    if res["flat_time_vs_shared"]:
        res["lines"].append("long document: flat time / shared time " + ", ".join(
            f"Q={q}: {r:.1f}x" for q, r in sorted(res["flat_time_vs_shared"].items())))
    return res


def long_document_table_md(data) -> str:
    pts = {(p["questions"], p["backend"]): p for p in data.get("points", [])}
    qs = sorted({p["questions"] for p in data.get("points", [])})
    rows = ["| questions | shared (s) | flat (s) | none (s) | shared tokens/s | shared / none time | shared / roofline |",
            "|---|---|---|---|---|---|---|"]
    sec = lambda v: f"{v:.3f}"  # noqa: E731
    for q in qs:
        s, n = pts.get((q, "shared")), pts.get((q, "none"))
        ratio = f"{s['time_s'] / n['time_s']:.2f}" if _ok(s) and _ok(n) else "-"
        roof = f"{s['roofline_fraction']:.2f}" if _ok(s) and s.get("roofline_fraction") else "-"
        rows.append(f"| {q} | {_cell(s, 'time_s', sec)} | {_cell(pts.get((q, 'flat')), 'time_s', sec)} | "
                    f"{_cell(n, 'time_s', sec)} | {_cell(s, 'tokens_per_s', lambda v: f'{v:.0f}')} | {ratio} | {roof} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------- two-level
def two_level_targets(data) -> dict:
    pts = data.get("points", [])
    res: dict = {"lines": []}
    eq = [p for p in pts if p.get("role") == "equal_batch" and _ok(p)]
    single = next((p for p in eq if p["method"] == "single"), None)
    tree_eq = next((p for p in eq if p["method"] == "tree" and single and p["problems"] == single["problems"]), None)
    large = [p for p in pts if p.get("role") == "larger_batch" and _ok(p)]
    tree_large = max(large, key=lambda p: p["problems"]) if large else None
    if single and tree_eq:
        r = single["per_problem_s"] / tree_eq["per_problem_s"]
        ds, dt = single.get("decode_per_problem_s"), tree_eq.get("decode_per_problem_s")
        rd = ds / dt if ds and dt else None
        res["tree_vs_single_equal_batch"] = {"total": r, "decode_only": rd, "batch": single["batch"],
                                             "met": r >= TARGET_TREE_VS_SINGLE}
        rd_s = f"{rd:.2f}x" if rd is not None else "n/a"
        res["lines"].append(f"two-level vs single-level at equal batch {single['batch']}: {r:.2f}x total time "
                            f"({rd_s} decode-only) (target >= {TARGET_TREE_VS_SINGLE}) -> "
                            f"{'MET' if r >= TARGET_TREE_VS_SINGLE else 'NOT MET'}")
    else:
        res["lines"].append("two-level vs single-level at equal batch: not measured")
    if single and tree_large:
        r = single["per_problem_s"] / tree_large["per_problem_s"]
        res["tree_large_vs_single"] = {"total": r, "batch": tree_large["batch"]}
        res["lines"].append(f"two-level at the larger batch {tree_large['batch']} vs single-level: "
                            f"{r:.2f}x per problem")
    return res


def two_level_table_md(data) -> str:
    rows = ["| method | role | problems/batch | batch | time per problem (s) | decode-only per problem (s) | "
            "120 problems (s) | decode tokens/s |", "|---|---|---|---|---|---|---|---|"]
    order = {"equal_batch": 0, "larger_batch": 1}
    for p in sorted(data.get("points", []), key=lambda p: (order.get(p.get("role"), 2), p["method"], p["problems"])):
        if _ok(p):
            dpp, dtps = p.get("decode_per_problem_s"), p.get("decode_tokens_per_s")
            rows.append(f"| {p['method']} | {p.get('role', '')} | {p['problems']} | {p['batch']} | "
                        f"{p['per_problem_s']:.3f} | {'n/a' if dpp is None else f'{dpp:.3f}'} | "
                        f"{p['time_120_problems_s']:.1f} | {'n/a' if dtps is None else f'{dtps:.0f}'} |")
        else:
            rows.append(f"| {p['method']} | {p.get('role', '')} | {p['problems']} | "
                        f"{p['problems'] * data['fixed']['samples']} | "
                        f"{'X' if p.get('status') == 'oom' else 'err'} | | | |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------- plots
def _plt():
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def _closest(values, want):
    return min(values, key=lambda v: (abs(v - want), v)) if values else None


def plot_e2e(data, slug: str, plots_dir: str) -> list[str]:
    plt = _plt()
    idx = {k: v for k, v in e2e_index(data).items() if v["part"] != "flat-probe"}
    if not idx:
        return []
    dev = data["device_info"]["device"]
    paths = []
    for kind in ("vs_batch", "vs_prefix"):
        fig, axes = plt.subplots(1, len(idx), figsize=(5.5 * len(idx), 4), squeeze=False)
        for ax, (part, d) in zip(axes[0], sorted(idx.items(), key=_part_order)):
            if kind == "vs_batch":
                p = _closest(d["prefixes"], 2048)
                xs, xlabel = d["batches"], "batch size"
                key = lambda x, backend: (x, None if backend == "none" else p, backend)  # noqa: E731
                title = f"{PART_TITLES.get(d['part'], part)}\nprefix {_prefix_label(p)}"
            else:
                b = d["batches"][-1] if d["batches"] else None
                xs, xlabel = d["prefixes"], "shared prefix length"
                key = lambda x, backend: (b, None if backend == "none" else x, backend)  # noqa: E731
                title = f"{PART_TITLES.get(d['part'], part)}\nbatch {b}"
            for backend in ("shared", "flat", "none"):
                if kind == "vs_prefix" and backend == "none":   # prefix-independent: one horizontal line
                    v = _tps(d, b, None, "none")
                    if v is not None:
                        ax.axhline(v / 1e3, color=COLORS["none"], linestyle="--", label="none (upper bound)")
                    continue
                ok = [(x, d["pts"][key(x, backend)]["tokens_per_s"] / 1e3) for x in xs
                      if _ok(d["pts"].get(key(x, backend))) and d["pts"][key(x, backend)].get("tokens_per_s")]
                oom = [x for x in xs if (d["pts"].get(key(x, backend)) or {}).get("status") == "oom"]
                if ok:
                    ax.plot(*zip(*ok), "o-", color=COLORS[backend], label=backend)
                if oom:
                    ax.plot(oom, [0] * len(oom), "x", color=COLORS[backend], markersize=9,
                            label=f"{backend}: out of memory")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) if kind == "vs_batch" else _prefix_label(x) for x in xs])
            ax.set_xlabel(xlabel)
            ax.set_ylabel("decode throughput (thousand tokens/s)")
            ax.set_title(f"{title}, {d['layers']} layers", fontsize=9)
            ax.set_ylim(bottom=-0.03 * max([ax.get_ylim()[1], 1e-9]))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"End-to-end decode throughput, {dev} ({data['fixed'].get('gen_tokens')} new tokens)", fontsize=10)
        fig.tight_layout()
        path = os.path.join(plots_dir, f"e2e_decode_{slug}_{kind}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_e2e_roofline(data, slug: str, plots_dir: str) -> list[str]:
    """Share of the decode step's roofline reached by ``shared`` vs prefix, one line per batch."""
    idx = {k: v for k, v in e2e_index(data).items() if v["part"] != "flat-probe"}
    have = {k: d for k, d in idx.items() if any(_ok(pt) and pt.get("roofline_fraction") is not None
                                                 for (_, _, be), pt in d["pts"].items() if be == "shared")}
    if not have:
        return []
    plt = _plt()
    fig, axes = plt.subplots(1, len(have), figsize=(5.5 * len(have), 4), squeeze=False)
    for ax, (part, d) in zip(axes[0], sorted(have.items(), key=_part_order)):
        top = 1.0
        for b in d["batches"]:
            ok = [(p, d["pts"][(b, p, "shared")]["roofline_fraction"]) for p in d["prefixes"]
                  if _ok(d["pts"].get((b, p, "shared"))) and d["pts"][(b, p, "shared")].get("roofline_fraction")]
            if ok:
                ax.plot(*zip(*ok), "o-", label=f"batch {b}")
                top = max(top, *(f for _, f in ok))
        ax.axhline(TARGET_ROOFLINE, color="k", linestyle="--", linewidth=0.8, label=f"target {TARGET_ROOFLINE}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(d["prefixes"])
        ax.set_xticklabels([_prefix_label(p) for p in d["prefixes"]])
        ax.set_xlabel("shared prefix length")
        ax.set_ylabel("roofline / measured step time")
        ax.set_ylim(0, top + 0.05)   # (above 1 where the floor's copy rate is no bound: read-only streams)
        ax.set_title(f"{PART_TITLES.get(d['part'], part)}, {d['layers']} layers", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Decode step vs its roofline (none + layers x attention floor), {data['device_info']['device']}",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(plots_dir, f"e2e_decode_{slug}_roofline.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_long_document(data, slug: str, plots_dir: str) -> list[str]:
    plt = _plt()
    pts = data.get("points", [])
    if not pts:
        return []
    qs = sorted({p["questions"] for p in pts})
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for backend in ("shared", "flat", "none"):
        by_q = {p["questions"]: p for p in pts if p["backend"] == backend}
        ok = [(q, by_q[q]["time_s"]) for q in qs if _ok(by_q.get(q))]
        oom = [q for q in qs if (by_q.get(q) or {}).get("status") == "oom"]
        if ok:
            ax.plot(*zip(*ok), "o-", color=COLORS[backend], label=backend)
        if oom:
            ax.plot(oom, [0] * len(oom), "x", color=COLORS[backend], markersize=9, label=f"{backend}: out of memory")
    ax.set_xscale("log", base=2)
    ax.set_xticks(qs)
    ax.set_xticklabels([str(q) for q in qs])
    ax.set_xlabel("number of questions")
    ax.set_ylabel("time to answer (s), document prefill excluded")
    f = data["fixed"]
    layers = pts[0]["layers"]
    ax.set_title(f"Long document ({f['doc_tokens']} tokens), {f['answer_tokens']} answer tokens\n"
                 f"Yi-6B-200K shapes, {layers} layers, {data['device_info']['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(plots_dir, f"long_document_{slug}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_two_level(data, slug: str, plots_dir: str) -> list[str]:
    plt = _plt()
    pts = [p for p in data.get("points", []) if _ok(p)]
    if not pts:
        return []
    order = {"equal_batch": 0, "larger_batch": 1}
    pts.sort(key=lambda p: (order.get(p.get("role"), 2), p["method"] != "single", p["problems"]))
    labels = [f"{p['method']}\nbatch {p['batch']}" for p in pts]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(pts))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [p["per_problem_s"] for p in pts], w, label="total (prefill + decode)",
           color=[COLORS[p["method"]] for p in pts])
    ax.bar([i + w / 2 for i in x], [p.get("decode_per_problem_s") or 0 for p in pts], w, label="decode only",
           color=[COLORS[p["method"]] for p in pts], alpha=0.45, hatch="//")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("seconds per problem")
    f = data["fixed"]
    ax.set_title(f"Two-level (tree) vs single-level sharing: root {f['root_tokens']} tokens, "
                 f"{f['samples']} samples x {f['gen_tokens']} tokens\nCodeLlama-7B shapes, {pts[0]['layers']} layers, "
                 f"{data['device_info']['device']}", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = os.path.join(plots_dir, f"two_level_{slug}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ---------------------------------------------------------------------------------------- README
def _commit(meta: dict) -> str:
    """The ``"meta"`` commit of a result file as text (one commit, or ``run: commit`` pairs)."""
    c = meta.get("commit")
    if isinstance(c, dict):
        return ", ".join(f"{v} ({k})" for k, v in c.items())
    return str(c) if c else ""


def _header(data) -> str:
    info = data["device_info"]
    runs = data.get("runs", [])
    jaxv = sorted({r.get("jax", info.get("jax")) for r in runs} or {info.get("jax")})
    smoke = " **(CPU smoke run, not a measurement)**" if data.get("fixed", {}).get("smoke") else ""
    commit = _commit(data.get("meta", {})) or ", ".join(dict.fromkeys(str(r["commit"]) for r in runs
                                                                       if r.get("commit")))
    commit = f", commit {commit}" if commit else ""
    return f"Device: **{info['device']}**, jax {', '.join(map(str, jaxv))}{commit}{smoke}."


def render_markdown(results: dict, plots_dir: str, readme_dir: str, make_plots: bool = True) -> tuple[str, list[str]]:
    """Markdown of all results (and the PNGs, when ``make_plots``); returns ``(markdown, target lines)``."""
    md, lines = [], []
    rel = lambda p: os.path.relpath(p, readme_dir)  # noqa: E731
    for bench, title in (("e2e_decode", "End-to-end decode throughput (Hydragen Tables 1-6, Figure 3)"),
                         ("long_document", "Long document (Hydragen Figure 5)"),
                         ("two_level", "Two-level sharing (Hydragen Figure 6)")):
        md.append(f"### {title}\n")
        if not results.get(bench):
            md.append("_Not yet run on GPU._\n")
            continue
        for slug, data in sorted(results[bench].items()):
            md.append(f"#### {slug}\n\n{_header(data)}\n")
            pngs = []
            if bench == "e2e_decode":
                t = e2e_targets(data)
                for part, d in sorted(e2e_index(data).items(), key=_part_order):
                    md.append(f"**{PART_TITLES.get(d['part'], part)}**, {d['layers']} layers, "
                              f"{data['fixed'].get('gen_tokens')} generated tokens; thousands of tokens/s "
                              f"(X = out of memory, - = not measured, n/a = timing below noise, err = failed: "
                              f"see the JSON):\n\n{e2e_table_md(d)}\n")
                if make_plots:
                    pngs = plot_e2e(data, slug, plots_dir) + plot_e2e_roofline(data, slug, plots_dir)
            elif bench == "long_document":
                t = long_document_summary(data)
                md.append(f"{long_document_table_md(data)}\n")
                if make_plots:
                    pngs = plot_long_document(data, slug, plots_dir)
            else:
                t = two_level_targets(data)
                md.append(f"{two_level_table_md(data)}\n")
                if make_plots:
                    pngs = plot_two_level(data, slug, plots_dir)
            if t["lines"]:
                md.append("Targets / ratios:\n\n" + "\n".join(f"* {ln}" for ln in t["lines"]) + "\n")
                lines += [f"[{bench} {slug}] {ln}" for ln in t["lines"]]
            for p in pngs:
                md.append(f"![{os.path.basename(p)}]({rel(p)})\n")
    return "\n".join(md), lines


def update_readme(readme: str, body: str) -> None:
    with open(readme) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n<!-- generated by `python bench/plots.py` from bench/results/*.json: do not edit "
                f"by hand -->\n\n{body}\n{END}{tail}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--plots", default=os.path.join(HERE, "plots"))
    ap.add_argument("--readme", default=os.path.join(HERE, "README.md"))
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite the README's results section")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--include-smoke", action="store_true", help="also render CPU smoke results")
    args = ap.parse_args(argv)
    results = load_results(args.results, include_smoke=args.include_smoke)
    os.makedirs(args.plots, exist_ok=True)
    body, lines = render_markdown(results, args.plots, os.path.dirname(os.path.abspath(args.readme)),
                                  make_plots=not args.no_plots)
    if not args.no_readme:
        update_readme(args.readme, body)
    for ln in lines:
        print(ln)
    if not lines:
        print("no GPU results yet (tables marked 'not yet run on GPU')")
    return {"markdown": body, "lines": lines, "found": {b: sorted(v) for b, v in results.items()}}


if __name__ == "__main__":
    main()
