"""What ``shared_prefix_attention`` launches, per shape, as planned for a given GPU: on any machine.

Traces the public entry point (forward with ``impl`` auto, shared and flat, and the gradient of
the shared path at some shapes) with the plan ``plan_shared_prefix`` makes for a known part
(default an H100 SXM, whatever this machine is) and reduces each traced program to a canonical
summary:

* ``kernels``: every Pallas kernel that survives dead-code elimination, in program order, with
  its operand and result shapes and a hash of its body and launch parameters;
* ``xla``: how many of each other primitive (the XLA glue around the kernels) survive.

Two checkouts whose summaries match launch the same kernels with the same tiling at every
shape, so a refactoring that must not change speed can be checked without a GPU::

    python bench/dispatch_summary.py --out /tmp/a.json            # in checkout A
    python bench/dispatch_summary.py --out /tmp/b.json            # in checkout B
    python bench/dispatch_summary.py --compare /tmp/a.json /tmp/b.json
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax_prefix_attn as jpa  # noqa: E402
from jax_prefix_attn.device import KNOWN_PARTS  # noqa: E402

KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")  # Triton / Mosaic GPU launches


def _shapes():
    """``(B, Tq, Hq, Hkv, D, G, P, S, dtype)``: the decode grid plus grouped prefixes,
    multi-query chunks, float32/float16 and sizes that are no multiple of any tile."""
    out = [(b, 1, hq, hkv, d, 1, p, s, "bfloat16")
           for hq, hkv, d in ((32, 8, 128), (8, 1, 128), (32, 32, 128), (16, 2, 64))
           for b in (8, 16, 64, 256, 512, 1024) for p in (1024, 4096, 8192, 16384)
           for s in (64, 128, 256, 1024)]
    out += [(16, 1, 32, 8, 128, 4, 4096, 128, "bfloat16"), (1024, 1, 32, 8, 128, 4, 4096, 128, "bfloat16"),
            (256, 1, 8, 1, 128, 2, 1000, 64, "bfloat16"), (8, 4, 32, 8, 128, 1, 4096, 128, "bfloat16"),
            (64, 8, 32, 8, 128, 1, 4096, 256, "bfloat16"), (4, 64, 32, 8, 128, 2, 2048, 256, "bfloat16"),
            (2, 33, 8, 2, 64, 1, 12, 40, "float32"), (3, 1, 8, 2, 64, 1, 300, 50, "float32"),
            (256, 1, 32, 8, 128, 1, 4000, 100, "bfloat16"), (8, 1, 8, 1, 128, 1, 4000, 1024, "bfloat16"),
            (128, 16, 32, 8, 128, 8, 1024, 512, "float16"), (512, 1, 32, 8, 64, 1, 8192, 128, "bfloat16")]
    return out


def _canon(text: str) -> str:
    """Text of a kernel with names, addresses, source locations and variable names removed."""
    text = re.sub(r"name=[^\s,\]\)]+", "name=_", text)
    text = re.sub(r"0x[0-9a-f]+", "0x_", text)
    text = re.sub(r"/[\w/.\-]+\.py:\d+(:\d+)?", "SRC", text)
    return re.sub(r"\b[a-z]{1,3}\b(?=[:\s\)\],])", "v", text)


def _walk(jaxpr, kernels: list, xla: collections.Counter) -> None:
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in KERNEL_PRIMITIVES:
            body = str(eqn.params.get("jaxpr", eqn.params.get("jaxprs")))
            launch = {k: v for k, v in eqn.params.items()
                      if k not in ("jaxpr", "name_and_src_info", "debug", "metadata", "cost_estimate")}
            digest = hashlib.sha256(_canon(body + repr(launch)).encode()).hexdigest()[:12]
            ins = " ".join(str(v.aval) for v in eqn.invars)
            outs = " ".join(str(v.aval) for v in eqn.outvars)
            kernels.append(f"in[{ins}] out[{outs}] {digest}")
            continue
        subs, seen = [], set()
        for key, val in eqn.params.items():
            if key in ("rule", "fwd_jaxpr_thunk", "bwd"):
                continue
            while isinstance(val, core.ClosedJaxpr):
                val = val.jaxpr
            if isinstance(val, core.Jaxpr) and id(val) not in seen:
                seen.add(id(val))
                subs.append(val)
        if subs:
            for sub in subs:
                _walk(sub, kernels, xla)
        else:
            xla[name] += 1


def summary(fn, *args) -> dict:
    """``{"kernels": [...], "xla": {primitive: count}}`` of ``fn(*args)`` (see the module doc)."""
    kernels, xla = [], collections.Counter()
    _walk(jax.make_jaxpr(fn)(*args).jaxpr, kernels, xla)
    return {"kernels": kernels, "xla": dict(sorted(xla.items()))}


def summarize_shape(key, device) -> dict:
    b, tq, hq, hkv, d, g, p, s, dt = key
    dtype = jnp.dtype(dt)
    sds = jax.ShapeDtypeStruct
    args = [sds((b, tq, hq, d), dtype), sds((g, p, hkv, d) if g > 1 else (p, hkv, d), dtype)]
    args = args + [args[1], sds((b, s, hkv, d), dtype), sds((b, s, hkv, d), dtype),
                   sds((b,), jnp.int32)] + ([sds((b,), jnp.int32)] if g > 1 else [])
    shapes = dict(batch=b, tq=tq, heads_q=hq, heads_kv=hkv, head_dim=d, groups=g, prefix_len=p,
                  suffix_len=s, dtype=dtype, device=device)
    rec = {}

    def call(impl, q, pk, pv, sk, sv, sl, s2p=None):
        plan = jpa.plan_shared_prefix(**shapes, impl=impl)
        return jpa.shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl, seq_to_prefix=s2p,
                                           impl=impl, return_lse=True, plan=plan)
    cols = {impl: (lambda *a, impl=impl: call(impl, *a)) for impl in ("auto", "shared", "flat")}
    if tq > 1 or (b in (16, 256) and p in (1024, 4096, 12, 300, 2048)):
        cols["grad"] = jax.grad(lambda *a: jnp.sum(call("shared", *a)[0].astype(jnp.float32)),
                                argnums=(0, 1, 2, 3, 4))
    for col, fn in cols.items():
        try:
            rec[col] = summary(fn, *args)
        except (ValueError, TypeError, NotImplementedError) as e:
            rec[col] = f"ERR {type(e).__name__}: {str(e)[:200]}"
    return rec


def compare(path_a: str, path_b: str) -> int:
    """Prints every difference; returns the number of shapes whose kernels differ."""
    a, b = json.load(open(path_a)), json.load(open(path_b))
    bad = glue = same = 0
    for key, rec in a.items():
        for col, x in rec.items():
            y = b.get(key, {}).get(col)
            if x == y:
                same += 1
            elif isinstance(x, dict) and isinstance(y, dict) and x["kernels"] == y["kernels"]:
                glue += 1
                print("XLA glue differs", key, col, {k: (x["xla"].get(k, 0), y["xla"].get(k, 0))
                                                     for k in set(x["xla"]) | set(y["xla"])
                                                     if x["xla"].get(k, 0) != y["xla"].get(k, 0)})
            else:
                bad += 1
                print("KERNELS differ", key, col, "\n  a:", x, "\n  b:", y)
    print(f"identical {same}, XLA glue differs {glue}, kernels differ {bad}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the summaries of this checkout here (JSON)")
    ap.add_argument("--device", default="H100_SXM", choices=sorted(KNOWN_PARTS),
                    help="the part the plans are made for")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two summary files")
    ap.add_argument("--limit", type=int, default=None, help="only the first N shapes")
    args = ap.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    out = {}
    for key in _shapes()[:args.limit]:
        out[str(key)] = summarize_shape(key, KNOWN_PARTS[args.device])
        print(key, {k: len(v["kernels"]) if isinstance(v, dict) else v
                    for k, v in out[str(key)].items()}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
