# Run on the working tree of 014ad3a + the masked incoming loads (b690c7d's kernel change; loop_time still capped at 256 calls). Result: the split-rule alternatives were faster at some small points and up to 1.34x slower at long prefixes; none was adopted.
"""Session 10 probe: the flat decode kernel's key splits and tiling at the small grid points.
cur: block_k=128, 2 stages, splits to reach 264 programs (the shipped rule; 128 KB of K/V
buffers, so one program per SM and 264 programs are 2+ waves); t132: splits to reach 132;
wave: the splits minimising waves * (tiles per program + 1) with one program per SM;
bk64: block_k=64, 2 stages (the shipped split rule); shared: the shared path, same run."""
import functools, json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours
from bench.timing import loop_time, device_info
import pallas_kernels.decode_attention as da

cdiv = lambda a, b: -(-a // b)
orig = da.flat_forward

def wave_splits(prog, p, s, bk=128, slots=132):
    best = None
    for n in range(1, 33):
        tiles = cdiv(cdiv(p, n), bk) + cdiv(cdiv(s, n), bk)
        cost = cdiv(prog * n, slots) * (tiles + 1)
        if best is None or cost < best[0]:
            best = (cost, n)
    return best[1]

def variant(v, b, p, s, hkv):
    if v == "cur":
        return orig, da._pick_splits(b * hkv, p + s, 128)
    if v == "t132":
        n = da._pick_splits(b * hkv, p + s, 128, target=132)
    elif v == "wave":
        n = wave_splits(b * hkv, p, s)
    elif v == "bk64":
        return functools.partial(orig, block_k=64), da._pick_splits(b * hkv, p + s, 64)
    return functools.partial(orig, num_splits=n), n

t0 = time.time()
pts = [(16, 1024, 64, 8, 1), (16, 1024, 256, 8, 1), (16, 1024, 1024, 8, 1), (16, 4096, 64, 8, 1),
       (16, 4096, 1024, 8, 1), (16, 16384, 256, 8, 1), (64, 1024, 64, 8, 1), (64, 1024, 1024, 8, 1),
       (64, 4096, 256, 8, 1), (64, 16384, 256, 8, 1), (8, 8192, 128, 8, 1), (128, 2048, 128, 8, 1),
       (200, 2500, 100, 8, 1), (256, 1024, 64, 8, 1), (16, 1024, 256, 32, 8), (16, 4096, 256, 32, 8),
       (16, 16384, 256, 32, 8), (8, 2048, 128, 32, 8), (24, 6000, 200, 32, 8)]
res = []
for (b, p, s, hq, hkv) in pts:
    if time.time() - t0 > float(os.environ.get("PROBE_BUDGET", "300")):
        print("budget reached", flush=True); break
    args = make_inputs(b, p, s, hkv, hq, 128)
    ref = jax.jit(ours("shared"))(*args)
    for v in ["cur", "t132", "wave", "bk64", "shared", "cur", "wave"]:
        if v == "shared":
            f, n = ours("shared"), None
        else:
            fwd, n = variant(v, b, p, s, hkv)
            da.flat_forward = fwd
            f = ours("flat")
        try:
            out = jax.jit(f)(*args)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            t = loop_time(f, args[0], args[1:]) * 1e6
        except Exception as e:
            err, t = None, f"{type(e).__name__}: {e}"[:300]
        da.flat_forward = orig
        r = dict(b=b, p=p, s=s, hq=hq, hkv=hkv, variant=v, splits=n, us=t, maxdiff=err)
        print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), results=res, elapsed=time.time() - t0),
          open(os.environ["OUT"] + "/probe_flat10.json", "w"), indent=1)
print("\n%-22s" % "point" + "".join("%9s" % v for v in ["cur", "t132", "wave", "bk64", "shared", "cur2", "wave2"]))
rows = {}
for r in res:
    rows.setdefault((r["b"], r["p"], r["s"], r["hq"]), []).append(r)
for k, rs in rows.items():
    print("%-22s" % ("B%d P%d S%d H%d" % k) + "".join("%9.1f" % (x["us"] if isinstance(x["us"], float) else -1) for x in rs)
          + "   splits " + " ".join(str(x["splits"]) for x in rs[:4]))
print("elapsed", time.time() - t0)
