"""Per-kernel device times of one shared-path call (or, with ``--tree``, one ``tree_attention``
call per tree workload of ``bench/tree_attention.py``), read with Nsight Compute (GPU only).

Each point's jitted call is run twice (compile, warm-up), then once between two marker kernels
(an XLA ``sin``); ``ncu`` records every kernel's ``gpu__time_duration`` and this script prints
the kernels between the last two markers with their sum, so the XLA glue (layout copies, pads,
the merge) shows next to the Pallas launches.  ``ncu`` serialises kernels, so the sum is an
upper bound of the in-loop time when launches could overlap (they do not in one XLA stream).

    ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \\
        --log-file prof.csv python bench/kernel_profile.py
    python bench/kernel_profile.py --parse prof.csv --out prof.json      (add --tree to both)

``--points B:P:S:HQ ...`` (both steps) profiles those shared-path points instead of the three
probe points (``HKV`` = 8 for ``HQ`` = 32, else 1; ``D`` = 128).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POINTS = [(256, 4096, 128, 32, 8, 128), (512, 8192, 128, 32, 8, 128), (1024, 4096, 128, 32, 8, 128)]


TREE_POINTS = [("apps8", "auto"), ("apps8", "levelwise"), ("tot", "auto"), ("tot", "levelwise"),
               ("spec_t64", "auto")]


def _points(specs):
    """``(B, P, S, Hq, Hkv, D)`` tuples from ``B:P:S:HQ`` strings (``POINTS`` when none)."""
    if not specs:
        return POINTS
    out = []
    for spec in specs:
        b, p, s, hq = (int(x) for x in spec.split(":"))
        out.append((b, p, s, hq, 8 if hq == 32 else 1, 128))
    return out


def _calls(tree: bool, points=POINTS):
    """``[(label, jitted function, args)]`` of the points to profile."""
    import jax
    if not tree:
        from bench.shared_prefix import make_inputs, ours
        for pt in points:
            b, p, s, hq, hkv, d = pt
            yield dict(zip(("batch", "prefix", "suffix", "heads_q", "heads_kv", "head_dim"), pt)), \
                jax.jit(ours("shared")), make_inputs(b, p, s, hkv, hq, d)
        return
    from bench.tree_attention import HQ, HKV, make_case, workloads
    from jax_prefix_attn import auto_path, build_tree_metadata, tree_attention
    wls = {w["name"]: w for w in workloads(False)}
    for name, impl in TREE_POINTS:
        tree, (q, kp, vp, sk, sv, sl) = make_case(wls[name])
        meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0])
        f = jax.jit(lambda q, m, kp, vp, sk, sv, sl, impl=impl: tree_attention(
            q, m, kp, vp, sk, sv, suffix_lengths=sl, impl=impl))
        label = dict(workload=name, impl=impl, path=auto_path(meta, q, sk) if impl == "auto" else impl)
        yield label, f, (q, meta, kp, vp, sk, sv, sl)


def run(tree: bool = False, points=POINTS):
    import jax
    import jax.numpy as jnp
    marker = jax.jit(jnp.sin)
    x = jnp.ones((8,), jnp.float32)
    for label, f, args in _calls(tree, points):
        for _ in range(2):
            jax.block_until_ready(f(*args))
        jax.block_until_ready(marker(x))
        jax.block_until_ready(f(*args))
        jax.block_until_ready(marker(x))
        print("profiled", label, flush=True)


def parse(path, tree: bool = False, points=POINTS):
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels = []  # (id, name, ns)
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        val = float(r["Metric Value"].replace(",", ""))
        ns = val * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
        kernels.append((int(r["ID"]), r["Kernel Name"], ns))
    kernels.sort()
    marks = [i for i, (_, name, _) in enumerate(kernels) if "sine" in name.lower()]
    out = []
    # markers come in pairs per point, after the warm-up calls
    labels = ([dict(workload=w, impl=i) for w, i in TREE_POINTS] if tree else
              [dict(zip(("batch", "prefix", "suffix", "heads_q", "heads_kv", "head_dim"), pt)) for pt in points])
    for pi, label in enumerate(labels):
        if len(marks) < 2 * (pi + 1):
            break
        a, z = marks[2 * pi], marks[2 * pi + 1]
        ks = [dict(name=n[:120], us=ns / 1e3) for _, n, ns in kernels[a + 1:z]]
        out.append(dict(point=label, kernels=ks, total_us=sum(k["us"] for k in ks)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parse")
    ap.add_argument("--out")
    ap.add_argument("--tree", action="store_true", help="tree_attention workloads instead")
    ap.add_argument("--points", nargs="+", default=None, metavar="B:P:S:HQ")
    a = ap.parse_args()
    if not a.parse:
        run(a.tree, _points(a.points))
        return
    res = parse(a.parse, a.tree, _points(a.points))
    for r in res:
        print(r["point"], f"total {r['total_us']:.1f} us")
        for k in r["kernels"]:
            print(f"   {k['us']:8.1f} us  {k['name']}")
    if a.out:
        from bench.timing import device_info  # noqa: PLC0415  (the machine that ran ncu parses too)
        json.dump(dict(device=device_info(), notes=__doc__, results=res), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
