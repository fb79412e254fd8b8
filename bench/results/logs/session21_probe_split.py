"""Session 21 probe: the shared path split by role across the SMs -- the persistent Mosaic GPU
prefix kernel on n CTAs (``prefix_partials_mgpu(persistent_ctas=n)``) beside the streamed suffix
kernel on m CTAs (``pallas_kernels/suffix_stream_mgpu.py``), then the one XLA merge -- against the
default shared path, in one process.

Per point:
  base          the default shared path                     (GRAPH_ALWAYS)
  base_conc     the same, concurrent scheduling             (CONCURRENT_COMPILER_OPTIONS)
  pre_n{n}_s{s} the persistent prefix kernel alone
  str_m{m}      the streamed suffix kernel alone (+ TB/s of its K/V bytes)
  split_...     prefix || suffix -> merge, concurrent scheduling
  split_seq_... the same, default scheduling
Exactness: max |split - base|.  One JSON line per point, a table last."""
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from jax_prefix_attn.shared_prefix import CONCURRENT_COMPILER_OPTIONS as CONC
from pallas_kernels import prefix_attention as pa
from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels import suffix_stream_mgpu as ss

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)


def _prefix(qm, pk, pv, n, s):
    return pm.prefix_partials_mgpu(qm, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32),
                                   scale=qm.shape[-1] ** -0.5, num_splits=s, persistent_ctas=n,
                                   schedule_barrier=pa.MGPU_SCHEDULE_BARRIER)


WGS, BS = (int(v) for v in os.environ.get("STREAM", "2/64").split("/"))


def split(n, sp, m):
    def f(q, pk, pv, sk, sv, sl):
        b, hq, d = q.shape
        hkv = pk.shape[1]
        g = hq // hkv
        qm, _ = pa._rows_128(q[:, None], hkv, g)
        o_pre, l_pre = _prefix(qm, pk, pv, n, sp)
        o_s, l_s = ss.suffix_stream_mgpu(qm, sk, sv, sl, scale=d ** -0.5, group=g, ctas=m,
                                         wgs=WGS, block_s=BS)
        out, _ = pa._merge_row_parts([(o_pre, l_pre, g), (o_s, l_s, g)], b=b, tq=1, hq=hq, r=g,
                                     dtype=q.dtype, inv=None)
        return out[:, 0]
    return f


def pre_only(n, sp):
    def f(q, pk, pv, sk, sv, sl):
        hkv = pk.shape[1]
        qm, _ = pa._rows_128(q[:, None], hkv, q.shape[1] // hkv)
        o, _ = _prefix(qm, pk, pv, n, sp)
        return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
    return f


def str_only(m):
    def f(q, pk, pv, sk, sv, sl):
        b, hq, d = q.shape
        hkv = pk.shape[1]
        qm, _ = pa._rows_128(q[:, None], hkv, hq // hkv)
        o, _ = ss.suffix_stream_mgpu(qm, sk, sv, sl, scale=d ** -0.5, group=hq // hkv, ctas=m,
                                     wgs=WGS, block_s=BS)
        return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
    return f


# (hq, hkv, b, p, s, [(prefix CTAs n, prefix splits, suffix CTAs m), ...])
POINTS_ALL = [
    (32, 8, 512, 8192, 128, [(114, 8, 18), (112, 4, 20), (108, 4, 24)]),
    (32, 8, 256, 4096, 128, [(103, 8, 29), (112, 8, 20)]),
    (32, 8, 1024, 4096, 128, [(114, 4, 18), (103, 2, 29)]),
    (32, 8, 256, 16384, 256, [(114, 16, 18), (108, 8, 24)]),
    (8, 1, 1024, 4096, 256, [(103, 8, 29), (112, 8, 20)]),
    # 5, 6: more SMs for the stream (run d, three workers)
    (32, 8, 512, 8192, 128, [(100, 4, 32), (104, 4, 28)]),
    (32, 8, 256, 16384, 256, [(108, 8, 24), (100, 8, 32)]),
]
POINTS = [POINTS_ALL[int(i)] for i in os.environ.get("POINTS", "0,1,2,3,4").split(",")]
print(json.dumps(dict(stream_wgs=WGS, stream_block_s=BS)), flush=True)
bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)
rows = []
for hq, hkv, b, p, s, cfgs in POINTS:
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
    rec["base_conc_ms"] = loop_time(base_f, q, rest, compiler_options=CONC) * 1e3
    kv_bytes = 2 * b * s * hkv * d * 2
    for n, sp, m in cfgs:
        if time.time() - T0 > BUDGET:
            break
        key = f"n{n}_s{sp}_m{m}"
        try:
            out = jax.jit(split(n, sp, m))(q, *rest).astype(jnp.float32)
            rec[f"maxdiff_{key}"] = float(jnp.max(jnp.abs(out - ref)))
            rec[f"split_{key}_ms"] = loop_time(split(n, sp, m), q, rest, compiler_options=CONC) * 1e3
            rec[f"split_seq_{key}_ms"] = loop_time(split(n, sp, m), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            rec[f"pre_n{n}_s{sp}_ms"] = loop_time(pre_only(n, sp), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            t = loop_time(str_only(m), q, rest, compiler_options=GRAPH_ALWAYS)
            rec[f"str_m{m}_ms"], rec[f"str_m{m}_tbps"] = t * 1e3, kv_bytes / t / 1e12
        except Exception as e:  # noqa: BLE001
            rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:600]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor base base_conc | best split (key): ms, /floor, /base")
for r in rows:
    sk_ = {k: v for k, v in r.items() if k.startswith("split_n")}
    best = min(sk_, key=sk_.get) if sk_ else None
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f %.4f %.4f |" % (r["floor_ms"], r["base_ms"], r["base_conc_ms"]),
          best, "%.4f %.2f %.3f" % (sk_[best], sk_[best] / r["floor_ms"], sk_[best] / r["base_ms"]) if best else "")
