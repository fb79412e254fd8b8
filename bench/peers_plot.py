"""Plot and table of ``bench/peers.py`` results, from the JSON alone (matplotlib, Agg).

* :func:`plot` -- per group of points (large batch, small batch and small GQA, trees): bars of
  ours (loop; and the 8-calls-per-graph loop where measured), FlashInfer's cascade (the faster
  page size), FlashInfer's paged decode (the faster of tensor cores off / on), log scale, with
  the floor as a black tick;
* :func:`table_md` -- the markdown table of the same numbers with the ratios.

Usage: ``python bench/peers_plot.py bench/results/peers_h100.json`` (writes the PNG beside it and
prints the table and the targets).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers_summary import num, summarize  # noqa: E402

__all__ = ["plot", "table_md", "groups"]

SERIES = (("ours_auto_ms", "ours (loop)", "tab:blue"), ("ours_auto_u8_ms", "ours (8 calls / graph)", "tab:cyan"),
          ("fi_cascade_best_ms", "FlashInfer cascade", "tab:orange"),
          ("fi_decode_best_ms", "FlashInfer paged decode", "tab:red"))


def _short(r) -> str:
    if r["kind"] == "tree":
        return f"{r['name']}\nB={r['batch']}"
    p = f"{r['prefix'] // 1024}K" if r["prefix"] % 1024 == 0 else str(r["prefix"])
    return f"{r['heads_q']}/{r['heads_kv']} B{r['batch']}\nP{p} S{r['suffix']}"


def groups(doc) -> list[tuple[str, list[dict]]]:
    """``[(title, points)]`` of the finished points, in run order."""
    res = [r for r in doc.get("results", []) if r.get("status") == "ok"]
    small = [r for r in res if r["kind"] == "single" and (r["batch"] <= 32 or "small_gqa" in r["tags"])]
    large = [r for r in res if r["kind"] == "single" and r not in small]
    trees = [r for r in res if r["kind"] == "tree"]
    return [(t, g) for t, g in (("batch >= 64 (probes, grid)", large), ("small batch, small GQA", small),
                                ("trees (cascade of one level per depth + suffix)", trees)) if g]


def plot(doc, path: str) -> str | None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    gs = groups(doc)
    if not gs:
        return None
    width = max(8.0, 0.55 * max(len(g) for _, g in gs) * 1.2)
    fig, axes = plt.subplots(len(gs), 1, figsize=(width, 3.6 * len(gs)), squeeze=False)
    bar = 0.8 / len(SERIES)
    for ax, (title, rows) in zip(axes[:, 0], gs):
        xs = range(len(rows))
        for i, (key, label, color) in enumerate(SERIES):
            vals = [num(r.get(key)) for r in rows]
            if any(v is not None for v in vals):
                ax.bar([x + (i - len(SERIES) / 2 + 0.5) * bar for x in xs],
                       [v if v is not None else 0 for v in vals], bar, label=label, color=color)
        ax.scatter(list(xs), [r["floor_ms"] for r in rows], marker="_", s=400, color="k", label="floor", zorder=3)
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 30)     # room for the legend above the bars
        ax.set_xticks(list(xs))
        ax.set_xticklabels([_short(r) for r in rows], fontsize=6)
        ax.set_ylabel("ms per call (log)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncol=5)
    info = doc.get("info", {})
    vers = (doc.get("runs") or [{}])[-1].get("versions", {})
    fig.suptitle(f"Shared-prefix decode attention, bf16: ours vs FlashInfer {vers.get('flashinfer', '-')}, "
                 f"{info.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v) -> str:
    v = num(v)
    return "-" if v is None else (f"{v:.3f}" if v >= 0.01 else f"{v * 1e3:.1f} us")


def _x(v) -> str:
    v = num(v)
    return "-" if v is None else f"{v:.2f}"


def table_md(doc) -> str:
    """Markdown: per point, ours / FlashInfer cascade / paged decode / floor (ms) and ratios."""
    rows = ["| point | ours (loop) | ours (8/graph) | FI cascade | FI decode | floor | cascade / ours | "
            "decode / ours | ours / best FI |", "|---|---|---|---|---|---|---|---|---|"]
    for title, pts in groups(doc):
        rows.append(f"| **{title}** | | | | | | | | |")
        for r in pts:
            rows.append(f"| {_short(r).replace(chr(10), ' ')} | {_ms(r.get('ours_auto_ms'))} | "
                        f"{_ms(r.get('ours_auto_u8_ms'))} | {_ms(r.get('fi_cascade_best_ms'))} | "
                        f"{_ms(r.get('fi_decode_best_ms'))} | {_ms(r.get('floor_ms'))} | "
                        f"{_x(r.get('fi_cascade_over_ours'))} | {_x(r.get('fi_decode_over_ours'))} | "
                        f"{_x(r.get('ours_over_fi_best'))} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    with open(a.json) as f:
        doc = json.load(f)
    png = plot(doc, a.png or os.path.splitext(a.json)[0] + ".png")
    print(table_md(doc))
    for line in summarize(doc)["lines"]:
        print(line)
    return png


if __name__ == "__main__":
    main()
