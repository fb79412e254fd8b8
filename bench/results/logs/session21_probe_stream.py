"""Session 21 probe: how fast can a few SMs stream the suffix K/V from HBM, and does such a
stream run beside the persistent Mosaic GPU prefix kernel without slowing it?

Session 20's space split ran the (Triton-lowered) suffix kernel beside a persistent prefix
kernel holding n SMs and found it hid at most 35 us of its 100 us.  The open question it left:
can a kernel built to stream on few SMs (a persistent CTA per SM, a deep TMA pipeline) reach
most of the HBM bandwidth on 16-32 SMs?  If it cannot, no space split can pay.

Parts, one process:
  stream_m{m}_r{rows}_s{stages}   a Mosaic GPU kernel with m CTAs, each streaming its share of
      the suffix K and V ([B*S, Hkv*D] views, one (rows x D) box of K and of V per step, tasks
      ordered (b, s-tile, kv head)) through an emit_pipeline with `stages` steps in flight; the
      body does no work.  Reported as TB/s of the bytes read.
  pre_n{n}          the persistent prefix kernel alone on n CTAs (as session 20)
  conc_n{n}_m{m}    both in one jitted step, XLA's concurrent scheduling (CONCURRENT_COMPILER_OPTIONS)
  seq_n{n}_m{m}     the same, default scheduling
One JSON line per part, a table last."""
import json
import os
import time

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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


def stream_call(sk, sv, off, *, m, rows, stages):
    """Read every (rows x D) box of sk/sv [B, S, Hkv, D] once, on m CTAs; returns [m, 128] f32
    (unwritten: only the loads matter).  ``off`` [1] int32 (0 at run time) keeps the call inside
    the timing loop."""
    b, s, hkv, d = sk.shape
    k2 = sk.reshape(b * s, hkv * d)
    v2 = sv.reshape(b * s, hkv * d)
    n_tasks = (b * s // rows) * hkv
    steps = n_tasks // m  # the n_tasks % m left over are not read (counted out of the bytes)

    def body(off_ref, k_ref, v_ref, o_ref):
        c = lax.axis_index("c")
        base = c * steps + off_ref[0]

        def step(idx, k_smem, v_smem):
            del idx, k_smem, v_smem

        def imap(i):
            t = base + i
            return (t // hkv, t % hkv)

        plgpu.emit_pipeline(step, grid=(steps,),
                            in_specs=[plgpu.BlockSpec((rows, d), imap), plgpu.BlockSpec((rows, d), imap)],
                            max_concurrent_steps=stages)(k_ref, v_ref)

    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, 128), jnp.float32), grid=(m,),
                       grid_names=("c",))(off, k2, v2)
    return out, steps * m * rows * d * 2 * 2


def stream_fn(m, rows, stages):
    def f(q, pk, pv, sk, sv, sl):
        off = (q[0, 0, :1] * 0).astype(jnp.int32)
        o, _ = stream_call(sk, sv, off, m=m, rows=rows, stages=stages)
        return q + (o[0, 0] * 0).astype(q.dtype)
    return f


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


def pre_fn(n, s):
    def f(q, pk, pv, sk, sv, sl):
        o, _ = _prefix(q, pk, pv, n, s)
        return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
    return f


def both_fn(n, s, m, rows, stages):
    def f(q, pk, pv, sk, sv, sl):
        o, _ = _prefix(q, pk, pv, n, s)
        off = (q[0, 0, :1] * 0).astype(jnp.int32)
        o2, _ = stream_call(sk, sv, off, m=m, rows=rows, stages=stages)
        return q + (o[0, 0, :1, :1] * 0).astype(q.dtype) + (o2[0, 0] * 0).astype(q.dtype)
    return f


def suf_only(q, pk, pv, sk, sv, sl):
    b, hq, d = q.shape
    o, _ = suffix_decode_merge(q, sk, sv, sl, None, scale=d ** -0.5, **pa.DECODE_SUFFIX_TILING)
    return o.reshape(b, hq, d).astype(q.dtype)


bw = measure_copy_bandwidth()
mma = measure_matmul_rate()
print(json.dumps(dict(copy_bw=bw, matmul=mma)), flush=True)

recs = []


def emit(rec):
    rec["wall_s"] = round(time.time() - T0, 1)
    print(json.dumps(rec), flush=True)
    recs.append(rec)


# Part 1: streaming rate against the number of CTAs (Hq=32/Hkv=8 B=512 S=128: 268 MB).
q, pk, pv, sk, sv, sl = make_inputs(512, 8192, 128, 8, 32, 128)
rest = (pk, pv, sk, sv, sl)
emit(dict(part="suffix_kernel", b=512, s=128, ms=loop_time(suf_only, q, rest, compiler_options=GRAPH_ALWAYS) * 1e3))
for rows, stages in [(64, 6), (64, 4), (128, 3)]:
    for m in [8, 16, 20, 24, 32, 48, 132]:
        if time.time() - T0 > BUDGET * 0.45:
            break
        try:
            nbytes = stream_call(sk, sv, jnp.zeros((1,), jnp.int32), m=m, rows=rows, stages=stages)[1]
            t = loop_time(stream_fn(m, rows, stages), q, rest, compiler_options=GRAPH_ALWAYS)
            emit(dict(part="stream", m=m, rows=rows, stages=stages, ms=t * 1e3, tbps=nbytes / t / 1e12))
        except Exception as e:  # noqa: BLE001
            emit(dict(part="stream", m=m, rows=rows, stages=stages, error=f"{type(e).__name__}: {str(e)[:400]}"))

# Part 2: beside the persistent prefix kernel.
for hq, hkv, b, p, s, sp, cfgs in [(32, 8, 512, 8192, 128, 4, [(112, 20), (116, 16), (108, 24)]),
                                   (32, 8, 256, 16384, 256, 8, [(112, 20), (108, 24)])]:
    if time.time() - T0 > BUDGET:
        break
    q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
    rest = (pk, pv, sk, sv, sl)
    fl = floor_s(b, p, s, hq, hkv, 128, bw, mma)[0]
    rec = dict(part="beside", hq=hq, b=b, p=p, s=s, floor_ms=fl * 1e3)
    rec["base_ms"] = loop_time(ours("shared"), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    rec["pre_n132_ms"] = loop_time(pre_fn(None, sp), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
    for n, m in cfgs:
        if time.time() - T0 > BUDGET:
            break
        try:
            rec[f"pre_n{n}_ms"] = loop_time(pre_fn(n, sp), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            rec[f"stream_m{m}_ms"] = loop_time(stream_fn(m, 64, 6), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
            rec[f"conc_n{n}_m{m}_ms"] = loop_time(both_fn(n, sp, m, 64, 6), q, rest, compiler_options=CONC) * 1e3
            rec[f"seq_n{n}_m{m}_ms"] = loop_time(both_fn(n, sp, m, 64, 6), q, rest, compiler_options=GRAPH_ALWAYS) * 1e3
        except Exception as e:  # noqa: BLE001
            rec[f"error_n{n}"] = f"{type(e).__name__}: {str(e)[:400]}"
    emit(rec)

print("\nstream: m rows stages | ms TB/s")
for r in recs:
    if r["part"] == "stream" and "ms" in r:
        print(r["m"], r["rows"], r["stages"], "| %.4f %.2f" % (r["ms"], r["tbps"]))
for r in recs:
    if r["part"] != "stream":
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
