"""Dump the Triton IR (TTIR) of the shared path's kernels and the XLA graph around them, on any
machine (no GPU: the function is lowered for CUDA on the CPU), to compare code versions.

    PYTHONPATH=<tree> python bench/kernel_ir.py --shape 256,4096,128,32,8,128 --out /tmp/a
    (cd <other tree> && PYTHONPATH=. python <this file> --shape ... --out /tmp/b)
    cmp /tmp/a.k0.ttir /tmp/b.k0.ttir; diff /tmp/a.hlo /tmp/b.hlo

``--shape B,P,S,Hq,Hkv,D`` (Tq = 1, bf16, one prefix); ``--path`` a Triton leaf of the planner
(``triton_two_launch``, ``triton_overlap``, ``flat_own``, ``flat_rows``; default: the shared
family's leaf off the Mosaic GPU region), planned for ``--device`` (a name of
``jax_prefix_attn.device.KNOWN_PARTS``, default ``H100_SXM``).  Writes ``<out>.k<i>.ttir`` per
Pallas kernel (no debug locations, so file paths do not differ) and ``<out>.hlo`` (StableHLO with
the serialized kernels elided).  Uses JAX internals (``jax._src.pallas.triton``): a development
aid, not part of the library.  The Mosaic GPU leaves do not lower through Triton: compare them
by their kernel bodies' jaxprs instead.
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
    ap.add_argument("--path", default=None, help="a Triton leaf of the planner (default: the "
                    "shared family's leaf off the Mosaic GPU region)")
    ap.add_argument("--device", default="H100_SXM", help="the part the plan is made for")
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

    import jax_prefix_attn as jpa
    from jax_prefix_attn.device import KNOWN_PARTS
    b, p, s, hq, hkv, d = (int(x) for x in args.shape.split(","))
    S, dt = jax.ShapeDtypeStruct, jnp.bfloat16
    # (interpret=True in the planning only: it keeps the plan off the Mosaic GPU leaves, which
    # do not lower through Triton; the call runs the kernels compiled, lowered for CUDA)
    plan = jpa.plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=d, groups=1,
                                  prefix_len=p, suffix_len=s, dtype=dt, impl="shared",
                                  path=args.path, device=KNOWN_PARTS[args.device], interpret=True)
    print(f"leaf {plan.path}: {plan.chunks[0].leaf}")

    def f(q, pk, pv, sk, sv, sl):
        return jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, plan=plan)
    low = jax.jit(f).trace(S((b, 1, hq, d), dt), S((p, hkv, d), dt), S((p, hkv, d), dt),
                           S((b, s, hkv, d), dt), S((b, s, hkv, d), dt),
                           S((b,), jnp.int32)).lower(lowering_platforms=("cuda",))
    for i, t in enumerate(dumps):
        with open(f"{args.out}.k{i}.ttir", "w") as fh:
            fh.write(t)
    with open(f"{args.out}.hlo", "w") as fh:
        fh.write(re.sub(r'ir = "[^"]*"', "ir = <elided>", low.as_text()))
    print(f"{len(dumps)} kernels -> {args.out}.k*.ttir, graph -> {args.out}.hlo")


if __name__ == "__main__":
    main()
