"""Plot and table of ``bench/flash_attention.py`` results, from the JSON alone (matplotlib, Agg).

* :func:`plot` -- one column per head_dim and, per (tokens, GQA group), four rows of panels
  against the sequence length ``T`` (log2 axis): forward TFLOP/s, forward+backward TFLOP/s, and
  each contender's ratio to cuDNN (cuDNN's time over its time: above 1 is faster than cuDNN) of
  both; one line per contender, solid for causal and dashed for full attention;
* :func:`table_md` -- the markdown table of the same numbers (TFLOP/s, and in brackets the ratio
  to cuDNN).

Usage: ``python bench/plot_flash_attention.py bench/results/flash_attention_h200.json`` (writes
the PNG beside it, ``--png`` elsewhere, and prints the table).
"""
from __future__ import annotations

import argparse
import json
import os

__all__ = ["plot", "table_md", "panels", "series"]

COLORS = {"triton": "tab:blue", "mgpu": "tab:cyan", "cudnn": "tab:orange", "xla": "tab:gray",
          "tokamax": "tab:green"}
LABELS = {"triton": "ours (Triton)", "mgpu": "ours (Mosaic GPU)", "cudnn": "cuDNN", "xla": "XLA",
          "tokamax": "tokamax (Mosaic GPU)"}
DIRECTION_TITLES = {"fwd": "forward", "fwd_bwd": "forward+backward"}


def contenders(doc) -> list[str]:
    """The contenders of the file's runs, in the order first named."""
    out: list[str] = []
    for run in doc.get("runs", []):
        out += [c for c in run.get("contenders", []) if c not in out]
    for p in doc.get("points", []):
        out += [c for c in p.get("results", {}) if c not in out]
    return out


def panels(doc) -> list[tuple[int, int, int]]:
    """``(d, group, tokens)`` of the measured points, sorted."""
    return sorted({(p["d"], p["group"], p["tokens"]) for p in doc.get("points", [])})


def series(doc, panel, contender: str, direction: str, causal: bool, metric: str = "tflops") -> list[tuple]:
    """``[(T, value)]`` of one line, sorted by ``T``; points where it did not run are left out."""
    d, g, n = panel
    out = []
    for p in doc.get("points", []):
        if (p["d"], p["group"], p["tokens"], p["causal"]) != (d, g, n, causal):
            continue
        v = p.get("results", {}).get(contender, {}).get(direction, {}).get(metric)
        if isinstance(v, (int, float)):
            out.append((p["t"], v))
    return sorted(out)


def _t_label(t: int) -> str:
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


ROWS = (("fwd", "tflops"), ("fwd_bwd", "tflops"), ("fwd", "vs_cudnn"), ("fwd_bwd", "vs_cudnn"))


def plot(doc, path: str) -> str | None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    pans, names = panels(doc), contenders(doc)
    if not pans:
        return None
    dims = sorted({d for d, _, _ in pans})
    groups = sorted({(n, g) for _, g, n in pans})
    fig, axes = plt.subplots(len(ROWS) * len(groups), len(dims), squeeze=False,
                             figsize=(4.2 * len(dims), 2.5 * len(ROWS) * len(groups)))
    for gi, (n, g) in enumerate(groups):
        for col, d in enumerate(dims):
            panel = (d, g, n)
            ts = sorted({p["t"] for p in doc["points"] if (p["d"], p["group"], p["tokens"]) == panel})
            for r, (direction, metric) in enumerate(ROWS):
                ax = axes[gi * len(ROWS) + r, col]
                if not ts:
                    ax.axis("off")
                    continue
                for name in names:
                    if metric == "vs_cudnn" and name == "cudnn":
                        continue
                    for causal, style in ((True, "-"), (False, "--")):
                        pts = series(doc, panel, name, direction, causal, metric)
                        if pts:
                            ax.plot([t for t, _ in pts], [v for _, v in pts], style, marker="o", ms=3,
                                    color=COLORS.get(name),
                                    label=LABELS.get(name, name) + ("" if causal else " (full)"))
                if metric == "vs_cudnn":
                    ax.axhline(1.0, color="k", lw=0.8)
                    ax.set_ylabel(f"{DIRECTION_TITLES[direction]}\ncuDNN time / time", fontsize=8)
                else:
                    ax.set_ylabel(f"{DIRECTION_TITLES[direction]}\nTFLOP/s", fontsize=8)
                    ax.set_ylim(bottom=0)
                ax.set_xscale("log", base=2)
                ax.set_xticks(ts)
                ax.set_xticklabels([_t_label(t) for t in ts], fontsize=7)
                ax.tick_params(axis="y", labelsize=7)
                ax.grid(alpha=0.3)
                if r == 0:
                    ax.set_title(f"D={d}, G={g}, Hq={32 if d <= 128 else 16}, {n // 1024}K tokens", fontsize=9)
                if r == len(ROWS) - 1:
                    ax.set_xlabel("T (B = tokens / T)", fontsize=8)
    handles, labels = [], []
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    height = fig.get_figheight()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.35 / height),
               ncol=min(5, max(1, len(labels))), fontsize=7)
    runs = doc.get("runs") or [{}]
    dev = runs[-1].get("device", {}).get("device", "?")
    vers = runs[-1].get("versions", {})
    fig.suptitle(f"Flash attention, bf16 (solid causal, dashed full): {dev}, jax {vers.get('jax', '?')}, "
                 f"commit {runs[-1].get('commit') or '?'}", fontsize=10, y=1 - 0.1 / height)
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.1 / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cell(entry: dict) -> str:
    if "tflops" in entry:
        ratio = entry.get("vs_cudnn")
        return f"{entry['tflops']:.0f}" + (f" ({ratio:.2f})" if ratio is not None else "")
    if "skipped" in entry:
        return "skip"
    return "X" if entry.get("oom") else ("err" if "error" in entry else "-")


def table_md(doc) -> str:
    """Markdown: per point and direction, each contender's TFLOP/s (ratio to cuDNN)."""
    names = contenders(doc)
    rows = ["| point | dir | " + " | ".join(LABELS.get(n, n) for n in names) + " |",
            "|---|---|" + "---|" * len(names)]
    for p in doc.get("points", []):
        for direction in ("fwd", "fwd_bwd"):
            cells = [_cell(p.get("results", {}).get(n, {}).get(direction, {})) for n in names]
            rows.append(f"| {p['key']} | {direction} | " + " | ".join(cells) + " |")
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
    return png


if __name__ == "__main__":
    main()
