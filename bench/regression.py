"""Speed regression check of shared-prefix decode attention between two checkouts, one GPU.

Times ``shared_prefix_attention(impl="auto")`` of this checkout and of a baseline checkout (a
``git worktree`` or ``git archive`` of another commit) at the same points, on the same GPU, in
alternating processes (baseline, current, baseline, current, ...), so that clock and thermal drift
hit both sides alike.  Each process imports only its own checkout.  Optionally it also times
forced leaves of this checkout's planner (``--paths``), e.g. to decide whether a leaf still pays.

Timing: ``bench.timing.loop_time`` of this checkout for both sides: ``n`` dependent calls in one
jitted ``fori_loop`` whose body is one CUDA graph (``bench.timing.GRAPH_ALWAYS``, as inside a
model's decode step), each output perturbing the next query; median of 3 timed calls divided by
``n``; the per-process result for a point is the median over its ``--reps`` processes.

Usage (GPU machine)::

    python bench/regression.py --baseline /path/to/old/checkout --out bench/results/regression_h100.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# (Hq, Hkv, D, B, P, S): the three probe points of the shared-prefix grid, then grid points
# covering small and large batch, Hkv=1, long prefixes and long suffixes.
POINTS = (
    (32, 8, 128, 256, 4096, 128), (32, 8, 128, 512, 8192, 128), (32, 8, 128, 1024, 4096, 128),
    (32, 8, 128, 16, 1024, 64), (32, 8, 128, 16, 16384, 1024), (32, 8, 128, 64, 4096, 256),
    (32, 8, 128, 256, 4096, 256), (32, 8, 128, 256, 16384, 1024), (32, 8, 128, 1024, 1024, 64),
    (32, 8, 128, 1024, 16384, 256), (8, 1, 128, 16, 4096, 1024), (8, 1, 128, 64, 16384, 64),
    (8, 1, 128, 256, 1024, 64), (8, 1, 128, 256, 4096, 64), (8, 1, 128, 1024, 4096, 256),
    (8, 1, 128, 1024, 16384, 1024), (8, 1, 128, 8, 4000, 256),
)


def _timing():
    """This checkout's ``bench/timing.py``, loaded from its file: the workers of both sides time
    with the same code (a worker imports the library and ``bench`` of its own checkout, whose
    timing helpers may differ)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timing.py")
    spec = importlib.util.spec_from_file_location("regression_timing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(points, paths):
    """Time every point in this process's checkout; prints one JSON line per measurement."""
    import jax
    import jax.numpy as jnp

    import jax_prefix_attn as jpa
    timing = _timing()
    dt = jnp.bfloat16
    for hq, hkv, d, b, p, s in points:
        shapes = ((b, hq, d), (p, hkv, d), (p, hkv, d), (b, s, hkv, d), (b, s, hkv, d))
        q, pk, pv, sk, sv = (jax.random.normal(k, shape, dt) for k, shape in
                             zip(jax.random.split(jax.random.PRNGKey(0), 5), shapes))
        sl = jnp.full((b,), s, jnp.int32)
        cols = [("auto", None)] + [(f"path:{x}", x) for x in paths]
        for name, path in cols:
            rec = dict(point=[hq, hkv, d, b, p, s], col=name)
            try:
                kw = {}
                if path is not None:
                    kw["plan"] = jpa.plan_shared_prefix(
                        batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                        prefix_len=p, suffix_len=s, dtype=dt, path=path)

                def f(q, pk, pv, sk, sv, sl, kw=kw):
                    return jpa.shared_prefix_attention(q[:, None], pk, pv, sk, sv,
                                                       suffix_lengths=sl, impl="auto", **kw)[:, 0]
                rec["ms"] = timing.loop_time(f, q, (pk, pv, sk, sv, sl),
                                             compiler_options=timing.GRAPH_ALWAYS) * 1e3
            except Exception as e:  # noqa: BLE001 (a forced path may not apply: recorded)
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(rec), flush=True)


def _git_commit(root):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _run_worker(root, points, paths):
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--points", json.dumps(points),
           "--paths", ",".join(paths)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
    return recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="root of the baseline checkout")
    ap.add_argument("--baseline-commit", help="commit of the baseline (when it is not a git tree)")
    ap.add_argument("--current-commit", help="commit of this checkout (when it is not a git tree)")
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--reps", type=int, default=2, help="processes per side (alternating)")
    ap.add_argument("--paths", default="", help="comma-separated forced leaves of this checkout")
    ap.add_argument("--path-points", default="", help="JSON list of points for --paths "
                    "(default: all points)")
    ap.add_argument("--only", default="", help="JSON list of (Hq, Hkv, D, B, P, S) points to time "
                    "instead of the built-in ones")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--points", help=argparse.SUPPRESS)
    args = ap.parse_args()
    paths = [x for x in args.paths.split(",") if x]
    if args.worker:
        worker([tuple(x) for x in json.loads(args.points)], paths)
        return
    import jax
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    points = [list(x) for x in (json.loads(args.only) if args.only else POINTS)]
    path_points = json.loads(args.path_points) if args.path_points else points
    dev = jax.devices()[0]
    doc = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
               python=platform.python_version(),
               commit=args.current_commit or _git_commit(here),
               baseline=args.baseline, baseline_commit=args.baseline_commit or _git_commit(
                   args.baseline), method=__doc__.split("\n\n")[2].replace("\n", " "),
               runs=[])
    for rep in range(args.reps):
        for side, root in (("baseline", args.baseline), ("current", here)):
            t0 = time.time()
            recs = _run_worker(root, points, [])
            if side == "current" and paths:
                recs += _run_worker(root, path_points, paths)
            for r in recs:
                r.update(side=side, rep=rep)
            doc["runs"] += recs
            print(f"rep {rep} {side}: {len(recs)} measurements in {time.time() - t0:.0f} s",
                  flush=True)
            if args.out:  # what is measured so far survives a cut-off run
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
    rows = {}
    for r in doc["runs"]:
        if "ms" in r:
            rows.setdefault((tuple(r["point"]), r["col"], r["side"]), []).append(r["ms"])
    table = []
    for pt in points:
        base = rows.get((tuple(pt), "auto", "baseline"))
        cur = rows.get((tuple(pt), "auto", "current"))
        row = dict(point=pt, baseline_ms=statistics.median(base) if base else None,
                   current_ms=statistics.median(cur) if cur else None)
        if base and cur:
            row["current_over_baseline"] = row["current_ms"] / row["baseline_ms"]
        for x in paths:
            t = rows.get((tuple(pt), f"path:{x}", "current"))
            if t:
                row[f"{x}_ms"] = statistics.median(t)
        table.append(row)
        print(json.dumps(row), flush=True)
    doc["table"] = table
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
