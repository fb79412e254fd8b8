"""Tile sweeps of our flash attention kernels.

Triton (the default): ``python3 bench/flash_attention_sweep.py --dims 128,64,256`` times tile
configurations of our Triton kernel per head_dim (causal bf16, B=4, T=4096, H*D = 4096; each of
the forward, dK/dV and dQ kernels tuned with the others at their best so far) and writes them to
``--out`` (default ``bench/results/flash_attention_sweep_<gpu>.json``, never overwritten;
rewritten atomically after each head_dim): the defaults of
:func:`pallas_kernels.flash_attention.default_config` come from such a sweep.  ``-128`` is a
short D=128 list.

Mosaic GPU backward (``--mgpu-bwd``): an A/B of the backward tiles of
:func:`pallas_kernels.flash_attention_mgpu_vjp.flash_attention_mgpu_vjp` (:data:`MGPU_BWD_SWEEP`,
each a ``bwd_tiles`` dict over the defaults; at head_dim 256 the default dK/dV kernel against
``split_dkv_columns=True``, the dK/dV accumulators' columns split between two warpgroups).  Per
point (16K tokens, ``T`` from ``--seq``, ``Hq`` as in ``bench/flash_attention.py``, GQA groups
from ``--groups``, causal and full, bf16) it times forward+backward (``jax.vjp`` of the output)
of cuDNN and of each candidate, and records ``ms``, ``tflops``, ``vs_cudnn`` (cuDNN's time over
the candidate's: above 1 is faster) and ``rel_vs_default`` (each gradient's relative difference
from the first candidate's, a check that the variant computes the same thing).  Output
``bench/results/flash_attention_mgpu_bwd_sweep_<gpu>.json`` by default (never overwritten,
rewritten atomically after each point).  On the GPU machine, from the repository root::

    PYTHONPATH=$PWD python3 bench/flash_attention_sweep.py --mgpu-bwd --dims 256 --commit <hash>

(8 points of 3 programs each; ``--dims 256,128`` adds head_dim 128's candidates).  A variant
that wins at every point is a candidate for the defaults
(:func:`pallas_kernels.flash_attention_mgpu_bwd.default_tiles`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.flash_attention import FWD_BWD_FACTOR, fwd_flops, heads_q  # noqa: E402
from bench.timing import device_info, git_commit, gpu_slug, time_fn  # noqa: E402

__all__ = ["SWEEP", "MGPU_BWD_SWEEP", "sweep", "run_sweep", "sweep_mgpu_bwd", "run_mgpu_bwd",
           "main"]

# Candidate tiles (block_q, block_k, num_warps, num_stages) of our Triton kernel per head_dim.
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

# Candidate backward tiles (``bwd_tiles`` of flash_attention_mgpu_vjp) of our Mosaic GPU kernels
# per head_dim, the first the unsplit dK/dV kernel with the other tiles at their defaults (every
# ``rel_vs_default`` is against it).  At head_dim 256 nothing else fits a Hopper SM's shared
# memory next to two stages.
MGPU_BWD_SWEEP = {
    256: ({"split_dkv_columns": False}, {"split_dkv_columns": True}),
    128: ({"split_dkv_columns": False}, {"split_dkv_columns": True},
          {"split_dkv_columns": True, "block_q_dkv": 128}),
}


def sweep(d: int, iters: int, log) -> tuple[dict, object]:
    """Time tile configurations of our Triton kernel for head_dim ``|d|`` (causal bf16, B=4,
    T=4096, H*D = 4096); each kernel is tuned with the others at their best so far.

    Returns (records, best FlashConfig)."""
    from pallas_kernels.flash_attention import KernelTiles, default_config, flash_attention  # noqa: PLC0415
    cands = SWEEP[d]
    d = abs(d)
    hq = 4096 // d
    sets = []
    for i in range(2):
        ks = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        sets.append(tuple(jax.random.normal(kk, (4, 4096, hq, d), jnp.float32).astype(jnp.bfloat16) for kk in ks))
    best = default_config(d, jnp.bfloat16)
    flops = fwd_flops(4, 4096, hq, d, True)
    results = {"shape": dict(b=4, t=4096, h=hq, d=d)}

    def time_cfg(part, cfg):
        fn = lambda q, k, v: flash_attention(q, k, v, causal=True, config=cfg)[0]  # noqa: E731
        if part == "fwd":
            t = time_fn(jax.jit(fn), [x[:3] for x in sets], warmup=2, iters=iters)
            return t, dict(ms=t * 1e3, tflops=flops / t / 1e12)
        f = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
        t = time_fn(f, sets, warmup=2, iters=iters)
        return t, dict(fwd_bwd_ms=t * 1e3, tflops=FWD_BWD_FACTOR * flops / t / 1e12)

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
                rec["error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
            results[part].append(rec)
            log(f"sweep d={d} {part} {rec}")
        best = best_cfg
    return results, best


def run_sweep(dims: Sequence[int], args, log) -> dict:
    out = args.out or os.path.join(ROOT, "bench", "results", f"flash_attention_sweep_{gpu_slug()}.json")
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists: pass another --out")
    commit, source = git_commit(args.commit)
    doc = {"benchmark": "flash_attention_sweep", "device": device_info(), "commit": commit,
           "commit_source": source, "sweep": {}, "tuned_config": {}}
    for d in dims:
        res, cfg = sweep(d, args.iters, log)
        doc["sweep"][str(d)], doc["tuned_config"][str(d)] = res, dataclasses.asdict(cfg)
        log(f"tuned config d={d}: {cfg}")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out + ".tmp", out)
    return {"out": out, "tuned_config": doc["tuned_config"]}


def sweep_mgpu_bwd(d: int, seqs: Sequence[int], groups: Sequence[int], iters: int, log,
                   on_point) -> None:
    """Forward+backward of cuDNN and of each :data:`MGPU_BWD_SWEEP` candidate at head_dim ``d``
    (bf16, 16K tokens, ``t`` in ``seqs``, GQA ``groups``, causal and full); ``on_point(record)``
    after each point."""
    from pallas_kernels.flash_attention_mgpu_vjp import flash_attention_mgpu_vjp  # noqa: PLC0415
    hq, tokens = heads_q(d), 16 * 1024
    for t in seqs:
        for g in groups:
            for causal in (True, False):
                b, hkv = tokens // t, hq // g
                sets = []
                for i in range(2):
                    ks = jax.random.split(jax.random.PRNGKey(200 + i), 4)
                    shapes = ((b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d))
                    sets.append(tuple(jax.random.normal(kk, sh, jnp.float32).astype(jnp.bfloat16)
                                      for kk, sh in zip(ks, shapes)))
                flops = FWD_BWD_FACTOR * fwd_flops(b, t, hq, d, causal)
                rec = dict(b=b, t=t, hq=hq, hkv=hkv, d=d, causal=causal, candidates=[])

                def grads_fn(attn):
                    return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))

                def timed(fn):
                    s = time_fn(fn, sets, warmup=2, iters=iters)
                    return dict(ms=s * 1e3, tflops=flops / s / 1e12)
                try:
                    rec["cudnn"] = timed(grads_fn(lambda q, k, v: jax.nn.dot_product_attention(
                        q, k, v, is_causal=causal, implementation="cudnn")))
                except Exception as e:  # noqa: BLE001
                    rec["cudnn"] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
                first = None   # the defaults' gradients
                for i, tiles in enumerate(MGPU_BWD_SWEEP[d]):
                    cand = dict(bwd_tiles=dict(tiles))
                    try:
                        fn = grads_fn(lambda q, k, v, tiles=tiles: flash_attention_mgpu_vjp(
                            q, k, v, causal=causal, bwd_tiles=tiles)[0])
                        cand.update(timed(fn))
                        if "ms" in rec["cudnn"]:
                            cand["vs_cudnn"] = rec["cudnn"]["ms"] / cand["ms"]
                        got = [x.astype(jnp.float32) for x in fn(*sets[0])]
                        first = got if i == 0 else first
                        if first is not None:
                            cand["rel_vs_default"] = {
                                name: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
                                for name, x, y in zip(("dq", "dk", "dv"), got, first)}
                    except Exception as e:  # noqa: BLE001
                        cand["error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    rec["candidates"].append(cand)
                    log(f"mgpu bwd d={d} t={t} G={g} causal={causal} {cand}")
                on_point(rec)


def run_mgpu_bwd(dims: Sequence[int], args, log) -> dict:
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   f"flash_attention_mgpu_bwd_sweep_{gpu_slug()}.json")
    if os.path.exists(out):
        raise FileExistsError(f"{out} exists: pass another --out")
    unknown = [d for d in dims if d not in MGPU_BWD_SWEEP]
    if unknown:
        raise ValueError(f"no Mosaic GPU backward candidates at head_dims {unknown}; "
                         f"have {sorted(MGPU_BWD_SWEEP)}")
    commit, source = git_commit(args.commit)
    doc = {"benchmark": "flash_attention_mgpu_bwd_sweep", "device": device_info(),
           "jax": jax.__version__, "commit": commit, "commit_source": source,
           "flop_convention": "fwd+bwd = 3.5 x fwd; fwd = 4*B*Hq*T*T*D, halved for causal",
           "points": []}

    def on_point(rec):
        doc["points"].append(rec)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out + ".tmp", out)
    seqs = [int(x) for x in args.seq.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    for d in dims:
        sweep_mgpu_bwd(d, seqs, groups, args.iters, log, on_point)
    return {"out": out, "points": len(doc["points"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128", help="comma-separated head_dims (-128: short D=128 list)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the source's commit, where git cannot tell")
    ap.add_argument("--mgpu-bwd", action="store_true",
                    help="A/B the Mosaic GPU backward's tiles (MGPU_BWD_SWEEP) instead")
    ap.add_argument("--seq", default="2048,8192", help="--mgpu-bwd: sequence lengths (16K tokens)")
    ap.add_argument("--groups", default="1,8", help="--mgpu-bwd: GQA groups Hq / Hkv")
    args = ap.parse_args(argv)
    start = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - start:7.1f}s] {msg}", flush=True)  # noqa: E731
    dims = [int(x) for x in args.dims.split(",")]
    return run_mgpu_bwd(dims, args, log) if args.mgpu_bwd else run_sweep(dims, args, log)


if __name__ == "__main__":
    main()
