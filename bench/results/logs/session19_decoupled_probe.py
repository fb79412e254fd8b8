"""Session 19 probe: the decoupled one-launch decode kernel (a 4th warpgroup streams the suffix
with swapped products beside the prefix pipeline; ``pallas_kernels/decoupled_decode_mgpu.py``)
against the default shared path, on the GPU: (1) exactness against float64 NumPy with random
suffix lengths and NaN past them, (2) interleaved timing at the issue-4 probes and the grid
points that miss 1.5x the floor, GRAPH_ALWAYS loops as in bench/shared_prefix.py.
Output: one JSON line per case, a table last."""
import json
import os
import statistics
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from bench.shared_prefix import floor_s, make_inputs, ours
from bench.timing import GRAPH_ALWAYS, device_info, loop_time, measure_copy_bandwidth, measure_matmul_rate
from pallas_kernels import prefix_attention as pa
from pallas_kernels import decoupled_decode_mgpu as dd

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "450"))
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)


def decoupled(q, pk, pv, sk, sv, sl, **kw):
    """q [B, Hq, D] -> out [B, Hq, D] through the decoupled kernel and one XLA merge.
    ``_nozero=True`` (timing only, inexact with NaN past the lengths): trace the kernel without
    its zeroing of suffix V rows past a length."""
    if kw.pop("_nozero", False):
        saved = dd._zero_rows_past
        dd._zero_rows_past = lambda *a, **k: None
        try:
            return decoupled(q, pk, pv, sk, sv, sl, **kw)
        finally:
            dd._zero_rows_past = saved
    b, hq, d = q.shape
    hkv = pk.shape[1]
    g = hq // hkv
    qm, _ = pa._rows_128(q[:, None], hkv, g)
    p_len = jnp.full((1,), pk.shape[0], jnp.int32)
    o_pre, l_pre, o_suf, l_suf = dd.decoupled_decode_mgpu(qm, pk, pv, p_len, sk, sv, sl,
                                                          scale=d ** -0.5, group=g, **kw)
    os_, ls_ = dd.suffix_rows(o_suf, l_suf, batch=b, group=g)
    out, _ = pa._merge_row_parts([(o_pre, l_pre, g), (os_, ls_, g)], b=b, tq=1, hq=hq, r=g,
                                 dtype=q.dtype, inv=None)
    return out[:, 0]


