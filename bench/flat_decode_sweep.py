"""Tuning sweep of the flat own-layout decode (``flat_own``) at small batch: every key split count
and tiling, timed like ``bench/peers.py``'s small points, to calibrate the planner's split rule
(the device's ``flat_own_min_split_keys`` / ``flat_own_max_splits``,
``jax_prefix_attn.leaf_plans.tuning``).

Points: B in {1, 8, 16, 32} x P in {1K, 4K, 16K}, S = 64 (full suffixes), Hq/Hkv 32/8 and 8/1,
D = 128, bf16.  Per point: ``num_splits`` in {1, 2, 4, 8, 16, 32, 64} where every split holds
keys (else it runs a smaller count's work plus idle programs) with at most 8 programs per SM,
times the device's ``flat_tiles`` tilings (:func:`tilings`), plus the planner's own leaf
(``planned``).  Each runs through the public entry point with a forced plan:
``plan_shared_prefix(path="flat_own")`` with its chunk's leaf replaced by
``FlatOwn(num_splits, tiling)`` (``shared_prefix_attention(plan=)`` runs exactly that leaf).

Each configuration: ``us`` per call from :func:`bench.timing.loop_time` (dependent calls in one
jitted loop, 8 calls per iteration, one CUDA graph per body: ``GRAPH_ALWAYS``, as ``peers.py``'s
``ours_auto_u8``); ``us_net`` minus the identity body's cost at the same query shape
(``harness``); ``maxabs_vs_reference`` against ``impl="reference"`` (once per configuration);
``launches``: kernels of one call in its optimized HLO (GPU only).  Order: the planned tiling of
every split count at every point first (B ascending), then the other tilings; ``--budget-s``
starts nothing new after that many seconds, every result is saved as it lands, ``--resume``
continues a file.  ``summary``: per point the best and the planned configuration; ``rule_fit``:
for candidate (min keys per split, max splits) the geometric mean over points of the rule's
measured time over the best (``approx``: points where the rule's split count or tiling was not
measured and the nearest measured one stood in).

    python bench/flat_decode_sweep.py --budget-s 180 --commit SHA      # GPU
    python bench/flat_decode_sweep.py --smoke --out /tmp/sweep.json     # CPU, interpret mode
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.e2e_common import commit_of_checkout  # noqa: E402
from bench.peers_ours import loop_calls  # noqa: E402
from bench.timing import GRAPH_ALWAYS, device_info, gpu_slug, is_oom, loop_time  # noqa: E402
from jax_prefix_attn import leaf_plans as lp  # noqa: E402
from jax_prefix_attn import plan_shared_prefix, shared_prefix_attention  # noqa: E402
from jax_prefix_attn.device import planning_device_info  # noqa: E402
from jax_prefix_attn.plans import ChunkPlan, FlatOwn, Shapes  # noqa: E402
from pallas_kernels._common import split_chunk  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 64)
HEADS = ((32, 8), (8, 1))
BATCHES, PREFIXES, SUFFIX, HEAD_DIM = (1, 8, 16, 32), (1024, 4096, 16384), 64, 128
MAX_PROGRAMS_PER_SM = 8
RULE_KEYS, RULE_MAX = (32, 64, 128, 256, 512, 1024), (None, 4, 8, 16, 32, 64)
# (smoke mode times the last of the device's tilings only: the one for the most programs)
SMOKE = dict(heads=((4, 2),), batches=(1, 2), prefixes=(40,), suffix=8, head_dim=16,
             splits=(2,))
NO_LAUNCH = frozenset(("parameter", "constant", "bitcast", "tuple", "get-tuple-element", "call",
                       "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"))


def tilings(dev) -> tuple:
    """The tilings the sweep times on ``dev``: its ``flat_tiles`` (``leaf_plans.flat_tilings``),
    the planner's choices for the flat own-layout decode."""
    return tuple(t for _, t in lp.flat_tilings(dev))


