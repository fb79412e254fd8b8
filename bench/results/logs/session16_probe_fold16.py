"""Session 16 probe b: the prefix backward's dQ kernel with the GQA heads folded into its rows
(default) against one program per query head; the whole gradient with the default."""
import json, os, sys
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from bench.timing import time_fn, device_info
from bench.shared_prefix_grad import POINTS, make_inputs, grad_fn
from jax_prefix_attn import shared_prefix_attention
from jax_prefix_attn.shared_prefix import row_limits
from pallas_kernels.prefix_attention_bwd import prefix_grads

out = sys.argv[1]
with open(out, "w") as fh:
    fh.write(json.dumps({"header": device_info()}) + "\n")
for pt in POINTS:
    b, tq, p, s, hq, hkv, d, g = pt
    args, meta = make_inputs(b, tq, p, s, hq, hkv, d, g)
    q, pk, pv, sk, sv = args
    sl, s2p, plen, w = meta["sl"], meta["s2p"], meta["plen"], meta["w"]
    scale = 1 / np.sqrt(d)
    fwd = jax.jit(lambda *a: shared_prefix_attention(*a, suffix_lengths=sl, prefix_lengths=plen, seq_to_prefix=s2p, return_lse=True, impl="shared"))
    o, lse = fwd(*args)
    do = w.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1)
    lim, _ = row_limits(tq, plen[s2p], sl)
    rec = dict(point=pt)
    fs = {name: jax.jit(lambda q, do, lse, delta, pk, pv, fold=fold: prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale, fold_heads=fold))
          for name, fold in (("fold", True), ("nofold", False))}
    res = {n: f(q, do, lse, delta, pk, pv) for n, f in fs.items()}
    rec["fold_vs_nofold_err"] = max(float(jnp.linalg.norm((a.astype(jnp.float32) - r.astype(jnp.float32)).ravel()) / jnp.linalg.norm(r.astype(jnp.float32).ravel())) for a, r in zip(res["fold"], res["nofold"]))
    for rnd in range(3):  # interleaved
        for n, f in fs.items():
            rec.setdefault(f"prefix_bwd_{n}_ms", []).append(1e3 * time_fn(f, [(q, do, lse, delta, pk, pv)], iters=30))
    for n in fs:
        rec[f"prefix_bwd_{n}_ms"] = sorted(rec[f"prefix_bwd_{n}_ms"])[1]
    rec["fold_over_nofold"] = rec["prefix_bwd_fold_ms"] / rec["prefix_bwd_nofold_ms"]
    rec["full_grad_ms"] = 1e3 * time_fn(grad_fn("kernels", meta, args), [args], iters=30)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
    with open(out, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
