"""Session 11 probe: flat decode at Hq=32/Hkv=8 B=16 (128 (sequence, kv head) pairs, 3 key
splits by default), where the grid's run 12 measured the own-layout kernel slower than the row
layout at P>=4K S>=256.  Variants, same run, alternating: row layout; own layout with 128/64/32-
key tiles; own layout 128-key tiles with 6 and 12 splits."""
import json, math, os, re, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from bench.timing import loop_time, device_info
from jax_prefix_attn.shared_prefix import row_limits
import pallas_kernels.decode_attention as da

T = {128: dict(block_k=128, num_warps=4, num_stages=2), 64: dict(block_k=64, num_warps=4, num_stages=2),
     32: dict(block_k=32, num_warps=2, num_stages=3)}
VARIANTS = {"rows": ("rows", None, None), "own128": ("own", 128, None), "own64": ("own", 64, None),
            "own32": ("own", 32, None), "own128_s6": ("own", 128, 6), "own128_s12": ("own", 128, 12),
            "own64_s6": ("own", 64, 6)}

def make(layout, tile, splits):
    def f(q, pk, pv, sk, sv, sl):
        b = q.shape[0]
        lim_p, lim_s = row_limits(1, jnp.full((b,), pk.shape[0], jnp.int32), sl)
        old = da.FLAT_DECODE_TILING
        da.FLAT_DECODE_TILING = T[tile] if tile else None
        try:
            o, _ = da.flat_forward(q[:, None], pk[None], pv[None], sk, sv, jnp.zeros((b,), jnp.int32),
                                   lim_p, lim_s, scale=1 / math.sqrt(q.shape[-1]), layout=layout,
                                   num_splits=splits)
        finally:
            da.FLAT_DECODE_TILING = old
        return o[:, 0]
    return f

t0 = time.time()
res = []
for (b, p, s, hq, hkv) in [(16, 16384, 256, 32, 8), (16, 16384, 64, 32, 8), (16, 4096, 256, 32, 8),
                           (16, 4096, 1024, 32, 8)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    fns = {k: make(*v) for k, v in VARIANTS.items()}
    ref = jax.jit(fns["rows"])(*args).astype(jnp.float32)
    r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, us={k: [] for k in fns}, maxdiff={})
    for k, f in fns.items():
        r["maxdiff"][k] = float(jnp.max(jnp.abs(jax.jit(f)(*args).astype(jnp.float32) - ref)))
    for _ in range(2):
        for k, f in fns.items():
            r["us"][k].append(loop_time(f, args[0], args[1:]) * 1e6)
    print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), commit="(working tree at 3dbd5bf+tiling, session 11)",
               results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_h32b16.json", "w"), indent=1)
for r in res:
    base = sum(r["us"]["rows"]) / 2
    print("B%d P%d S%d H%d/%d  " % (r["b"], r["p"], r["s"], r["hq"], r["hkv"]) + " | ".join(
        "%s %.1f %.2f" % (k, sum(v) / 2, sum(v) / 2 / base) for k, v in r["us"].items()))
print("max diff", max(max(r["maxdiff"].values()) for r in res), "elapsed", time.time() - t0)
