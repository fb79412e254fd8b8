"""Session 22 probe: the one-launch role split (``pallas_kernels/split_decode_mgpu.py``: persistent
prefix CTAs beside self-issuing suffix-stream CTAs, then one XLA merge) against the default
shared path, in one process, at the issue's target points that miss 1.5x the floor.

Per point: ``base`` (the default shared path, GRAPH_ALWAYS), then each (prefix CTAs n, prefix
splits, stream CTAs m) in CONFIGS (or, without them, the 4 best of a rough model:
t_pre = rounds x per-task flops at 5.5e14/132 FLOP/s per SM, t_str = suffix bytes / (m x R_SM)),
each with its max |split - base|.  One JSON line per point, a table last.
Env: COMMIT, BUDGET_S (default 500), POINTS (indices), R_SM (stream bytes/s per CTA, 6.5e10)."""
import json
import math
import os
import time

import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import split_decode_mgpu as sd

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "500"))
R_SM = float(os.environ.get("R_SM", "6.5e10"))
SMS = 132
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)

# (hq, hkv, b, p, s, fixed configs or None)
POINTS_ALL = [
    (32, 8, 512, 8192, 128, None),
    (32, 8, 256, 4096, 128, None),
    (32, 8, 1024, 4096, 128, None),
    (32, 8, 256, 4096, 64, None),
    (32, 8, 1024, 4096, 64, None),
    (32, 8, 256, 16384, 256, None),
    (32, 8, 1024, 16384, 256, None),
    (8, 1, 1024, 16384, 256, None),
    (32, 8, 1024, 4096, 256, None),    # 8-11: more large-batch points (call 5)
    (32, 8, 1024, 16384, 64, None),
    (8, 1, 1024, 4096, 64, None),
    (8, 1, 1024, 4096, 256, None),
]
POINTS = [POINTS_ALL[int(i)] for i in os.environ.get("POINTS", "0,1,2,3,4,5").split(",")]


def model_configs(hq, hkv, b, p, s, d=128, k=4):
    g = hq // hkv
    m_blocks = math.ceil(b * g / 128)
    n_tiles = p // 128
    s_bytes = 2 * b * s * hkv * d * 2
    cands = []
    for splits in (1, 2, 4, 8, 16):
        if n_tiles % splits:
            continue
        tasks = hkv * m_blocks * splits
        t_task = 4.0 * 128 * (p // splits) * d / (5.5e14 / SMS) + 1.5e-6
        for rounds in range(1, 64):
            n = math.ceil(tasks / rounds)    # the fewest prefix CTAs for this many rounds
            if n > SMS - 8:
                continue
            if n < 64:
                break
            m = SMS - n
            t = max(rounds * t_task, s_bytes / (m * R_SM))
            cands.append((t, n, splits, m))
    cands.sort()
    out, seen = [], set()
    for t, n, sp, m in cands:   # distinct n
        if n in seen:
            continue
        seen.add(n)
        out.append((n, sp, m, t))
        if len(out) == k:
            break
    return out


DEBUG = os.environ.get("DEBUG", "")   # e.g. "streamfirst"
SWGS = int(os.environ.get("STREAM_WGS", "3"))   # stream workers per CTA (session 22, call 8)


def split(n, sp, m, debug=""):
    debug = debug + DEBUG
    def f(q, pk, pv, sk, sv, sl):
        out = sd.split_decode_mgpu(q, pk, pv, jnp.full((1,), pk.shape[0], jnp.int32), sk, sv, sl,
                                   prefix_ctas=n, stream_ctas=m, num_splits=sp, _debug=debug,
                                   stream_wgs=SWGS)
        return out if not debug else q + (out[:1, :1, :1] * 0).astype(q.dtype)
    return f


def stream_alone(m):
    """Session 21's streamed suffix kernel (memory warpgroup + 3 workers) on m CTAs alone."""
    from pallas_kernels import prefix_attention as pa
    from pallas_kernels import suffix_stream_mgpu as ss

    def f(q, pk, pv, sk, sv, sl):
        b, hq, d = q.shape
        hkv = pk.shape[1]
        qm, _ = pa._rows_128(q[:, None], hkv, hq // hkv)
        o, _ = ss.suffix_stream_mgpu(qm, sk, sv, sl, scale=d ** -0.5, group=hq // hkv, ctas=m, wgs=3)
        return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
    return f


ROLES = os.environ.get("ROLES", "0") == "1"
K = int(os.environ.get("K", "4"))


print(json.dumps(dict(sm_count=getattr(jax.devices()[0], "core_count", None), debug=DEBUG,
                      stream_wgs=SWGS)), flush=True)
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
    if os.environ.get("CONFIGS"):   # "n/splits/m,n/splits/m"
        cfgs = [tuple(int(x) for x in c.split("/")) for c in os.environ["CONFIGS"].split(",")]
    cfgs = cfgs or model_configs(hq, hkv, b, p, s, k=K)
    for n, sp, m, *t_model in cfgs:
        if time.time() - T0 > BUDGET:
            break
        key = f"n{n}_s{sp}_m{m}"
        try:
            out = jax.jit(split(n, sp, m))(q, *rest).astype(jnp.float32)
            rec[f"maxdiff_{key}"] = float(jnp.max(jnp.abs(out - ref)))
            rec[f"split_{key}_ms"] = loop_time(split(n, sp, m), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            if t_model:
                rec[f"model_{key}_ms"] = t_model[0] * 1e3
            if ROLES:   # each role alone in the same launch geometry; session 21's stream kernel
                kv_bytes = 2 * b * s * hkv * d * 2
                rec[f"pre_only_{key}_ms"] = loop_time(split(n, sp, m, "nostream"), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
                t = loop_time(split(n, sp, m, "noprefix"), q, rest, compiler_options=GRAPH_ALWAYS)
                rec[f"str_only_{key}_ms"], rec[f"str_only_{key}_tbps"] = t * 1e3, kv_bytes / t / 1e12
                t = loop_time(stream_alone(m), q, rest, compiler_options=GRAPH_ALWAYS)
                rec[f"s21_stream_m{m}_ms"], rec[f"s21_stream_m{m}_tbps"] = t * 1e3, kv_bytes / t / 1e12
        except Exception as e:  # noqa: BLE001
            rec[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:600]}"
    rec["base_again_ms"] = loop_time(base_f, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    rows.append(rec)

print("\nhq b p s | floor base base_again | best split (key): ms, /floor, /base")
for r in rows:
    sk_ = {k: v for k, v in r.items() if k.startswith("split_n")}
    best = min(sk_, key=sk_.get) if sk_ else None
    print(r["hq"], r["b"], r["p"], r["s"], "| %.4f %.4f %.4f |" % (r["floor_ms"], r["base_ms"], r["base_again_ms"]),
          best, "%.4f %.2f %.3f" % (sk_[best], sk_[best] / r["floor_ms"], sk_[best] / min(r["base_ms"], r["base_again_ms"])) if best else "")
