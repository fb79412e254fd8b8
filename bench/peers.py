"""Ours against what users would pick instead, on one GPU in one process: FlashInfer's multi-level
cascade (``MultiLevelCascadeAttentionWrapper``) and its paged decode over shared prefix pages
(``BatchDecodeWithPagedKVCacheWrapper``, what prefix caching gives), bf16, one query per
sequence.

Columns per point (``<col>_ms``; ``bench/peers_ours.py`` and ``bench/peers_flashinfer.py`` define
them): ``ours_auto`` (+ each family's leaf, every forced leaf / tree schedule with ``--paths``,
``ours_auto_u8`` at small points), ``fi_cascade_p16`` / ``fi_cascade_p1`` (one level per tree
depth + the suffix level, page size 16 / 1), ``fi_decode_p16`` / ``fi_decode_tc_p16`` (paged
decode, tensor cores off / on), ``floor_ms`` (``max(bytes / copy bandwidth, flops / matmul
rate)``, both measured in the run), and the harnesses' own costs ``jax_loop_identity_ms`` and
``harness.torch_graph_empty_kernel``.  Every FlashInfer column's output is compared with ours
(``<col>_maxabs_vs_ours``, ``<col>_maxrel_vs_ours``); the inputs are made once in JAX and handed
to torch through DLPack (the same bytes).  Ratios: ``<col>_over_ours`` (> 1: ours faster),
``ours_over_fi_best``, ``ours_over_floor``.

The points (``bench/peers_points.py``): the probe points, small batch, the small-GQA case and
trees against the cascade (``--quick``), then the Hydragen grid.  ``--resume`` keeps the points
already in ``--out`` (with the rates of the run that measured them) and measures the rest; each
point is written as soon as it is measured, so a run cut off keeps what it finished;
``--budget-s`` starts no new point after that many seconds.

FlashInfer compiles its kernels with nvcc on first use (about two minutes); that compile runs in
a background thread (``MAX_JOBS`` = cores - 2) while our columns of the first large points
(probes, trees) are measured (``ours_during_flashinfer_compile: true`` on those points;
``--no-overlap``: wait instead), before any FlashInfer column; those points' ``ours_auto`` is
timed again after the compile (the first time kept as ``ours_auto_during_compile_ms``).

Usage (GPU machine, FlashInfer unpacked as in ``bench/README.md``)::

    FLASHINFER_CUDA_ARCH_LIST=9.0a python bench/peers.py --quick --commit SHA
    python bench/peers.py --resume --commit SHA             # the rest of the grid, repeatable
    python bench/peers.py --smoke                           # CPU: tiny shapes, torch reference
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")   # the rest of the GPU for torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from bench import peers_flashinfer as pfi  # noqa: E402
from bench import peers_points as pts  # noqa: E402
from bench.peers_ours import OursConfig, harness_ms, measure, retime_auto  # noqa: E402
from bench.peers_paged import build_cache, paged_layout  # noqa: E402
from bench.peers_summary import METHODOLOGY, finish_point, summarize  # noqa: E402
from bench.timing import device_info, gpu_slug, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402


def _commit(arg):
    if arg:
        return arg
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _save(doc, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _open(args, out, run):
    """The result document (``--resume``: the existing one with this run appended)."""
    if args.resume and os.path.exists(out):
        with open(out) as f:
            doc = json.load(f)
        if doc["info"]["device"] != run["info"]["device"] and not args.force:
            raise SystemExit(f"{out} was measured on {doc['info']['device']}, this is "
                             f"{run['info']['device']} (another --out, or --force)")
        redo = set(args.redo)
        doc["results"] = [r for r in doc["results"] if r.get("status") == "ok" and r["key"] not in redo]
    else:
        doc = {"benchmark": "peers", "info": run["info"], "methodology": dict(METHODOLOGY), "runs": [],
               "results": []}
    doc["runs"].append(run)
    doc["commit"] = run["commit"]
    return doc


def _fi_part(point, inputs, ours_out, fi, ws, decode_ps=16):
    """FlashInfer's columns of one point (page size 16: cascade + decode; page size 1: cascade)."""
    tree, sl_host, q, kp, vp, sk, sv, _ = inputs
    rec = {}
    q_t = pfi.to_torch(q)
    heads = (point["heads_q"], point["heads_kv"], point["head_dim"])
    for ps in (decode_ps, 1):
        try:
            layout = paged_layout(tree, sl_host, point["suffix"], ps)
            cache = jax.block_until_ready(build_cache(layout, kp, vp, sk, sv))
            cache_t = pfi.to_torch(cache)
        except Exception as e:  # noqa: BLE001
            for name, _, _ in pfi.specs_for(ps, decode=ps == decode_ps):
                rec[f"{name}_ms"], rec[f"{name}_error"] = "error", f"layout: {type(e).__name__}: {e}"[:400]
            continue
        rec[f"layout_p{ps}"] = {"pages": layout.num_pages, "cascade_why_not": layout.cascade_why_not,
                                "shared_pages_per_seq_min": int(layout.shared_pages_per_seq.min()),
                                "own_tokens": int((layout.own_src >= 0).sum() + (layout.own_suffix >= 0).sum())}
        rec.update(pfi.columns(fi, layout, cache_t, q_t, heads, ours_out, ws,
                               pfi.specs_for(ps, decode=ps == decode_ps)))
        del cache_t, cache
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/peers_<gpu>.json)")
    ap.add_argument("--quick", action="store_true", help="probes, small batch, small GQA, two trees")
    ap.add_argument("--resume", action="store_true", help="keep the points already in --out")
    ap.add_argument("--redo", nargs="*", default=[], metavar="KEY", help="with --resume: measure these again")
    ap.add_argument("--only", nargs="*", default=None, metavar="KEY", help="measure only these point keys")
    ap.add_argument("--paths", action="store_true", help="also every forced leaf / tree schedule of ours")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no new point after this")
    ap.add_argument("--commit", default=None, help="commit measured (when the copy is no git checkout)")
    ap.add_argument("--flashinfer-module", default="flashinfer",
                    help="module with FlashInfer's wrapper API (bench.flashinfer_reference: the torch reference)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--no-overlap", action="store_true",
                    help="measure nothing while FlashInfer compiles (else our columns of the large points)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--interpret", action="store_true",
                    help="with --smoke: our Pallas kernels in interpret mode (else the reference path)")
    ap.add_argument("--force", action="store_true", help="append to a file measured on another device")
    ap.add_argument("--list", action="store_true", help="print the planned point keys and exit")
    args = ap.parse_args(argv)
    t_start = time.time()
    plan = pts.plan_points(args.quick, smoke=args.smoke)
    if args.only is not None:
        plan = [p for p in plan if p["key"] in set(args.only)]
    if args.list:
        for p in plan:
            print(p["key"], ",".join(p["tags"]))
        return {"points": [p["key"] for p in plan]}
    if args.smoke:
        cfg = OursConfig(interpret=True, impl="planned" if args.interpret else "reference", paths=args.paths,
                         n=2, reps=1, unroll=2)
    else:
        cfg = OursConfig(paths=args.paths)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"peers_{gpu_slug()}.json")
    fi, why = (None, "--no-flashinfer") if args.no_flashinfer else pfi.load(args.flashinfer_module)
    info = device_info()      # JAX first: it takes its share of the GPU memory before torch
    ws = None
    if fi is not None:
        import torch  # noqa: PLC0415
        ws = torch.empty(pfi.WORKSPACE_BYTES, dtype=torch.uint8, device=pfi.device())
    bw = measure_copy_bandwidth(1 << 22 if args.smoke else 2 << 30)
    mma = measure_matmul_rate(128 if args.smoke else 8192)
    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:] if argv is None
           else list(argv), "commit": _commit(args.commit), "info": info, "versions": pfi.versions(fi),
           "copy_bw_Bps": bw, "matmul_flops": mma, "config": dataclasses.asdict(cfg),
           "flashinfer": {"available": fi is not None, "reason": why}, "harness": {}}
    run["versions"].update(jax=jax.__version__, driver=(info.get("nvidia_smi") or {}).get("driver_version"))
    doc = _open(args, out, run)
    run_idx = len(doc["runs"]) - 1
    done = {r["key"] for r in doc["results"]}
    todo = [p for p in plan if p["key"] not in done]
    print(f"peers: {len(todo)} of {len(plan)} points to measure -> {out}; device {info['device']}, copy "
          f"{bw / 1e12:.2f} TB/s, matmul {mma / 1e12:.0f} TFLOP/s; FlashInfer: {why or run['versions']}",
          flush=True)
    hq, d = (plan[0]["heads_q"], plan[0]["head_dim"]) if plan else (32, 128)
    run["harness"]["jax_loop_identity"] = harness_ms(jax.numpy.ones((8, hq, d), jax.numpy.bfloat16), cfg)
    if fi is not None:
        run["harness"]["torch_graph_empty_kernel"] = pfi.empty_graph_ms()
    warm = {}
    thread = None
    if fi is not None and todo:
        # nvcc jobs for FlashInfer's build: leave two cores to the JAX host thread timing meanwhile
        os.environ.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 4) - 2)))
        run["flashinfer"]["max_jobs"] = os.environ["MAX_JOBS"]
        heads = {(p["heads_q"], p["heads_kv"], p["head_dim"]) for p in todo}
        thread = threading.Thread(target=pfi.warm_up, args=(fi, heads, ws, warm), daemon=True)
        thread.start()
    _save(doc, out)
    states = {}

    def ours_part(point, during_compile):
        inputs = pts.make_inputs(point, host=args.smoke)
        fl = pts.floor_of(point, inputs[0], inputs[1], bw, mma)
        rec = {k: v for k, v in point.items() if k not in ("forest",)}
        rec.update(fl, run=run_idx, status="partial")
        if point["kind"] == "tree":
            rec["nodes"] = inputs[0].num_nodes
        t0 = time.time()
        r, out_host = measure(point, inputs, cfg, fl["floor_ms"])
        rec.update(r, ours_during_flashinfer_compile=during_compile, ours_wall_s=time.time() - t0)
        return rec, out_host, inputs

    # our columns of the large points while FlashInfer compiles
    overlap = [p for p in todo if thread is not None and not args.no_overlap
               and p["tags"][0] in ("probe", "tree", "two_level")]
    for p in overlap:
        if time.time() - t_start > args.budget_s:
            break
        rec, out_host, _ = ours_part(p, True)
        states[p["key"]] = (rec, out_host)
        doc["results"].append(rec)
        _save(doc, out)
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, (dict, list))})[:600], flush=True)
    if thread is not None:
        thread.join(timeout=max(1.0, args.budget_s - (time.time() - t_start)))
        if thread.is_alive():   # its compile outlasted the budget: no FlashInfer column can run now
            fi, why = None, f"FlashInfer's warm-up (nvcc compile) still running after {time.time() - t_start:.0f} s"
            warm = {"error": why}
        run["flashinfer"]["warm_up"] = warm
        print(f"FlashInfer warm-up: {warm}", flush=True)
    for p in todo:
        if time.time() - t_start > args.budget_s:
            run.setdefault("not_started_budget", []).append(p["key"])
            continue
        if p["key"] in states:   # timed while nvcc loaded the CPU: ours_auto timed again
            rec, out_host = states.pop(p["key"])
            inputs = pts.make_inputs(p, host=args.smoke)
            again = retime_auto(p, inputs, cfg, rec["loop_calls"])
            if isinstance(again, float):
                rec["ours_auto_during_compile_ms"] = rec.get("ours_auto_ms")
                rec["ours_auto_ms"] = again
                for k in [k for k in rec if k.endswith("_source") and rec[k] == "ours_auto"]:
                    rec[k[:-len("_source")] + "_ms"] = again
            else:
                rec["ours_auto_retime_error"] = again
        else:
            rec, out_host, inputs = ours_part(p, False)
            doc["results"].append(rec)
        t0 = time.time()
        if fi is not None:
            rec.update(_fi_part(p, inputs, out_host, fi, ws))
        else:
            rec["flashinfer_skipped"] = why
        del inputs
        rec["fi_wall_s"] = time.time() - t0
        finish_point(rec)
        _save(doc, out)
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, (dict, list))})[:900], flush=True)
    doc["targets"] = summarize(doc)
    run["elapsed_s"] = time.time() - t_start
    _save(doc, out)
    for line in doc["targets"]["lines"]:
        print(line)
    try:
        from bench.peers_plot import plot  # noqa: PLC0415
        png = os.path.splitext(out)[0] + ".png"
        plot(doc, png)
        print("plot:", png)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {type(e).__name__}: {e}")
    return {"out": out, "doc": doc}


if __name__ == "__main__":
    main()
