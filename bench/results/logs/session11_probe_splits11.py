"""Session 11 probe: key splits and tiles of the own-layout flat decode kernel at small
(latency-bound) points, where JAX's gqa (16 key splits of 64-key tiles over materialised KV) is
faster than our flat path at Hq=8 B=16 P=1K.  Same run, alternating: default (splits with chunks
>= 256 keys, tiling by rule); chunks >= 128 keys with 64-key tiles; chunks >= 64 keys with
32-key tiles; 2x the default splits with 64-key tiles; and gqa."""
import json, math, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, flat_gqa
from bench.timing import loop_time, device_info
from jax_prefix_attn.shared_prefix import row_limits
import pallas_kernels.decode_attention as da

T64 = dict(block_k=64, num_warps=4, num_stages=2)
T32 = dict(block_k=32, num_warps=2, num_stages=3)
T64w2 = dict(block_k=64, num_warps=2, num_stages=3)

def make(split_bk, tiling, mult=1):
    def f(q, pk, pv, sk, sv, sl):
        b, hkv = q.shape[0], pk.shape[1]
        lim_p, lim_s = row_limits(1, jnp.full((b,), pk.shape[0], jnp.int32), sl)
        ns = da._pick_splits(b * hkv, pk.shape[0] + sk.shape[1], split_bk) * mult
        old = da.FLAT_DECODE_TILING
        da.FLAT_DECODE_TILING = tiling
        try:
            o, _ = da.flat_forward(q[:, None], pk[None], pv[None], sk, sv, jnp.zeros((b,), jnp.int32),
                                   lim_p, lim_s, scale=1 / math.sqrt(q.shape[-1]), layout="own",
                                   num_splits=ns)
        finally:
            da.FLAT_DECODE_TILING = old
        return o[:, 0]
    return f

VARIANTS = {"default": (128, None), "c128_t64": (64, T64), "c64_t32": (32, T32),
            "x2_t64": (128, T64, 2), "c128_t64w2": (64, T64w2)}
POINTS = [(16, 1024, 64, 8, 1), (16, 1024, 256, 8, 1), (16, 1024, 1024, 8, 1), (16, 4096, 64, 8, 1),
          (16, 4096, 256, 8, 1), (64, 1024, 256, 8, 1), (16, 1024, 64, 32, 8), (16, 1024, 256, 32, 8),
          (16, 16384, 256, 8, 1)]
t0 = time.time()
res = []
for (b, p, s, hq, hkv) in POINTS:
    if time.time() - t0 > float(os.environ.get("PROBE_BUDGET", 240)):
        print("budget reached", flush=True); break
    args = make_inputs(b, p, s, hkv, hq, 128)
    q, pk, pv, sk, sv, sl = args
    fns = {k: make(*v) for k, v in VARIANTS.items()}
    k_full = jnp.concatenate([jnp.broadcast_to(pk[None], (b,) + pk.shape), sk], axis=1)
    v_full = jnp.concatenate([jnp.broadcast_to(pv[None], (b,) + pv.shape), sv], axis=1)
    lens = jnp.full((b,), p + s, jnp.int32)
    ref = jax.jit(fns["default"])(*args).astype(jnp.float32)
    r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, us={k: [] for k in list(fns) + ["gqa"]}, maxdiff={})
    for k, f in fns.items():
        r["maxdiff"][k] = float(jnp.max(jnp.abs(jax.jit(f)(*args).astype(jnp.float32) - ref)))
    for _ in range(2):
        for k, f in fns.items():
            r["us"][k].append(loop_time(f, args[0], args[1:]) * 1e6)
        r["us"]["gqa"].append(loop_time(flat_gqa, q, (k_full, v_full, lens)) * 1e6)
    print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), commit="9a08139", results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_splits11.json", "w"), indent=1)
for r in res:
    base = sum(r["us"]["default"]) / 2
    print("B%d P%d S%d H%d/%d  " % (r["b"], r["p"], r["s"], r["hq"], r["hkv"]) + " | ".join(
        "%s %.1f %.2f" % (k, sum(v) / 2, sum(v) / 2 / base) for k, v in r["us"].items()))
print("max diff", max(max(r["maxdiff"].values()) for r in res), "elapsed", time.time() - t0)
