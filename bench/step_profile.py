"""Per-kernel device time of one whole decode step of ``bench/e2e_decode.py``'s model (GPU).

For each ``B:P`` point the model (Llama-3.1-8B shapes, ``--layers`` layers, random bf16 weights)
decodes one token per sequence with the ``shared`` backend (prefix of ``P`` tokens stored once)
and with ``none`` (the attention product skipped), with the suffix buffers holding
:data:`SUFFIX` tokens (the mean suffix of ``e2e_decode.py``'s timed steps).  After a warm-up,
``REPS`` steps run under the JAX profiler (CUPTI activity tracing, written as a Perfetto trace);
every kernel on the GPU's compute stream is summed by name and divided by ``REPS``.  The two
lists side by side show what a layer spends beyond the attention kernels (the ``none`` step has
the same projections, RoPE, K/V writes and MLP).

    python bench/step_profile.py 256:16256 256:1024 --out prof.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

BACKENDS = ("shared", "none")
SUFFIX = 65     # (k + 2) / 2 for e2e_decode's k = 128 generated tokens
REPS = 3


def steps(specs, layers: int):
    """``(label, step)`` per ``(B, P, backend)``: ``step()`` runs one decode step, feeding the
    next call the suffix buffers it returned (the runner donates them)."""
    from bench import e2e_decode as ed
    bench = ed.Bench(ed.parse_args(["--layers", str(layers)]))
    for b, p in specs:
        for backend in BACKENDS:
            label = dict(model="llama3.1-8b", layers=layers, batch=b, prefix=p, suffix=SUFFIX, backend=backend)
            point = dict(part="gqa", model=label["model"], layers=layers, batch=b,
                         prefix=p if backend == "shared" else ed.NONE_PREFIX, backend=backend)
            model = bench.model(point)
            prefix, layers_kv, lengths0, pos0, tokens0 = bench.caches(point, model.config)
            state = dict(layers=layers_kv)

            def step(state=state, prefix=prefix, lengths=lengths0 + SUFFIX - 1, pos=pos0 + SUFFIX - 1,
                     tokens0=tokens0, backend=backend):
                out = bench.runner(bench.params, prefix, state["layers"], lengths, pos, tokens0, jnp.int32(1),
                                   backend=backend)
                state["layers"] = out[0]
                return out

            yield label, step


def gpu_kernels(trace_dir: str) -> tuple[dict, dict]:
    """``({kernel name: total us}, {kernel name: launches})`` of the compute stream(s) in the
    Perfetto trace under ``trace_dir``."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    trace = json.load(gzip.open(path))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    process = {e["pid"]: e["args"].get("name", "") for e in meta if e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in meta if e.get("name") == "thread_name"}
    us, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if (e.get("ph") == "X" and "GPU" in process.get(e["pid"], "")
                and "Compute" in thread.get((e["pid"], e["tid"]), "")):
            us[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return dict(us), dict(count)


def profile(specs, layers: int) -> list[dict]:
    out = []
    for label, step in steps(specs, layers):
        for _ in range(2):
            jax.block_until_ready(step())
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(REPS):
                    jax.block_until_ready(step())
            us, count = gpu_kernels(d)
        kernels = sorted(({"name": n[:160], "us": t / REPS, "launches": count[n] / REPS} for n, t in us.items()),
                         key=lambda k: -k["us"])
        out.append(dict(point=label, total_us=sum(k["us"] for k in kernels), kernels=kernels))
        print(label, f"total {out[-1]['total_us']:.1f} us per step", flush=True)
        for k in kernels[:25]:
            print(f"   {k['us']:9.1f} us  x{k['launches']:.0f}  {k['name'][:100]}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("points", nargs="+", metavar="B:P")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--commit", default=None, help="commit measured (a copy without .git)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    res = profile([tuple(int(x) for x in s.split(":")) for s in a.points], a.layers)
    if a.out:
        from bench.e2e_common import commit_of_checkout
        from bench.timing import device_info
        json.dump(dict(device=device_info(), commit=a.commit or commit_of_checkout(), notes=__doc__, results=res),
                  open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