def kernel_launches(hlo: str) -> int:
    """Kernels one call launches by its optimized HLO text: instructions of the entry computation
    and of the computations it ``call``s (command buffers), except those that launch nothing
    (parameters, constants, bitcasts, tuples, the calls themselves)."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name and (m := re.match(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*?\b([a-z][\w\-]*)\((.*)$", line)):
            called = re.search(r"to_apply=%?([\w.\-]+)", m.group(2)) if m.group(1) == "call" else None
            comps[name].append((m.group(1), called.group(1) if called else None))

    def count(c):
        return sum(count(sub) if op == "call" and sub in comps else int(op not in NO_LAUNCH)
                   for op, sub in comps.get(c, ()))
    return count(entry)


def point_key(hq, hkv, d, b, p, s):
    return f"hq{hq}:hkv{hkv}:d{d}:b{b}:p{p}:s{s}"


def config_key(pt, n, t):
    return f"{point_key(*pt)}:n{n}:k{t.block_k}w{t.num_warps}s{t.num_stages}"


def point_shapes(pt):
    hq, hkv, d, b, p, s = pt
    return Shapes(b, 1, hq, hkv, d, 1, p, s, "bfloat16")


def point_plan(pt, dev, interpret=False, **kw):
    """``plan_shared_prefix`` of point ``pt = (Hq, Hkv, D, B, P, S)`` (one prefix, bf16, Tq=1)."""
    hq, hkv, d, b, p, s = pt
    return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                              prefix_len=p, suffix_len=s, dtype=jnp.bfloat16, device=dev,
                              interpret=interpret, **kw)


def configs(points, splits, tilings, dev):
    """``[(point, n, tiling, planned)]`` in sweep order: each point's planned tiling, then the rest."""
    first, rest = [], []
    for pt in points:
        _, hkv, _, b, p, s = pt
        leaf = point_plan(pt, dev, path="flat_own").chunks[0].leaf
        for n in sorted(set(splits) | {leaf.num_splits}):
            for t in tilings + tuple(x for x in (leaf.tiling,) if x not in tilings):
                planned = (n, t) == (leaf.num_splits, leaf.tiling)
                fits = n == 1 or (lp.busy_splits(p, s, n, t.block_k) == n
                                  and b * hkv * n <= MAX_PROGRAMS_PER_SM * dev.sm_count)
                if planned or (n in splits and fits):
                    phase = first if planned or t == lp.flat_own_tiling(point_shapes(pt), n) else rest
                    phase.append((pt, n, t, planned))
    return first + rest


def make_inputs(pt, seed=0):
    hq, hkv, d, b, p, s = pt
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    shapes = ((b, hq, d), (p, hkv, d), (p, hkv, d), (b, s, hkv, d), (b, s, hkv, d))
    q, pk, pv, sk, sv = (jax.random.normal(k, sh, jnp.bfloat16) for k, sh in zip(ks, shapes))
    return q, (pk, pv, sk, sv, jnp.full((b,), s, jnp.int32))


def call_fn(plan, interpret):
    """``(q [B, Hq, D], pk, pv, sk, sv, sl) -> out [B, Hq, D]`` running ``plan``."""
    def f(q, pk, pv, sk, sv, sl):
        return shared_prefix_attention(q[:, None], pk, pv, sk, sv, suffix_lengths=sl, plan=plan,
                                       interpret=interpret)[:, 0]
    return f


