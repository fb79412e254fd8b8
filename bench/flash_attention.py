"""Benchmark: Pallas flash attention (ours) vs cuDNN, XLA and JAX's deprecated Pallas ``mha``.

Causal bf16 attention, ``B=4, T=4096, H=32, D=128`` and ``B=1, T=16384``: forward and
forward+backward TFLOP/s of

* ``ours``: :func:`pallas_kernels.flash_attention.flash_attention` (Triton lowering);
* ``mgpu``: :func:`pallas_kernels.flash_attention_mgpu_vjp.flash_attention_mgpu_vjp` (Mosaic
  GPU forward :func:`pallas_kernels.flash_attention_mgpu.flash_attention_mgpu`, and in the
  forward+backward timing the Mosaic GPU backward kernels);
* ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention(implementation=...)``;
* ``mha``: deprecated ``jax.experimental.pallas.ops.gpu.attention.mha`` (default blocks;
  top-left causal, identical to ours for square causal attention).

FLOP convention: forward = ``4 * B * H * T * T * D / 2`` for causal (two matmuls, half the
scores); forward+backward = 3.5 x forward (2 forward matmuls + 5 backward matmuls, the
recomputation of ``S`` counted).  Times are medians after warm-up (``bench.timing.time_fn``)
rotating two input sets.  Errors (OOM, missing API) are recorded, not fatal.

``--sweep 128,64,256`` first times tile configurations of our kernel per head_dim (written to
the JSON) and uses the best D=128 one for the comparison (``-128``: a short D=128 list); without it the defaults of
:func:`pallas_kernels.flash_attention.default_config` are used.

Usage: ``python bench/flash_attention.py --out bench/results/flash_attention_h200.json [--quick] [--sweep 128]``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import device_info, time_fn  # noqa: E402
from pallas_kernels.flash_attention import FlashConfig, KernelTiles, default_config, flash_attention  # noqa: E402
from pallas_kernels.flash_attention_mgpu_vjp import flash_attention_mgpu_vjp  # noqa: E402

SHAPES = [dict(b=4, t=4096, h=32, d=128), dict(b=1, t=16384, h=32, d=128)]


def fwd_flops(b, t, h, d, causal=True):
    f = 4 * b * h * t * t * d
    return f / 2 if causal else f


def make_inputs(shape, n_sets=2, dtype=jnp.bfloat16):
    sets = []
    for i in range(n_sets):
        ks = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        dims = (shape["b"], shape["t"], shape["h"], shape["d"])
        sets.append(tuple(jax.random.normal(kk, dims, jnp.float32).astype(dtype) for kk in ks))
    return sets  # (q, k, v, dout)


def impl_fns(config: FlashConfig | None):
    """name -> forward function ``(q, k, v) -> out`` (causal)."""
    def ours(q, k, v):
        return flash_attention(q, k, v, causal=True, config=config)[0]

    def mgpu(q, k, v):
        return flash_attention_mgpu_vjp(q, k, v, causal=True)[0]

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as jattn  # noqa: PLC0415
        return jattn.mha(q, k, v, segment_ids=None, sm_scale=1.0 / math.sqrt(q.shape[-1]),
                         causal=True)

    return {"ours": ours, "mgpu": mgpu, "cudnn": cudnn, "xla": xla, "mha": mha}


def time_fwd_bwd(fn, sets, iters):
    fwd = jax.jit(fn)
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
    t_f = time_fn(fwd, [s[:3] for s in sets], warmup=3, iters=iters)
    t_fb = None
    try:
        t_fb = time_fn(fwd_bwd, sets, warmup=2, iters=iters)
    except Exception as e:  # noqa: BLE001
        return t_f, None, f"{type(e).__name__}: {str(e)[:300]}"
    return t_f, t_fb, None


# Candidate tiles (block_q, block_k, num_warps, num_stages) per head_dim and kernel.
SWEEP = {
    128: {"fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3),
                  (256, 128, 8, 2), (128, 128, 8, 2)],
          "dkv": [(32, 64, 4, 3), (32, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2), (16, 64, 4, 3),
                  (32, 64, 4, 4), (64, 64, 8, 3)],
          "dq": [(128, 32, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                 (128, 32, 8, 4)]},
    # Short list: the front-runners of the full D=128 sweep (for a final confirming run).
    -128: {"fwd": [(128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 8, 3)],
           "dkv": [(32, 64, 4, 3), (32, 64, 4, 4)],
           "dq": [(128, 64, 8, 3), (128, 32, 8, 3)]},
    64: {"fwd": [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
         "dkv": [(32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3)],
         "dq": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)]},
    256: {"fwd": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 2)],
          "dkv": [(32, 64, 4, 2), (32, 32, 4, 3), (64, 64, 8, 2), (16, 64, 4, 2)],
          "dq": [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)]},
}


def sweep(d, iters, log):
    """Time tile configurations of our kernel for head_dim ``d`` (causal bf16, B=4, T=4096,
    H*D = 4096); each kernel is tuned with the others at their best so far.

    Returns (records, best FlashConfig)."""
    cands = SWEEP[d]
    d = abs(d)
    shape = dict(b=4, t=4096, h=4096 // d, d=d)
    sets = make_inputs(shape)
    best = default_config(d, jnp.bfloat16)
    flops = fwd_flops(**shape)
    results = {"shape": shape}

    def time_cfg(part, cfg):
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True, config=cfg)[0]  # noqa: E731
        if part == "fwd":
            t = time_fn(jax.jit(fn), [x[:3] for x in sets], warmup=2, iters=iters)
            return t, dict(ms=t * 1e3, tflops=flops / t / 1e12)
        f = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
        t = time_fn(f, sets, warmup=2, iters=iters)
        return t, dict(fwd_bwd_ms=t * 1e3, tflops=3.5 * flops / t / 1e12)

    for part in ("fwd", "dkv", "dq"):
        best_t, best_cfg = None, best
        results[part] = []
        for bq, bk, w, s in cands[part]:
            cfg = dataclasses.replace(best, **{part: KernelTiles(bq, bk, w, s)})
            rec = dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
            try:
                t, info = time_cfg(part, cfg)
                rec.update(info)
                if best_t is None or t < best_t:
                    best_t, best_cfg = t, cfg
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            results[part].append(rec)
            log(f"sweep d={d} {part} {rec}")
        best = best_cfg
    return results, best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="first shape only, fewer iterations")
    ap.add_argument("--sweep", default="", help="comma-separated head_dims to tune first, e.g. 128,64,256;"
                    " the comparison then uses the tuned D=128 config")
    args = ap.parse_args()
    iters = 5 if args.quick else 20
    t_start = time.time()
    log = lambda msg: print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731

    result = {"device": device_info(), "dtype": "bfloat16", "causal": True,
              "flop_convention": "fwd = 4*B*H*T*T*D/2 (causal); fwd+bwd = 3.5 x fwd",
              "timing": "median of jitted calls after warm-up, 2 rotating input sets",
              "runs": []}

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1)

    config = None
    if args.sweep:
        result["sweep"], result["tuned_config"] = {}, {}
        for d in [int(x) for x in args.sweep.split(",")]:
            res, cfg = sweep(d, 10, log)
            result["sweep"][d], result["tuned_config"][d] = res, dataclasses.asdict(cfg)
            log(f"tuned config d={d}: {cfg}")
            if abs(d) == 128:
                config = cfg
            save()
    result["our_config"] = dataclasses.asdict(config or default_config(128, jnp.bfloat16))

    shapes = SHAPES[:1] if args.quick else SHAPES
    for shape in shapes:
        sets = make_inputs(shape)
        flops = fwd_flops(**shape)
        # Correctness in the same run: ours vs cuDNN on the first input set.
        q, k, v, _ = sets[0]
        check = {}
        try:
            o_ours = np.asarray(jax.jit(impl_fns(config)["ours"])(q, k, v), np.float32)
            o_cud = np.asarray(jax.jit(impl_fns(config)["cudnn"])(q, k, v), np.float32)
            check["rel_err_ours_vs_cudnn"] = float(np.linalg.norm(o_ours - o_cud) / np.linalg.norm(o_cud))
            check["ours_has_nan"] = bool(np.isnan(o_ours).any())
        except Exception as e:  # noqa: BLE001
            check["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            o_mgpu = np.asarray(jax.jit(impl_fns(config)["mgpu"])(q, k, v), np.float32)
            o_cud = np.asarray(jax.jit(impl_fns(config)["cudnn"])(q, k, v), np.float32)
            check["rel_err_mgpu_vs_cudnn"] = float(np.linalg.norm(o_mgpu - o_cud) / np.linalg.norm(o_cud))
            check["mgpu_has_nan"] = bool(np.isnan(o_mgpu).any())
        except Exception as e:  # noqa: BLE001
            check["mgpu_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"shape {shape} check {check}")
        for name, fn in impl_fns(config).items():
            rec = dict(shape, impl=name, **({"check": check} if name in ("ours", "mgpu") else {}))
            try:
                t_f, t_fb, err = time_fwd_bwd(fn, sets, iters)
                rec.update(fwd_ms=t_f * 1e3, fwd_tflops=flops / t_f / 1e12)
                if t_fb is not None:
                    rec.update(fwd_bwd_ms=t_fb * 1e3, fwd_bwd_tflops=3.5 * flops / t_fb / 1e12)
                if err:
                    rec["fwd_bwd_error"] = err
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            result["runs"].append(rec)
            log(f"{rec}")
            save()

    # Ratios per shape.
    ratios = {}
    for shape in shapes:
        key = f"B{shape['b']}_T{shape['t']}"
        by = {r["impl"]: r for r in result["runs"] if r["b"] == shape["b"] and r["t"] == shape["t"]}
        o = by.get("ours", {})

        def ratio(metric, other):
            a, b = o.get(metric), by.get(other, {}).get(metric)
            return None if a is None or b is None else a / b
        ratios[key] = {"fwd_vs_mha": ratio("fwd_tflops", "mha"),
                       "fwd_vs_cudnn": ratio("fwd_tflops", "cudnn"),
                       "fwd_bwd_vs_mha": ratio("fwd_bwd_tflops", "mha"),
                       "fwd_bwd_vs_cudnn": ratio("fwd_bwd_tflops", "cudnn"),
                       "mgpu_fwd_vs_cudnn": (None if "fwd_tflops" not in by.get("mgpu", {})
                                             or "fwd_tflops" not in by.get("cudnn", {}) else
                                             by["mgpu"]["fwd_tflops"] / by["cudnn"]["fwd_tflops"])}
    result["ratios"] = ratios
    result["targets"] = {"fwd_vs_mha": 1.2, "fwd_vs_cudnn": 0.8, "fwd_bwd_vs_mha": 2.0,
                         "fwd_bwd_vs_cudnn": 0.5}
    save()

    dev = result["device"]["device"]
    print(f"\nCausal bf16 attention on {dev} (jax {result['device']['jax']}); TFLOP/s, "
          f"{result['flop_convention']}")
    print(f"{'shape':>16} {'impl':>6} {'fwd ms':>9} {'fwd TF/s':>9} {'f+b ms':>9} {'f+b TF/s':>9}")
    for r in result["runs"]:
        fmt = lambda x: f"{x:9.2f}" if isinstance(x, float) else f"{'-':>9}"  # noqa: E731
        print(f"{'B%d T%d' % (r['b'], r['t']):>16} {r['impl']:>6} {fmt(r.get('fwd_ms'))} "
              f"{fmt(r.get('fwd_tflops'))} {fmt(r.get('fwd_bwd_ms'))} {fmt(r.get('fwd_bwd_tflops'))}"
              + (f"  ERROR {r.get('error') or r.get('fwd_bwd_error')}"[:120]
                 if r.get('error') or r.get('fwd_bwd_error') else ""))
    for key, rr in ratios.items():
        print(key, {k: (round(v, 3) if v is not None else None) for k, v in rr.items()},
              "targets", result["targets"])


if __name__ == "__main__":
    main()
