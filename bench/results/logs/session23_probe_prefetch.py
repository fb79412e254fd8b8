"""Session 23 probe (ran at commits 9b47c3c and 5882a20, whose ``split_decode_mgpu`` had the
options ``stream_prefetch`` and ``stream_block``; both measured slower and were removed again,
so this script does not run at later commits): the role-split kernel's stream workers with an
L2-prefetch front
(``split_decode_mgpu(stream_prefetch=k)``: the K/V tiles of the step ``stages + k`` ahead asked
into L2, bytes in flight that take no shared memory), in one process, against the default shared
path, at target points that miss 1.5x the floor.

Per point: ``base`` (the default shared path), then for each CTA plan (``plan_roles`` with the
stream rate PLAN_STREAM_BPS at the values in BPS) the split at each prefetch distance in PFS,
with its max |split - base|; with STREAM_ONLY=1 also the stream role alone (``_debug="noprefix"``)
at the plan's stream CTAs, giving the suffix GB/s per stream CTA.  One JSON line per point, a
table last.  Env: COMMIT, BUDGET_S (default 520), POINTS (indices), PFS ("0,2,4,8"), BPS
("5.5e10,1.1e11"), STREAM_ONLY, BLOCKS (stream keys per step, "64"; 128 where it divides S)."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import split_decode_mgpu as sd

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "520"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

POINTS_ALL = [  # (hq, hkv, b, p, s)
    (32, 8, 512, 8192, 128),
    (32, 8, 1024, 4096, 64),
    (32, 8, 1024, 16384, 256),
    (32, 8, 256, 4096, 128),
    (32, 8, 256, 16384, 256),
    (8, 1, 1024, 4096, 256),
    (8, 1, 1024, 16384, 256),
    (32, 8, 1024, 4096, 128),
    (32, 8, 256, 4096, 64),
]
POINTS = [POINTS_ALL[int(i)] for i in os.environ.get("POINTS", "0,1,2,3").split(",")]
PFS = [int(x) for x in os.environ.get("PFS", "0,2,4,8").split(",")]
BPS = [float(x) for x in os.environ.get("BPS", "5.5e10,1.1e11").split(",")]
STREAM_ONLY = os.environ.get("STREAM_ONLY", "0") == "1"
BLOCKS = [int(x) for x in os.environ.get("BLOCKS", "64").split(",")]


def split(n, sp, m, pf, debug="", bs=64):
    def f(q, pk, pv, sk, sv, sl):
        out = sd.split_decode_mgpu(q, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32), sk, sv, sl,
                                   prefix_ctas=n, stream_ctas=m, num_splits=sp,
                                   stream_prefetch=pf, stream_block=bs, _debug=debug)
        return out if not debug else q + (out[:1, :1, :1] * 0).astype(q.dtype)
    return f


bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
rows = []
bps0 = sd.PLAN_STREAM_BPS
for hq, hkv, b, p, s in POINTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(skipped=(hq, b, p, s))), flush=True)
        continue
    d = 128
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    rest = (pk, pv, sk, sv, sl)
    fl = floor_s(b, p, s, hq, hkv, d, bw, mma)[0]
    rec = dict(hq=hq, hkv=hkv, b=b, p=p, s=s, floor_ms=fl * 1e3)
    base_f = ours("shared")
    ref = jax.jit(base_f)(q, *rest).astype(jnp.float32)
    rec["base_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    kv_bytes = 2 * b * s * hkv * d * 2
    plans = []
    for bps in BPS:
        sd.PLAN_STREAM_BPS = bps
        pl_ = sd.plan_roles(b, hq, hkv, p, s, d)
        if pl_ not in plans:
            plans.append(pl_)
    sd.PLAN_STREAM_BPS = bps0
    for (n, sp, m), pf, bs in [(c, pf, bs) for c in plans for bs in BLOCKS for pf in PFS]:
            if time.time() - T0 > BUDGET or s % bs:
                continue
            key = f"n{n}_s{sp}_m{m}_pf{pf}" + (f"_b{bs}" if bs != 64 else "")
            try:
                out = jax.jit(split(n, sp, m, pf, bs=bs))(q, *rest).astype(jnp.float32)
                rec[f"maxdiff_{key}"] = float(jnp.max(jnp.abs(out - ref)))
                rec[f"split_{key}_ms"] = loop_time(split(n, sp, m, pf, bs=bs), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
                if STREAM_ONLY:
                    t = loop_time(split(n, sp, m, pf, "noprefix", bs=bs), q, rest, compiler_options=GRAPH_ALWAYS)
                    rec[f"str_only_{key}_ms"] = t * 1e3
                    rec[f"str_only_{key}_GBps_per_cta"] = kv_bytes / t / m / 1e9
            except Exception as e:  # noqa: BLE001
                rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:600]}"
    rec["base_again_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor base base_again | split ms per key (/floor)")
for r in rows:
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f %.4f %.4f |" % (r["floor_ms"], r["base_ms"], r["base_again_ms"]))
    for k, v in r.items():
        if k.startswith("split_"):
            key = k[6:-3]
            extra = ""
            if f"str_only_{key}_GBps_per_cta" in r:
                extra = " stream-only %.4f ms %.1f GB/s/CTA" % (r[f"str_only_{key}_ms"], r[f"str_only_{key}_GBps_per_cta"])
            print("   %-22s %.4f (%.2fx floor, %.3fx base)%s" % (key, v, v / r["floor_ms"], v / min(r["base_ms"], r["base_again_ms"]), extra))
