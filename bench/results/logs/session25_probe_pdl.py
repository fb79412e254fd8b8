"""Session 25 probe: XLA's programmatic dependent launch (``xla_gpu_enable_pdl``) on the
timing loops of the shared and flat paths.  With PDL, XLA launches its own fusions (the merge,
the loop's query update) with the programmatic-serialization attribute and a
``griddepcontrol.wait`` at their start, so a fusion can be resident before the kernel it
follows has drained.  Per point, each path is compiled under ``GRAPH_ALWAYS`` plus
``xla_gpu_enable_pdl`` False and True and timed A B A B in one process (``loop_time``); the
outputs of the two compilations are compared (a race would show as a difference).
Env: COMMIT, BUDGET_S (default 500), P (point indices).
Ran once (session 25, H200, log ``session25_probe_pdl1_h200.jsonl``):
``COMMIT=55a44d0 BUDGET_S=480 python3 bench/results/logs/session25_probe_pdl.py`` (the point list
then spelled Hkv=8 of the seventh point as ``16 // 2``)."""
import json
import os
import time

import jax
import numpy as np

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "500"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
jdir = os.path.dirname(jax.__file__)
hits = os.popen(f"grep -rIl -i 'pdl' {jdir} --include=*.py | head -20").read().split()
print(json.dumps(dict(jax_py_files_mentioning_pdl=hits)), flush=True)
POINTS = [  # (hq, hkv, b, p, s, impls)
    (8, 1, 1024, 4096, 256, ("shared",)), (8, 1, 256, 16384, 1024, ("shared",)),
    (8, 1, 1024, 16384, 256, ("shared",)), (32, 8, 1024, 16384, 256, ("shared",)),
    (8, 1, 256, 4096, 64, ("shared",)), (8, 1, 256, 16384, 256, ("shared",)),
    (32, 8, 256, 4096, 64, ("shared",)), (8, 1, 1024, 4096, 64, ("shared",)),
    (32, 8, 16, 1024, 64, ("shared", "flat")), (8, 1, 64, 1024, 64, ("shared", "flat")),
    (8, 1, 16, 4096, 256, ("shared", "flat")), (8, 1, 16, 4096, 1024, ("shared", "flat")),
    (32, 8, 256, 4096, 256, ("shared",)), (8, 1, 256, 16384, 64, ("shared",)),
]
PTS = [POINTS[int(i)] for i in os.environ.get("P", ",".join(map(str, range(len(POINTS))))).split(",") if i]
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
OPTS = {"off": dict(GRAPH_ALWAYS, xla_gpu_enable_pdl=False),
        "on": dict(GRAPH_ALWAYS, xla_gpu_enable_pdl=True)}
rows = []
for hq, hkv, b, p, s, impls in PTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    rest = (pk, pv, sk, sv, sl)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0] * 1e3
    for impl in impls:
        f = ours(impl)
        rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, impl=impl, floor_ms=fl)
        try:
            outs = {k: np.asarray(jax.jit(f, compiler_options=o)(q, *rest), np.float32)
                    for k, o in OPTS.items()}
            rec["maxdiff_on_off"] = float(np.max(np.abs(outs["on"] - outs["off"])))
            ts = {"off": [], "on": []}
            for _ in range(2):
                for k, o in OPTS.items():
                    ts[k].append(loop_time(f, q, rest, compiler_options=o) * 1e3)
            rec.update({f"{k}_ms": v for k, v in ts.items()})
            rec["on_over_off"] = min(ts["on"]) / min(ts["off"])
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(rec)
        print(json.dumps(rec), flush=True)
print(f"{'hq':>3} {'b':>5} {'p':>6} {'s':>5} {'impl':>6} {'floor':>7} {'off(best)':>9} {'on(best)':>9} {'on/off':>6} {'diff':>8}")
for r in rows:
    if "error" in r:
        print(r["hq"], r["b"], r["p"], r["s"], r["impl"], "ERROR", r["error"][:120])
        continue
    print(f"{r['hq']:>3} {r['b']:>5} {r['p']:>6} {r['s']:>5} {r['impl']:>6} {r['floor_ms']:7.4f} "
          f"{min(r['off_ms']):9.4f} {min(r['on_ms']):9.4f} {r['on_over_off']:6.3f} {r['maxdiff_on_off']:8.1e}")
print(f"wall {time.time() - T0:.0f} s")
