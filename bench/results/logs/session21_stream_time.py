"""Session 21: what bounds the streamed suffix kernel's speed -- timing-only variants (``_debug``:
no length reads, no math at all; the first run (commit 51a72a4) also had no cross-warp reductions
and no P V, and passed the same array as K and V, so its TB/s count bytes that half came from L2)
against the real kernel, at Hq=32/Hkv=8 B=512 S=128 (268 MB of suffix K/V), on m CTAs; and the
Triton-lowered suffix kernel the shared path uses, on the whole GPU."""
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp
from bench.timing import GRAPH_ALWAYS, device_info, loop_time
from pallas_kernels import prefix_attention as pa
from pallas_kernels import suffix_stream_mgpu as ss
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
q = jnp.asarray(np.random.default_rng(0).standard_normal((512, 32, 128)), jnp.bfloat16)
sk = jnp.asarray(np.random.default_rng(1).standard_normal((512, 128, 8, 128)), jnp.bfloat16)
sv = jnp.asarray(np.random.default_rng(2).standard_normal((512, 128, 8, 128)), jnp.bfloat16)
sl = jnp.full((512,), 128, jnp.int32)
rows = []
CFGS = [tuple(int(v) for v in c.split("/")) for c in os.environ.get("CFGS", "2/64").split(",")]
# block_s < 0: two workers with their own reduction scratch (separate_scratch=True, no token)
for m in [int(x) for x in os.environ.get("CTAS", "24,132").split(",")]:
  for wgs, bs in CFGS:
    for dbg in os.environ.get("VARIANTS", ",nolen,nomath,nomath+nolen").split(","):
        def fn(q, sk, sv, sl, m=m, dbg=dbg, wgs=wgs, bs=bs):
            qm, _ = pa._rows_128(q[:, None], 8, 4)
            o, _ = ss.suffix_stream_mgpu(qm, sk, sv, sl, scale=0.1, group=4, ctas=m, wgs=wgs,
                                         block_s=abs(bs), separate_scratch=bs < 0, _debug=dbg)
            return q + (o[0, 0, :1, :1] * 0).astype(q.dtype)
        try:
            t = loop_time(fn, q, (sk, sv, sl), compiler_options=GRAPH_ALWAYS)
            r = dict(m=m, wgs=wgs, bs=bs, debug=dbg, ms=t * 1e3, tbps=2 * sk.size * 2 / t / 1e12)
        except Exception as e:  # noqa: BLE001
            r = dict(m=m, wgs=wgs, bs=bs, debug=dbg, error=f"{type(e).__name__}: {str(e)[-300:]}")
        print(json.dumps(r), flush=True)
        rows.append(r)
from pallas_kernels.suffix_attention import suffix_decode_merge


def triton_suffix(q, sk, sv, sl):
    o, _ = suffix_decode_merge(q, sk, sv, sl, None, scale=0.1, **pa.DECODE_SUFFIX_TILING)
    return o.reshape(q.shape).astype(q.dtype)


t = loop_time(triton_suffix, q, (sk, sv, sl), compiler_options=GRAPH_ALWAYS)
rows.append(dict(m="all", debug="triton suffix kernel", ms=t * 1e3, tbps=2 * sk.size * 2 / t / 1e12))
print(json.dumps(rows[-1]), flush=True)
print("\nm wgs bs debug | ms TB/s")
for r in rows:
    print(r["m"], r.get("wgs"), r.get("bs"), r["debug"] or "-", "| %.4f %.2f" % (r["ms"], r["tbps"]) if "ms" in r else r["error"][:100])