def measure(pt, n, tiling, planned, ref, inputs, dev, args, harness_us):
    """One configuration's record: the forced leaf checked against ``ref`` and timed."""
    hq, hkv, d, b, p, s = pt
    interp = args.smoke
    # the forced leaf: the planner's flat_own plan with its one chunk's leaf replaced
    plan = dataclasses.replace(point_plan(pt, dev, interp, path="flat_own"),
                               chunks=(ChunkPlan(0, 1, FlatOwn(n, tiling)),))
    rec = dict(key=config_key(pt, n, tiling), point=point_key(*pt), heads_q=hq, heads_kv=hkv,
               head_dim=d, batch=b, prefix=p, suffix=s, splits=n,
               tiling=dataclasses.asdict(tiling), planned=planned,
               planned_tiling=tiling == lp.flat_own_tiling(point_shapes(pt), n),
               programs=b * hkv * n,
               keys_per_split=split_chunk(p, n, tiling.block_k),
               empty_splits=n - lp.busy_splits(p, s, n, tiling.block_k))
    fn = call_fn(plan, interp)
    q, rest = inputs
    try:
        compiled = jax.jit(fn).lower(q, *rest).compile()
        on_gpu = jax.default_backend() == "gpu" and not interp
        rec["launches"] = kernel_launches(compiled.as_text()) if on_gpu else None
        out = np.asarray(compiled(q, *rest), np.float32)
        rec["maxabs_vs_reference"] = float(np.max(np.abs(out - ref)))
        bytes_ = 4 * b * (p + s) * hkv * d
        rec["loop_calls"] = n_calls = args.calls or loop_calls(max(bytes_ / 3e12, 15e-6))
        rec["us"] = loop_time(fn, q, rest, compiler_options=GRAPH_ALWAYS, n=n_calls,
                              reps=args.reps, unroll=args.unroll) * 1e6
        rec["us_net"] = rec["us"] - harness_us
        rec["status"] = "ok" if rec["maxabs_vs_reference"] <= args.tol else "mismatch"
    except Exception as e:  # noqa: BLE001 - recorded, the next configuration runs
        rec["status"] = "X" if is_oom(e) else "error"
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    return rec


def summarize(results, dev):
    """Per point the best and the planned configuration; the split rule's fit (module doc)."""
    by_point = {}
    for r in results:
        if r.get("status") == "ok":
            by_point.setdefault(r["point"], []).append(r)
    points, fits = {}, []
    tuned = lp.tuning(dev)
    for key, rs in by_point.items():
        best = min(rs, key=lambda r: r["us"])
        planned = next((r for r in rs if r["planned"]), None)
        points[key] = dict(best=best["key"], best_us=best["us"], best_splits=best["splits"],
                           best_tiling=best["tiling"], best_keys_per_split=best["keys_per_split"],
                           planned=planned and planned["key"], planned_us=planned and planned["us"],
                           planned_over_best=planned and planned["us"] / best["us"])
    for k in RULE_KEYS:
        for m in RULE_MAX:
            logs, approx, worst = [], 0, 1.0
            for key, rs in by_point.items():
                r0 = rs[0]
                pt = tuple(r0[f] for f in ("heads_q", "heads_kv", "head_dim", "batch", "prefix",
                                           "suffix"))
                leaf = lp.flat_own_leaf(point_shapes(pt), dev, min_split_keys=k, max_splits=m)
                n, t = leaf.num_splits, dataclasses.asdict(leaf.tiling)
                cands = [r for r in rs if r["tiling"] == t] or rs
                pick = min(cands, key=lambda r: (abs(math.log2(r["splits"] / n)), r["us"]))
                approx += pick["splits"] != n or pick["tiling"] != t
                ratio = pick["us"] / points[key]["best_us"]
                logs.append(math.log(ratio))
                worst = max(worst, ratio)
            if logs:
                fits.append(dict(min_split_keys=k, max_splits=m, approx=approx, worst=worst,
                                 geomean_over_best=math.exp(sum(logs) / len(logs)),
                                 current=(k, m) == (tuned.flat_own_min_split_keys,
                                                    tuned.flat_own_max_splits)))
    fits.sort(key=lambda f: (f["geomean_over_best"], f["worst"], not f["current"]))
    return dict(points=points, rule_fit=fits, recommended=fits[0] if fits else None)


