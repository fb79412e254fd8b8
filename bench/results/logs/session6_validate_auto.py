"""Session 6: auto (cost model) out of sample -- grid shapes not in bench/shared_prefix.py's
grid, plus the two grid points whose choice changed with the cost-model fix after the run."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, device_info
from jax_prefix_attn.cost_model import choose_path

pts = [(256, 1024, 256, 8, 1), (256, 1024, 1024, 8, 1),
       (32, 2048, 128, 8, 1), (128, 2048, 128, 8, 1), (128, 8192, 512, 8, 1), (512, 2048, 128, 8, 1),
       (32, 2048, 512, 8, 1), (32, 8192, 64, 32, 8), (128, 2048, 512, 32, 8), (128, 8192, 128, 32, 8),
       (32, 512, 128, 32, 8), (512, 2048, 2048, 8, 1)]
res = []
t0 = time.time()
for (b, p, s, hq, hkv) in pts:
    if time.time() - t0 > 200:
        break
    args = make_inputs(b, p, s, hkv, hq, 128)
    r = dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv,
             auto_choice=choose_path(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=128, groups=1,
                                     prefix_len=p, suffix_len=s, itemsize=2))
    for impl in ("shared", "flat", "auto"):
        r[impl + "_ms"] = loop_time(ours(impl), args[0], args[1:]) * 1e3
    r["auto_over_best"] = r["auto_ms"] / min(r["shared_ms"], r["flat_ms"])
    print(json.dumps(r), flush=True)
    res.append(r)
json.dump(dict(device=device_info(), results=res), open(os.environ["OUT"] + "/validate_auto.json", "w"), indent=1)
ok = sum(r["auto_over_best"] <= 1.05 for r in res)
print(f"auto within 5%: {ok} of {len(res)}; worst {max(r['auto_over_best'] for r in res):.3f}")
for r in res:
    print("B%-4d P%-5d S%-4d H%-2d choice %-6s shared %.4f flat %.4f auto %.4f (%.2f)" % (
        r["batch"], r["prefix"], r["suffix"], r["heads_q"], r["auto_choice"], r["shared_ms"], r["flat_ms"],
        r["auto_ms"], r["auto_over_best"]))
