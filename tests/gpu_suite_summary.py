"""Summarize a tests/gpu_suite.sh output folder into OUT_DIR/summary.json:
per half the pytest summary line, outcomes, skipped and failed tests, process and XLA-compile
seconds, seconds by file and the slowest tests; for the planner-shape test the cases, the leaves
covered and the largest errors.

    python3 tests/gpu_suite_summary.py OUT_DIR --device "..." --jax "..." --commit "..." \
        [--command "..."] [--cache "..."] [--note "..."]
"""
import argparse
import collections
import json
import os
import re
import tempfile


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def half_summary(out_dir: str, half: str) -> dict:
    """Counts and times of one half from ``<half>.log`` and ``<half>.jsonl``."""
    with open(os.path.join(out_dir, f"{half}.log")) as f:
        lines = f.read().splitlines()
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if re.search(r"\d+ (passed|failed|skipped|error)", ln) and " in " in ln), "")
    wall = next((ln for ln in reversed(lines) if ln.startswith("rc=")), "")
    records = [r for r in read_jsonl(os.path.join(out_dir, f"{half}.jsonl")) if "outcome" in r]
    final: dict[str, str] = {}
    for r in records:   # a test's outcome: failed in any phase, else its call (or skipped setup)
        if r["outcome"] == "failed" or r["test"] not in final or r.get("when") == "call":
            if final.get(r["test"]) != "failed":
                final[r["test"]] = r["outcome"]
    by_file: dict[str, dict] = collections.defaultdict(lambda: dict(tests=0, seconds=0.0, compile_s=0.0))
    seen = set()
    for r in records:
        f = by_file[r["test"].split("::")[0]]
        if r["test"] not in seen:
            seen.add(r["test"])
            f["tests"] += 1
        f["seconds"] += r.get("seconds", 0.0)
        f["compile_s"] += r.get("compile_s", 0.0)
    by_file = {k: dict(v, seconds=round(v["seconds"], 1), compile_s=round(v["compile_s"], 1))
               for k, v in sorted(by_file.items(), key=lambda kv: -kv[1]["seconds"])}
    calls = sorted((r for r in records if r.get("when") == "call"), key=lambda r: -r.get("seconds", 0))
    return dict(summary=summary, wall=wall, outcomes=dict(collections.Counter(final.values())),
                skipped=sorted(t for t, o in final.items() if o == "skipped"),
                failed=sorted(t for t, o in final.items() if o == "failed"),
                process_seconds=round(sum(r.get("seconds", 0.0) for r in records), 1),
                compile_seconds=round(sum(r.get("compile_s", 0.0) for r in records), 1),
                by_file=by_file,
                slowest=[dict(test=r["test"], seconds=r["seconds"]) for r in calls[:10]])


def planner_shapes(out_dir: str, halves: list[str]) -> dict | None:
    """The planner-shape test's per-case records (``case``, ``leaf``, errors), if present."""
    cases = [r for h in halves for r in read_jsonl(os.path.join(out_dir, f"{h}.jsonl"))
             if "case" in r and "leaf" in r]
    if not cases:
        return None
    return dict(cases=len(cases), leaves=dict(collections.Counter(r["leaf"] for r in cases)),
                max_rel_err=max(r["rel_err"] for r in cases),
                max_lse_abs_err=max(r["lse_abs_err"] for r in cases))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    for name in ("device", "jax", "commit"):
        p.add_argument(f"--{name}", required=True)
    for name in ("command", "cache", "note"):
        p.add_argument(f"--{name}", default="")
    a = p.parse_args()
    halves = [h for h in ("library", "kernels", "two_gpus")
              if os.path.exists(os.path.join(a.out_dir, f"{h}.log"))]
    doc = dict(benchmark="gpu_suite", device=a.device, jax=a.jax, commit=a.commit, command=a.command,
               cache=a.cache, halves={h: half_summary(a.out_dir, h) for h in halves},
               planner_shapes=planner_shapes(a.out_dir, halves), note=a.note)
    path = os.path.join(a.out_dir, "summary.json")
    fd, tmp = tempfile.mkstemp(dir=a.out_dir, prefix=".summary.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(path)


if __name__ == "__main__":
    main()
