"""Session 16 probe: where the time of the shared path's gradient goes (forward; prefix
backward kernels; suffix flash backward), and tilings of the prefix backward kernels."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from bench.timing import time_fn, device_info
from bench.shared_prefix_grad import POINTS, make_inputs, grad_fn
from jax_prefix_attn import shared_prefix_attention
from jax_prefix_attn.shared_prefix import row_limits
from pallas_kernels.prefix_attention_bwd import prefix_grads
from pallas_kernels.flash_attention import flash_attention_bwd

CFGS = {
    "def": {},
    "A": dict(block_q=128, block_k=64, num_warps=8, num_stages=3, dkv_block_q=32, dkv_block_k=64, dkv_num_warps=4, dkv_num_stages=3),
    "B": dict(block_q=64, block_k=64, num_warps=4, num_stages=3, dkv_block_q=64, dkv_block_k=128, dkv_num_warps=8, dkv_num_stages=2),
    "C": dict(block_q=128, block_k=32, num_warps=4, num_stages=2, dkv_block_q=64, dkv_block_k=64, dkv_num_warps=4, dkv_num_stages=3),
    "D": dict(block_q=64, block_k=128, num_warps=8, num_stages=2, dkv_block_q=128, dkv_block_k=64, dkv_num_warps=8, dkv_num_stages=2),
}
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
    rec["fwd_ms"] = 1e3 * time_fn(fwd, [args])
    rec["full_grad_ms"] = 1e3 * time_fn(grad_fn("kernels", meta, args), [args])
    suf = jax.jit(lambda q, sk, sv, do, lse, delta: flash_attention_bwd(q, sk, sv, do, lse, delta, causal=True, kv_lengths=sl, sm_scale=scale))
    rec["suffix_bwd_ms"] = 1e3 * time_fn(suf, [(q, sk, sv, do, lse, delta)])
    ref = None
    for name, cfg in CFGS.items():
        try:
            f = jax.jit(lambda q, do, lse, delta, pk, pv, cfg=cfg: prefix_grads(q, do, lse, delta, pk, pv, s2p, lim, plen, scale=scale, **cfg))
            res = f(q, do, lse, delta, pk, pv)
            if ref is None:
                ref = res
            err = max(float(jnp.linalg.norm((a.astype(jnp.float32) - r.astype(jnp.float32)).ravel()) / jnp.linalg.norm(r.astype(jnp.float32).ravel())) for a, r in zip(res, ref))
            rec[f"prefix_bwd_{name}_ms"] = 1e3 * time_fn(f, [(q, do, lse, delta, pk, pv)])
            rec[f"prefix_bwd_{name}_err"] = err
        except Exception as e:
            rec[f"prefix_bwd_{name}_ms"] = f"error {type(e).__name__}: {str(e)[:200]}"
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
    with open(out, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