def ref_np(q, pk, pv, p_len, sk, sv, sl, scale):
    q = np.asarray(q.astype(jnp.float32), np.float64)
    pk, pv, sk, sv = (np.asarray(x.astype(jnp.float32), np.float64) for x in (pk, pv, sk, sv))
    b, hq, d = q.shape
    g = hq // pk.shape[1]
    out = np.zeros((b, hq, d))
    for i in range(b):
        k = np.concatenate([pk[:p_len], sk[i, :sl[i]]])
        v = np.concatenate([pv[:p_len], sv[i, :sl[i]]])
        for h in range(hq):
            s = k[:, h // g] @ q[i, h] * scale
            e = np.exp(s - s.max())
            out[i, h] = e @ v[:, h // g] / e.sum()
    return out


# (1) exactness: random lengths, NaN in the suffix cache past them
CHECKS = [(40, 8, 2, 64, 256, 128), (70, 32, 8, 128, 1024, 256), (33, 8, 1, 128, 512, 192)]
for (b, hq, hkv, d, p, s) in CHECKS[:int(os.environ.get("CHECKS", "3"))]:
    rng = np.random.default_rng(b)
    q, pk, pv, sk, sv, _ = make_inputs(b, p, s, hkv, hq, d, seed=b)
    sl = rng.integers(0, s + 1, b)
    sl[0], sl[-1] = s, 0
    mask = np.arange(s)[None, :, None, None] >= sl[:, None, None, None]
    skn = jnp.where(jnp.asarray(mask), jnp.nan, sk).astype(sk.dtype)
    svn = jnp.where(jnp.asarray(mask), jnp.nan, sv).astype(sv.dtype)
    rec = dict(check=[b, hq, hkv, d, p, s])
    try:
        o = jax.jit(decoupled)(q, pk, pv, skn, svn, jnp.asarray(sl, jnp.int32))
        ro = ref_np(q, pk, pv, p, sk, sv, sl, d ** -0.5)
        o = np.asarray(o.astype(jnp.float32), np.float64)
        rec.update(rel=float(np.linalg.norm(o - ro) / np.linalg.norm(ro)), finite=bool(np.isfinite(o).all()))
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    print(json.dumps(rec), flush=True)

bw, mma = measure_copy_bandwidth(), measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)

POINTS = [(256, 4096, 128, 32, 8), (512, 8192, 128, 32, 8), (1024, 4096, 128, 32, 8),
          (256, 4096, 64, 32, 8), (1024, 4096, 64, 32, 8), (256, 16384, 256, 32, 8),
          (1024, 4096, 64, 8, 1), (1024, 4096, 256, 8, 1), (256, 16384, 256, 8, 1),
          (256, 16384, 64, 8, 1), (1024, 16384, 256, 32, 8), (256, 16384, 1024, 8, 1)]
POINTS = json.loads(os.environ["POINTS"]) if "POINTS" in os.environ else POINTS
VARIANTS = json.loads(os.environ.get("VARIANTS", '{"dec": {}}'))
RECS = []
for b, p, s, hq, hkv in POINTS:
    if time.time() - T0 > BUDGET:
        print(json.dumps(dict(stopped="budget", at=[b, p, s, hq, hkv])), flush=True)
        break
    d = 128
    fl, _, _ = floor_s(b, p, s, hq, hkv, d, bw, mma)
    rec = dict(batch=b, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv, floor_ms=fl * 1e3)
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, d)
    fns = {"shared": ours("shared")}
    for name, kw in VARIANTS.items():
        fns[name] = (lambda kw: lambda q, pk, pv, sk, sv, sl: decoupled(q, pk, pv, sk, sv, sl, **kw))(kw)
    times = {k: [] for k in fns}
    try:
        base = jax.jit(fns["shared"])(q, pk, pv, sk, sv, sl).astype(jnp.float32)
        for k in list(fns)[1:]:
            try:
                o = jax.jit(fns[k])(q, pk, pv, sk, sv, sl).astype(jnp.float32)
                rec[k + "_maxdiff"] = float(jnp.max(jnp.abs(o - base)))
            except Exception as e:  # noqa: BLE001
                rec[k + "_error"] = f"{type(e).__name__}: {str(e)[:600]}"
                del fns[k], times[k]
        for _ in range(2):
            for k, f in fns.items():
                times[k].append(loop_time(f, q, (pk, pv, sk, sv, sl), compiler_options=GRAPH_ALWAYS))
        for k, v in times.items():
            rec[k + "_ms"] = statistics.median(v) * 1e3
            rec[k + "_over_floor"] = rec[k + "_ms"] / rec["floor_ms"]
            rec[k + "_over_shared"] = rec[k + "_ms"] / rec["shared_ms"]
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    rec["wall_s"] = round(time.time() - T0, 1)
    RECS.append(rec)
    print(json.dumps(rec), flush=True)
    del q, pk, pv, sk, sv, sl

print("point (Hq/Hkv B P S) | shared/floor | " + " | ".join(f"{k}/floor {k}/shared" for k in VARIANTS))
for r in RECS:
    row = f"{r['heads_q']}/{r['heads_kv']} {r['batch']} {r['prefix']} {r['suffix']} | {r.get('shared_over_floor', float('nan')):.2f} | "
    row += " | ".join(f"{r.get(k + '_over_floor', float('nan')):.2f} {r.get(k + '_over_shared', float('nan')):.3f}" for k in VARIANTS)
    print(row)
