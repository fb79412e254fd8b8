"""Dump the Triton IR (TTIR) of the shared path's kernels and the XLA graph around them, on any
machine (no GPU: the function is lowered for CUDA on the CPU), to compare code versions.

    PYTHONPATH=<tree> python bench/kernel_ir.py --shape 256,4096,128,32,8,128 --out /tmp/a
    (cd <other tree> && PYTHONPATH=. python <this file> --shape ... --out /tmp/b)
    cmp /tmp/a.k0.ttir /tmp/b.k0.ttir; diff /tmp/a.hlo /tmp/b.hlo

``--shape B,P,S,Hq,Hkv,D`` (Tq = 1, bf16, one prefix).  Writes ``<out>.k<i>.ttir`` per Pallas
kernel (no debug locations, so file paths do not differ) and ``<out>.hlo`` (StableHLO with the
serialized kernels elided).  Uses JAX internals (``jax._src.pallas.triton``): a development
aid, not part of the library.

Used on 2026-11-22 to show that the H200 timing difference of the shared path at B=256 P=4K
and B=512 P=8K between the benchmark runs of commit 3458ba7 and of 8eeef36 is not a code
change: both kernels' TTIR are byte-identical (the XLA glue differs by one [B]-sized integer
reduction).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="256,4096,128,32,8,128")
    ap.add_argument("--variant", default="fused")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from jax._src.pallas.triton import lowering, pallas_call_registration as reg
    dumps = []
    orig = lowering.lower_jaxpr_to_triton_module

    def hook(*a, **k):
        res = orig(*a, **k)
        dumps.append(res.module.operation.get_asm(enable_debug_info=False))
        return res
    lowering.lower_jaxpr_to_triton_module = reg.lowering.lower_jaxpr_to_triton_module = hook

    from pallas_kernels import prefix_attention as pa
    b, p, s, hq, hkv, d = (int(x) for x in args.shape.split(","))
    S, dt = jax.ShapeDtypeStruct, jnp.bfloat16

    def f(q, pk, pv, sk, sv, s2p, lp, ls):
        return pa.shared_prefix_forward(q, pk, pv, sk, sv, s2p, lp, ls, scale=d ** -0.5, variant=args.variant)
    low = jax.jit(f).trace(S((b, 1, hq, d), dt), S((1, p, hkv, d), dt), S((1, p, hkv, d), dt),
                           S((b, s, hkv, d), dt), S((b, s, hkv, d), dt), S((b,), jnp.int32),
                           S((b, 1), jnp.int32), S((b, 1), jnp.int32)).lower(lowering_platforms=("cuda",))
    for i, t in enumerate(dumps):
        with open(f"{args.out}.k{i}.ttir", "w") as fh:
            fh.write(t)
    with open(f"{args.out}.hlo", "w") as fh:
        fh.write(re.sub(r'ir = "[^"]*"', "ir = <elided>", low.as_text()))
    print(f"{len(dumps)} kernels -> {args.out}.k*.ttir, graph -> {args.out}.hlo")


if __name__ == "__main__":
    main()