def _save(doc, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="default bench/results/flat_decode_sweep_<gpu>.json")
    ap.add_argument("--budget-s", type=float, default=180.0, help="start nothing new after this")
    ap.add_argument("--commit", default=None, help="commit measured (a copy without .git)")
    ap.add_argument("--resume", action="store_true", help="keep the configurations already in --out")
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--prefixes", type=int, nargs="*", default=None)
    ap.add_argument("--heads", nargs="*", default=None, metavar="HQ/HKV")
    ap.add_argument("--splits", type=int, nargs="*", default=None)
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=None, help="fixed calls per timed loop")
    ap.add_argument("--tol", type=float, default=3e-2, help="max |ours - reference| of an ok point")
    ap.add_argument("--smoke", action="store_true", help="tiny points, Pallas interpret mode (CPU)")
    args = ap.parse_args(argv)
    t0 = time.time()
    sm = SMOKE if args.smoke else dict(heads=HEADS, batches=BATCHES, prefixes=PREFIXES,
                                      suffix=SUFFIX, head_dim=HEAD_DIM, splits=SPLITS)
    if args.smoke:
        args.unroll, args.reps, args.calls = 2, 1, args.calls or 2
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads] if args.heads else sm["heads"]
    points = [(hq, hkv, sm["head_dim"], b, p, sm["suffix"]) for b in args.batches or sm["batches"]
              for p in args.prefixes or sm["prefixes"] for hq, hkv in heads]
    dev = planning_device_info()   # (off the GPU: the H100 SXM the interpret-mode plans target)
    timed = tilings(dev)[-1:] if args.smoke else tilings(dev)
    todo = configs(points, tuple(args.splits or sm["splits"]), timed, dev)
    info = device_info()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"flat_decode_sweep_{gpu_slug()}.json")
    run = dict(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               argv=list(argv or sys.argv[1:]), commit=args.commit or commit_of_checkout(),
               budget_s=args.budget_s, planned_for=dev.name,
               versions=dict(jax=jax.__version__, jaxlib=info["jaxlib"],
                             driver=(info.get("nvidia_smi") or {}).get("driver_version")))
    doc = dict(benchmark="flat_decode_sweep", schema=1, info=info, runs=[], harness={}, results=[])
    if args.resume and os.path.exists(out):
        with open(out) as f:
            doc = json.load(f)
        if doc["info"]["device"] != info["device"]:
            raise SystemExit(f"{out} was measured on {doc['info']['device']}, this is {info['device']}")
        doc["results"] = [r for r in doc["results"] if r["status"] == "ok"]
    doc["runs"].append(run)
    doc["commit"] = run["commit"]
    done = {r["key"] for r in doc["results"]}
    print(f"flat_decode_sweep: {len(todo)} configurations, {len(done)} done -> {out}; {info['device']}",
          flush=True)
    refs, inputs = {}, {}
    for pt, n, tiling, planned in todo:
        key = config_key(pt, n, tiling)
        if key in done:
            continue
        if time.time() - t0 > args.budget_s:
            run.setdefault("not_started_budget", []).append(key)
            continue
        if pt not in inputs:
            inputs.clear()   # one point's arrays on the device at a time
            inputs[pt] = make_inputs(pt)
        q, rest = inputs[pt]
        shape = f"{q.shape[0]}x{q.shape[1]}x{q.shape[2]}"
        if shape not in doc["harness"]:
            doc["harness"][shape] = 1e6 * loop_time(lambda x: x, q, (), compiler_options=GRAPH_ALWAYS,
                                                    n=args.calls or 256, reps=args.reps,
                                                    unroll=args.unroll)
        if pt not in refs:
            ref_fn = call_fn(point_plan(pt, dev, impl="reference"), False)
            refs[pt] = np.asarray(jax.jit(ref_fn)(q, *rest), np.float32)
        rec = measure(pt, n, tiling, planned, refs[pt], inputs[pt], dev, args, doc["harness"][shape])
        rec["run"] = len(doc["runs"]) - 1
        doc["results"].append(rec)
        _save(doc, out)
        print(json.dumps({k: v for k, v in rec.items() if k not in ("tiling", "point")})[:400],
              flush=True)
    doc["summary"] = summarize(doc["results"], dev)
    run["elapsed_s"] = time.time() - t0
    _save(doc, out)
    nan = float("nan")
    for key, pnt in doc["summary"]["points"].items():
        print(f"{key}: best {pnt['best_us']:.2f} us ({pnt['best'].split(':', 6)[-1]}), planned "
              f"{pnt['planned_us'] or nan:.2f} us ({pnt['planned_over_best'] or nan:.3f}x)")
    fit = doc["summary"]["recommended"]
    print("rule_fit best:", fit and {k: fit[k] for k in ("min_split_keys", "max_splits",
                                                         "geomean_over_best", "worst", "approx")})
    return doc


if __name__ == "__main__":
    main()
