"""Tables and plot of a ``bench/mla_decode.py`` result file (no GPU needed; the plot needs
matplotlib).

* :func:`point_line` -- one printed line per point: the floor, each contender's time, ours'
  speedups (what ``bench/mla_decode.py`` prints as it measures);
* :func:`table_md` -- per head count and suffix length, a markdown table over batch (rows) and
  prefix (columns) of ours' time and its speedup against FlashInfer and flat XLA;
* :func:`plot` -- ours' speedup against FlashInfer (top row) and against flat XLA (bottom row)
  over the batch, one line per prefix length, one column per (model, suffix).

``python bench/mla_decode_plot.py bench/results/mla_decode_h200.json`` prints the tables and
writes the PNG beside the JSON (``--out``: elsewhere; ``--no-plot``: tables only).
"""
from __future__ import annotations

import argparse
import json
import os

__all__ = ["point_line", "panels", "series", "table_md", "plot", "main"]

ROWS = (("flashinfer", "ours' speedup vs FlashInfer MLA"), ("flat_xla", "ours' speedup vs flat XLA"))


def _ms(entry: dict) -> str:
    v = entry.get("ms")
    if isinstance(v, (int, float)):
        return f"{v:.3f}"
    return "X" if entry.get("oom") else "err" if "error" in entry else "skip" if "skipped" in entry else "-"


def point_line(rec: dict) -> str:
    """The floor, each contender's ms (X: out of memory, skip: does not fit), ours' speedups."""
    if "floor_ms" not in rec:
        return f"{rec['key']:>24} {rec.get('error', rec.get('status'))}"
    cells = " | ".join(f"{n} {_ms(e)}" for n, e in rec.get("results", {}).items())
    sp = " ".join(f"{k} {v:.2f}x" for k, v in rec.get("speedup", {}).items())
    return f"{rec['key']:>24} floor {rec['floor_ms']:.3f} ms | {cells}" + (f" | {sp}" if sp else "")


def panels(doc: dict) -> list[tuple[str, int, int]]:
    """``(model, heads, suffix)`` of the measured points, in file order."""
    out = []
    for p in doc["points"]:
        k = (p["model"], p["heads"], p["suffix"])
        if k not in out:
            out.append(k)
    return out


def series(doc: dict, panel: tuple, prefix: int, vs: str) -> list[tuple[int, float]]:
    """``[(batch, ours' speedup vs <vs>)]`` of one panel and prefix length, where both ran."""
    model, _, suffix = panel
    pts = [p for p in doc["points"] if (p["model"], p["suffix"], p["prefix"]) == (model, suffix, prefix)]
    return sorted((p["batch"], p["speedup"][f"vs_{vs}"]) for p in pts if f"vs_{vs}" in p.get("speedup", {}))


def table_md(doc: dict) -> str:
    """Markdown tables: ours' ms (speedup vs FlashInfer / vs flat XLA) per batch and prefix."""
    lines = []
    for model, heads, suffix in panels(doc):
        pts = [p for p in doc["points"] if (p["model"], p["suffix"]) == (model, suffix)]
        prefixes = sorted({p["prefix"] for p in pts})
        lines += [f"**{model}** (H={heads}), suffix {suffix}: ours ms (x FlashInfer / x flat XLA)", "",
                  "| batch | " + " | ".join(f"P={p}" for p in prefixes) + " |",
                  "|---|" + "---|" * len(prefixes)]
        for b in sorted({p["batch"] for p in pts}):
            cells = []
            for pre in prefixes:
                p = next((p for p in pts if (p["batch"], p["prefix"]) == (b, pre)), None)
                if p is None:
                    cells.append("-")
                    continue
                sp = p.get("speedup", {})
                fmt = lambda k: f"{sp[k]:.2f}" if k in sp else "-"  # noqa: E731
                cells.append(f"{_ms(p.get('results', {}).get('ours', {}))} "
                             f"({fmt('vs_flashinfer')} / {fmt('vs_flat_xla')})")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> str:
    """The figure of the module doc, written to ``path``."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    cols = panels(doc)
    fig, axes = plt.subplots(len(ROWS), max(1, len(cols)), figsize=(4 * max(1, len(cols)), 6.5),
                             squeeze=False)
    for j, panel in enumerate(cols):
        prefixes = sorted({p["prefix"] for p in doc["points"] if (p["model"], p["suffix"]) == (panel[0], panel[2])})
        for i, (vs, label) in enumerate(ROWS):
            ax, lines = axes[i][j], 0
            for pre in prefixes:
                xy = series(doc, panel, pre, vs)
                if xy:
                    ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=f"P={pre}")
                    lines += 1
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{panel[0]} (H={panel[1]}), S={panel[2]}", fontsize=9)
            ax.set_xlabel("batch")
            if j == 0:
                ax.set_ylabel(label, fontsize=9)
            if lines:
                ax.legend(fontsize=7)
    run = doc["runs"][-1] if doc.get("runs") else {}
    fig.suptitle(f"Shared-prefix MLA decode: {run.get('device', {}).get('device', '?')}, "
                 f"commit {run.get('commit')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    with open(args.file) as f:
        doc = json.load(f)
    print(table_md(doc))
    if args.no_plot:
        return None
    png = plot(doc, args.out or os.path.splitext(args.file)[0] + ".png")
    print("plot:", png)
    return png


if __name__ == "__main__":
    main()
