# Run on b690c7d (LOOP_COUNTS already extended to 2048; cap256 restores the session-9 counts).
"""Session 10 probe: run-to-run spread of bench.timing.loop_time at small points, with the
loop's trip count capped at 256 (the session-9 LOOP_COUNTS: ~4 ms timed windows at 16 us per
call) against 2048 (~30 ms windows, as target_s asks).  Five loop_time calls per arm and path,
the arms and paths alternating."""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import jax
from bench.shared_prefix import make_inputs, ours
import bench.timing as bt
from bench.timing import device_info

t0 = time.time()
new_counts = bt.LOOP_COUNTS
old_counts = tuple(c for c in new_counts if c <= 256)
res = []
for (b, p, s, hq, hkv) in [(16, 1024, 1024, 8, 1), (64, 1024, 64, 8, 1), (16, 4096, 64, 8, 1)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fs = {impl: ours(impl) for impl in ("shared", "flat")}
    for rep in range(5):
        for arm, counts in (("cap256", old_counts), ("cap2048", new_counts)):
            bt.LOOP_COUNTS = counts
            for impl in ("shared", "flat"):
                t = bt.loop_time(fs[impl], args[0], args[1:]) * 1e6
                res.append(dict(b=b, p=p, s=s, hq=hq, arm=arm, impl=impl, rep=rep, us=t))
bt.LOOP_COUNTS = new_counts
json.dump(dict(device=device_info(), results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_timing10.json", "w"), indent=1)
print("%-20s %-8s %-7s %7s %7s %7s %7s  %s" % ("point", "arm", "path", "min", "median", "max", "spread", "all"))
keys = []
for r in res:
    k = (r["b"], r["p"], r["s"], r["hq"], r["arm"], r["impl"])
    if k not in keys:
        keys.append(k)
for k in keys:
    ts = [r["us"] for r in res if (r["b"], r["p"], r["s"], r["hq"], r["arm"], r["impl"]) == k]
    print("%-20s %-8s %-7s %7.2f %7.2f %7.2f %6.1f%%  %s" % ("B%d P%d S%d H%d" % k[:4], k[4], k[5], min(ts),
          statistics.median(ts), max(ts), 100 * (max(ts) - min(ts)) / statistics.median(ts),
          " ".join("%.1f" % t for t in ts)))
print("elapsed", time.time() - t0)
