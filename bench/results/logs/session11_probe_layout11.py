"""Session 11 probe: decoding in the queries' own layout, same run, alternating.
# (Run at commit 3dbd5bf with `old = (da.FLAT_DECODE_LAYOUT, dict(da.FLAT_DECODE_TILING), ...)`; FLAT_DECODE_TILING
# became None (the rule) in 3c68d9e, so the archived copy saves it without dict().)
flat: the row-layout kernel (q padded to 16 rows per sequence and kv head, output transposed
back) against the own-layout kernel (suffix_decode_merge with the prefix as a pool span and key
splits) at two tilings; shared (Mosaic GPU path, split suffix): the row-layout split suffix
against the own-layout split suffix merged in XLA.  Per variant: kernels in the compiled entry
computation, time (two alternating loop_time calls), max |diff| against the row layout."""
import json, math, os, re, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from bench.timing import loop_time, device_info
from jax_prefix_attn.shared_prefix import row_limits
import pallas_kernels.decode_attention as da, pallas_kernels.prefix_attention as pa

BUDGET = float(os.environ.get("PROBE_BUDGET", 300))

def make(path, setting):
    def f(q, pk, pv, sk, sv, sl):
        b = q.shape[0]
        s2p = jnp.zeros((b,), jnp.int32)
        lim_p, lim_s = row_limits(1, jnp.full((b,), pk.shape[0], jnp.int32), sl)
        old = (da.FLAT_DECODE_LAYOUT, da.FLAT_DECODE_TILING, pa.SPLIT_SUFFIX_LAYOUT)
        try:
            if path == "flat":
                da.FLAT_DECODE_LAYOUT = setting[0]
                if setting[1]:
                    da.FLAT_DECODE_TILING = setting[1]
                fwd = da.flat_forward
            else:
                pa.SPLIT_SUFFIX_LAYOUT = setting[0]
                fwd = pa.shared_prefix_forward
            o, _ = fwd(q[:, None], pk[None], pv[None], sk, sv, s2p, lim_p, lim_s,
                       scale=1 / math.sqrt(q.shape[-1]))
        finally:
            da.FLAT_DECODE_LAYOUT, da.FLAT_DECODE_TILING, pa.SPLIT_SUFFIX_LAYOUT = old
        return o[:, 0]
    return f

def kernels(f, args):
    txt = jax.jit(f).lower(*args).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return len(re.findall(r"= \S+ (?:fusion|custom-call|copy|transpose)\(", entry))

VARIANTS = {
    "flat": {"rows": ("rows", None), "own32": ("own", dict(block_k=32, num_warps=2, num_stages=3)),
             "own64": ("own", dict(block_k=64, num_warps=4, num_stages=2)),
             "own128": ("own", dict(block_k=128, num_warps=4, num_stages=2))},
    "shared": {"rows": ("rows",), "own": ("own",)},
}
POINTS = [(16, 1024, 64, 8, 1), (16, 1024, 1024, 8, 1), (16, 4096, 1024, 8, 1),
          (16, 1024, 256, 8, 1), (64, 1024, 1024, 8, 1), (16, 16384, 256, 8, 1),
          (16, 1024, 256, 32, 8), (64, 4096, 256, 8, 1), (64, 4096, 256, 32, 8),
          (256, 4096, 64, 8, 1), (1024, 4096, 64, 32, 8), (256, 16384, 1024, 32, 8)]
t0 = time.time()
res = []
for (b, p, s, hq, hkv) in POINTS:
    if time.time() - t0 > BUDGET:
        print("budget reached", flush=True); break
    args = make_inputs(b, p, s, hkv, hq, 128)
    paths = ["flat"] + (["shared"] if b * hkv < pa.MGPU_SUFFIX_SPLIT_BELOW else [])
    for path in paths:
        fns = {k: make(path, v) for k, v in VARIANTS[path].items()}
        ref = jax.jit(fns["rows"])(*args).astype(jnp.float32)
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, path=path, us={}, kernels={}, maxdiff={})
        for k, f in fns.items():
            r["kernels"][k] = kernels(f, args)
            r["maxdiff"][k] = float(jnp.max(jnp.abs(jax.jit(f)(*args).astype(jnp.float32) - ref)))
            r["us"][k] = []
        for _ in range(2):
            for k, f in fns.items():
                r["us"][k].append(loop_time(f, args[0], args[1:]) * 1e6)
        print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), commit="(working tree after 1c0e7df, session 11)",
               results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_layout11.json", "w"), indent=1)
print("\n%-22s %-7s %s" % ("point", "path", "variant: kernels us(mean) ratio-to-rows"))
for r in res:
    base = sum(r["us"]["rows"]) / 2
    cells = ["%s:%d %.1f %.3f" % (k, r["kernels"][k], sum(v) / 2, sum(v) / 2 / base)
             for k, v in r["us"].items()]
    print("%-22s %-7s %s" % ("B%d P%d S%d H%d/%d" % (r["b"], r["p"], r["s"], r["hq"], r["hkv"]),
                             r["path"], " | ".join(cells)))
print("max diff", max(max(r["maxdiff"].values()) for r in res), "elapsed", time.time() - t0)
