# sa_old.py for part A: git show 014ad3a:pallas_kernels/suffix_attention.py > .gpu/sa_old.py
"""Session 10 probe.
A: the suffix kernel's incoming partials read as G real rows (masked load) against the session-9
   module (16-row tiles), on the Triton prefix backend (the fused variant's launch 2), one run.
B: the three auto misses and their neighbours (Hq=8/Hkv=1, P=1K): both paths timed twice,
   alternating, plus the kernels each compiled path launches (entry computation)."""
import json, os, re, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs, ours, floor_s
from bench.timing import loop_time, measure_copy_bandwidth, measure_matmul_rate, device_info
import pallas_kernels.prefix_attention as pa
import pallas_kernels.suffix_attention as sa_new
sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
import sa_old

t0 = time.time()
out_dir = os.environ["OUT"]
res = []
for (b, p, s, hq, hkv) in [(1024, 4096, 64, 32, 8), (256, 4096, 256, 32, 8), (1024, 4096, 256, 8, 1)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    ref = None
    for v in ["new", "old", "new", "old"]:
        pa.suffix_decode_merge = (sa_new if v == "new" else sa_old).suffix_decode_merge
        f = ours("shared", backend="triton")
        out = jax.jit(f)(*args)
        ref = out if ref is None else ref
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        t = loop_time(f, args[0], args[1:]) * 1e3
        r = dict(part="A", b=b, p=p, s=s, hq=hq, variant=v, ms=t, maxdiff=err)
        print(json.dumps(r), flush=True); res.append(r)
pa.suffix_decode_merge = sa_new.suffix_decode_merge

def kernels(f, args):
    txt = jax.jit(f).lower(*args).compile().as_text()
    entry = txt[txt.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = re.findall(r"= \S+ (fusion|custom-call|copy|transpose|while|conditional)\(", entry)
    names = re.findall(r"custom_call_target=\"([^\"]+)\"", entry)
    return txt, dict(fusion=ops.count("fusion"), custom_call=ops.count("custom-call"),
                     other=len(ops) - ops.count("fusion") - ops.count("custom-call"), targets=names)

for (b, p, s, hq, hkv) in [(16, 1024, 64, 8, 1), (16, 1024, 256, 8, 1), (16, 1024, 1024, 8, 1),
                           (64, 1024, 64, 8, 1), (64, 1024, 256, 8, 1), (64, 1024, 1024, 8, 1)]:
    args = make_inputs(b, p, s, hkv, hq, 128)
    for impl in ["shared", "flat"]:
        txt, k = kernels(ours(impl), args)
        open(f"{out_dir}/hlo_{impl}_B{b}_S{s}.txt", "w").write(txt)
        r = dict(part="B-hlo", b=b, p=p, s=s, hq=hq, impl=impl, **k)
        print(json.dumps(r), flush=True); res.append(r)
    for impl in ["shared", "flat", "shared", "flat"]:
        t = loop_time(ours(impl), args[0], args[1:]) * 1e3
        r = dict(part="B", b=b, p=p, s=s, hq=hq, impl=impl, ms=t)
        print(json.dumps(r), flush=True); res.append(r)
json.dump(dict(device=device_info(), results=res, elapsed=time.time() - t0),
          open(out_dir + "/probe_small10.json", "w"), indent=1)
print("elapsed", time.time() - t0)
