"""Session 9 probe: (1) the decode suffix kernel alone (no incoming states, as on the
"independent" path) at several (block_k, num_warps, num_stages) tilings and suffix lengths;
(2) the optimised HLO's transpose fusions of the shared path at B=512 P=8K S=128."""
import json, os, sys, time, re
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.timing import loop_time, measure_copy_bandwidth, device_info
from pallas_kernels.suffix_attention import suffix_decode_merge

t0 = time.time()
bw = measure_copy_bandwidth(1 << 30)
print(f"bw {bw/1e12:.2f} TB/s", flush=True)
res = []
# (2) first: cheap
from bench.shared_prefix import make_inputs, ours
for (b, p, s, hq, hkv) in [(512, 8192, 128, 32, 8), (256, 4096, 64, 32, 8), (1024, 4096, 64, 32, 8)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    txt = jax.jit(ours("shared")).lower(*args).compile().as_text()
    fus = [l.strip()[:300] for l in txt.splitlines() if "transpose" in l and "fusion" in l and "=" in l]
    print(f"HLO B{b} P{p} S{s} Hq{hq}:", *fus[:12], sep="\n  ", flush=True)
    res.append(dict(kind="hlo", b=b, p=p, s=s, hq=hq, transpose_fusions=fus[:20]))
tilings = [(32, 2, 3), (64, 2, 3), (64, 4, 3), (64, 4, 2), (16, 2, 3), (32, 4, 3), (32, 1, 3), (128, 4, 2), (16, 1, 2)]
for (b, s, hq, hkv) in [(1024, 64, 32, 8), (256, 64, 32, 8), (512, 128, 32, 8), (256, 256, 32, 8),
                        (1024, 256, 32, 8), (1024, 64, 8, 1), (1024, 256, 8, 1), (256, 64, 8, 1)]:
    ks = jax.random.split(jax.random.PRNGKey(b + s), 3)
    q = jax.random.normal(ks[0], (b, hq, 128), jnp.bfloat16)
    sk = jax.random.normal(ks[1], (b, s, hkv, 128), jnp.bfloat16)
    sv = jax.random.normal(ks[2], (b, s, hkv, 128), jnp.bfloat16)
    sl = jnp.full((b,), s, jnp.int32)
    nbytes = 2 * b * s * hkv * 128 * 2
    ref = None
    for bk, w, st in tilings:
        if bk > s:
            continue
        f = lambda q, sk, sv, sl, bk=bk, w=w, st=st: suffix_decode_merge(
            q, sk, sv, sl, None, scale=128 ** -0.5, block_k=bk, num_warps=w, num_stages=st)[0]
        try:
            out = jax.jit(f)(q, sk, sv, sl)
            ref = out if ref is None else ref
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, q, (sk, sv, sl))
            r = dict(kind="suffix", b=b, s=s, hq=hq, tiling=[bk, w, st], us=t * 1e6,
                     tbps=nbytes / t / 1e12, frac_copy=nbytes / t / bw, maxdiff=err)
        except Exception as e:
            r = dict(kind="suffix", b=b, s=s, hq=hq, tiling=[bk, w, st], error=str(e)[:300])
        print(json.dumps(r), flush=True)
        res.append(r)
json.dump(dict(device=device_info(), bw=bw, results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_suffix.json", "w"), indent=1)
print("\n%-22s %-12s %8s %6s" % ("point", "tiling", "us", "TB/s"))
for r in res:
    if r["kind"] == "suffix" and "us" in r:
        print("%-22s %-12s %8.1f %6.2f" % (f"B{r['b']} S{r['s']} Hq{r['hq']}", r["tiling"], r["us"], r["tbps"]))
