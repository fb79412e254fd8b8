"""Session 12: auto (cost model as committed; loops compiled with GRAPH_ALWAYS)
out of sample: shapes of session 8's validation set (logs/session8_validate_auto_h200.json, not
in the grid), those where the two paths were within 1.5x of each other first.  Per shape: the
model's choice and both paths timed (loop_time), alternating, twice."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours
from bench.timing import GRAPH_ALWAYS, loop_time, device_info
from jax_prefix_attn.cost_model import estimate

pts = [(8, 2048, 128, 8, 1), (8, 2048, 512, 8, 1), (8, 8192, 128, 8, 1), (8, 8192, 512, 8, 1),
       (32, 2048, 128, 8, 1), (32, 2048, 512, 8, 1), (32, 8192, 128, 8, 1), (32, 8192, 512, 8, 1),
       (48, 3000, 384, 8, 1), (96, 1500, 700, 8, 1), (12, 12000, 64, 8, 1), (40, 1024, 2048, 32, 8),
       (32, 2048, 512, 32, 8), (128, 2048, 512, 8, 1), (32, 2048, 128, 32, 8)]
BUDGET = float(os.environ.get("PROBE_BUDGET", 170))
res = []
t0 = time.time()
for (b, p, s, hq, hkv) in pts:
    if time.time() - t0 > BUDGET:
        print("budget reached", flush=True); break
    args = make_inputs(b, p, s, hkv, hq, 128)
    e = estimate(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=128, groups=1, prefix_len=p,
                 suffix_len=s, itemsize=2)
    r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, auto_choice=e.choice, model_shared_us=e.shared_s * 1e6,
             model_flat_us=e.flat_s * 1e6, shared_us=[], flat_us=[])
    for _ in range(2):
        for impl in ("shared", "flat"):
            r[impl + "_us"].append(loop_time(ours(impl), args[0], args[1:], compiler_options=GRAPH_ALWAYS) * 1e6)
    sh, fl = (sum(r[k]) / 2 for k in ("shared_us", "flat_us"))
    r["auto_over_best"] = (sh if e.choice == "shared" else fl) / min(sh, fl)
    print(json.dumps(r), flush=True)
    res.append(r)
json.dump(dict(device=device_info(), commit="(session 12, see bench/results/shared_prefix_h200.json session12_note)",
               results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/validate_auto12.json", "w"), indent=1)
for r in res:
    print("B%d P%d S%d H%d/%d auto %s shared %.1f flat %.1f -> %.3f" % (
        r["b"], r["p"], r["s"], r["hq"], r["hkv"], r["auto_choice"], sum(r["shared_us"]) / 2,
        sum(r["flat_us"]) / 2, r["auto_over_best"]))
ok = sum(r["auto_over_best"] <= 1.05 for r in res)
print(f"auto within 5%: {ok} of {len(res)}; worst {max(r['auto_over_best'] for r in res):.3f}")
