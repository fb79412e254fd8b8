"""Session 20 probe: can the shared path overlap its prefix (tensor cores) and suffix (HBM)
parts by *space*, with a persistent Mosaic GPU prefix kernel that holds only ``n`` SMs
(``prefix_partials_mgpu(persistent_ctas=n)``) and the suffix kernel running beside it on the
others (XLA's concurrent command-buffer scheduling, ``jpa.CONCURRENT_COMPILER_OPTIONS``)?

Per point, in one process (GRAPH_ALWAYS loops as in bench/shared_prefix.py):
  base       the default shared path                       (GRAPH_ALWAYS)
  base_conc  the same, concurrent scheduling               (CONCURRENT_COMPILER_OPTIONS)
  suf        the suffix kernel alone (+ a small reshape)
  pre_n{n}_s{s}   the persistent prefix kernel alone (+ a small reshape), n CTAs, s splits
  pers_n{n}_s{s}  gather -> persistent prefix || suffix -> one XLA merge, concurrent scheduling
  pers_seq_...    the same, default scheduling (sequential)
Exactness: max |pers - base| per point.  One JSON line per point, a table last."""
import json
import os
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from jax_prefix_attn.shared_prefix import CONCURRENT_COMPILER_OPTIONS as CONC
from pallas_kernels import prefix_attention as pa
from pallas_kernels import prefix_attention_mgpu as pm
from pallas_kernels.decode_attention import rows_from_q
from pallas_kernels.suffix_attention import suffix_decode_merge

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)


def _prefix(q, pk, pv, n, s):
    b, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm = rows_from_q(q[:, None], hkv, g)
    m = b * g
    m128 = -(-m // 128) * 128
    qm = jnp.pad(qm, ((0, 0), (0, m128 - m), (0, 0))) if m128 > m else qm
    return pm.prefix_partials_mgpu(qm, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32),
                                   scale=d ** -0.5, num_splits=s, persistent_ctas=n,
                                   schedule_barrier=pa.MGPU_SCHEDULE_BARRIER)


def pers(n, s):
    def f(q, pk, pv, sk, sv, sl):
        b, hq, d = q.shape
        hkv = pk.shape[1]
        g = hq // hkv
        o_pre, l_pre = _prefix(q, pk, pv, n, s)
        ss = pa.mgpu_suffix_splits(b, hkv, sk.shape[1])
        out, _ = pa._independent_merge(q[:, None], sk, sv, sl[:, None], o_pre, l_pre, b=b, hq=hq,
                                       hkv=hkv, d=d, r=g, r2=g, scale=d ** -0.5, interpret=False,
                                       suffix_splits=ss)
        return out[:, 0]
    return f


def pre_only(n, s):
    def f(q, pk, pv, sk, sv, sl):
        b, hq, d = q.shape
        o, _ = _prefix(q, pk, pv, n, s)
        hkv = pk.shape[1]
        return jnp.swapaxes(o[0, :, :b * (hq // hkv)].reshape(hkv, b, hq // hkv, d), 0, 1).reshape(b, hq, d)
    return f


def suf_only(q, pk, pv, sk, sv, sl):
    b, hq, d = q.shape
    o, _ = suffix_decode_merge(q, sk, sv, sl, None, scale=d ** -0.5, **pa.DECODE_SUFFIX_TILING)
    return o.reshape(b, hq, d).astype(q.dtype)


# (hq, hkv, b, p, s, [(persistent CTAs, splits), ...])
POINTS = [
    (32, 8, 512, 8192, 128, [(132, 4), (112, 4), (96, 4), (112, 8)]),
    (32, 8, 256, 16384, 256, [(132, 8), (112, 8), (96, 8)]),
    (8, 1, 1024, 4096, 256, [(132, 8), (112, 8), (96, 8)]),
    (32, 8, 1024, 16384, 256, [(112, 4), (96, 4)]),
    (32, 8, 256, 4096, 128, [(112, 4), (96, 8)]),
]
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
    ref = jax.jit(base_f)(q, *rest)
    rec["base_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    rec["base_conc_ms"] = loop_time(base_f, q, rest, compiler_options=CONC) * 1e3
    rec["suf_ms"] = loop_time(suf_only, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    for n, sp in cfgs:
        if time.time() - T0 > BUDGET:
            break
        key = f"n{n}_s{sp}"
        try:
            out = jax.jit(pers(n, sp))(q, *rest)
            rec[f"maxdiff_{key}"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            rec[f"pre_{key}_ms"] = loop_time(pre_only(n, sp), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            rec[f"pers_{key}_ms"] = loop_time(pers(n, sp), q, rest, compiler_options=CONC) * 1e3
            rec[f"pers_seq_{key}_ms"] = loop_time(pers(n, sp), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor base base_conc suf | best pers (key): ms, /floor, /base")
for r in rows:
    pk_ = {k: v for k, v in r.items() if k.startswith("pers_n")}
    best = min(pk_, key=pk_.get) if pk_ else None
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f %.4f %.4f %.4f |" % (r["floor_ms"], r["base_ms"], r["base_conc_ms"], r["suf_ms"]),
          best, "%.4f %.2f %.3f" % (pk_[best], pk_[best] / r["floor_ms"], pk_[best] / r["base_ms"]) if best else "")
