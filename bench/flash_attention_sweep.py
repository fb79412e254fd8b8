"""Tile sweep of our Triton flash attention kernel: ``python3 bench/flash_attention_sweep.py
--dims 128,64,256`` times tile configurations per head_dim (causal bf16, B=4, T=4096,
H*D = 4096; each of the forward, dK/dV and dQ kernels tuned with the others at their best so
far) and writes them to ``--out`` (default ``bench/results/flash_attention_sweep_<gpu>.json``,
never overwritten; rewritten atomically after each head_dim): the defaults of
:func:`pallas_kernels.flash_attention.default_config` come from such a sweep.  ``-128`` is a
short D=128 list.
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

from bench.flash_attention import FWD_BWD_FACTOR, fwd_flops  # noqa: E402
from bench.timing import device_info, git_commit, gpu_slug, time_fn  # noqa: E402

__all__ = ["SWEEP", "sweep", "run_sweep", "main"]

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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128", help="comma-separated head_dims (-128: short D=128 list)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the source's commit, where git cannot tell")
    args = ap.parse_args(argv)
    start = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - start:7.1f}s] {msg}", flush=True)  # noqa: E731
    return run_sweep([int(x) for x in args.dims.split(",")], args, log)


if __name__ == "__main__":
    main()
