"""Per-kernel device time of one decode step of ``bench/e2e_decode_mla.py``'s model (GPU).

For each ``B:P`` point the DeepSeek decoder (``--model`` shapes, ``--layers`` layers, random bf16
weights, the ``shared`` layout: the prefix's latent cache stored once) decodes ``STEPS`` tokens
per sequence in one jitted loop (``e2e_decode_mla.make_runner``) under the JAX profiler (CUPTI
activity tracing, a Perfetto trace).  Every kernel on the GPU's compute stream is summed by name
and divided by ``STEPS``, and the kernels are put in coarse classes by name (:func:`kind`) so the
table says where a step goes: the MLA attention kernels, the GEMMs, the routed experts'
gather/scatter and sorting, the rest of XLA's fusions.

    python bench/step_profile_mla.py 1024:1024 256:16384 --out prof.json --commit SHA
    python bench/step_profile_mla.py --smoke 4:16          # CPU: the loop runs; no kernel table
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

STEPS = 8
KINDS = (   # (class, substrings of a kernel name; the first class that matches)
    ("mla attention (Mosaic GPU)", ("mosaic", "mla_", "prefix_", "suffix_", "merge")),
    ("gemm", ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "matmul", "dot")),
    ("sort / top-k", ("sort", "topk", "top_k", "radix")),
    ("gather / scatter", ("gather", "scatter", "dynamic-update-slice", "dynamic_update_slice",
                          "dynamic-slice", "dynamic_slice")),
    ("reduce", ("reduce",)),
    ("copy / memset", ("copy", "memset", "memcpy", "transpose")),
)


def kind(name: str) -> str:
    """The coarse class of a kernel by its name (:data:`KINDS`), else ``"other fusion"``."""
    low = name.lower()
    for label, keys in KINDS:
        if any(k in low for k in keys):
            return label
    return "other fusion"


def profile(specs, args) -> list[dict]:
    from bench import e2e_decode_mla as em
    from bench.step_profile import gpu_kernels
    argv = ["--model", args.model, "--layers", str(args.layers), "--gen-tokens", str(STEPS + 2)]
    bench = em.Bench(em.parse_args(argv + (["--smoke"] if args.smoke else [])))
    out = []
    for b, p in specs:
        point = dict(model=args.model, layers=args.layers, batch=b, prefix=p, backend="shared")
        model = bench.model(point)
        cache, tokens0 = bench.cache(point, model.config)
        kept, suffix = model.split_cache(cache)
        suffix, *_ = jax.block_until_ready(bench.runner(bench.params, kept, suffix, tokens0, jnp.int32(2)))
        label = dict(point, steps=STEPS)
        if args.smoke:
            out.append(dict(point=label, kernels=[]))
            print(label, "ran (CPU: no kernel table)", flush=True)
            continue
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                suffix, *_ = jax.block_until_ready(bench.runner(bench.params, kept, suffix, tokens0,
                                                                jnp.int32(STEPS)))
            us, count = gpu_kernels(d)
        kernels = sorted(({"name": n[:160], "us": t / STEPS, "launches": count[n] / STEPS, "kind": kind(n)}
                          for n, t in us.items()), key=lambda k: -k["us"])
        by_kind = collections.defaultdict(float)
        for k in kernels:
            by_kind[k["kind"]] += k["us"]
        total = sum(by_kind.values())
        out.append(dict(point=label, total_us=total, by_kind=dict(by_kind), kernels=kernels))
        print(label, f"total {total:.1f} us per step", flush=True)
        for name, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"   {t:9.1f} us  {100 * t / total:5.1f}%  {name}")
        for k in kernels[:args.top]:
            print(f"   {k['us']:9.1f} us  x{k['launches']:.0f}  [{k['kind']}] {k['name'][:90]}")
        del cache, kept, suffix
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("points", nargs="+", metavar="B:P")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--top", type=int, default=30, help="kernels printed per point")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (no profile)")
    ap.add_argument("--commit", default=None, help="commit measured (a copy without .git)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers = 2
    res = profile([tuple(int(x) for x in s.split(":")) for s in a.points], a)
    if a.out:
        from bench.e2e_common import commit_of_checkout
        from bench.timing import device_info
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(device=device_info(), jax=jax.__version__, commit=a.commit or commit_of_checkout(),
                           notes=__doc__, results=res), f, indent=1)
        os.replace(tmp, a.out)
    return res


if __name__ == "__main__":
    main()
