"""Shared timing helpers for the benchmarks (GPU).

* :func:`time_fn` -- median wall time of a jitted function after warm-up, with
  ``jax.block_until_ready``; rotates among several argument sets so inputs that fit in
  L2 are not timed hot.
* :func:`loop_time` -- seconds per call from ``n`` dependent calls inside one jitted
  ``fori_loop`` (no per-call dispatch in the number: for kernels of ~10-1000 us).
* :func:`measure_copy_bandwidth` / :func:`measure_matmul_rate` -- the two rates of the
  floor ``max(bytes / bandwidth, flops / matmul rate)``, measured in the same run.
* :func:`device_info` -- device name and versions for result JSON files.
* :func:`is_oom` -- whether an exception is XLA's out-of-memory error (points recorded as "X").
"""
from __future__ import annotations

import functools
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp


def time_fn(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 20,
            stat: str = "median") -> float:
    """Seconds of ``fn(*args)`` (``stat``: ``"median"`` or ``"min"`` of ``iters`` calls), cycling
    through ``arg_sets``."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) if stat == "min" else statistics.median(times)


# XLA compile options for timing loops that stand for a kernel inside a model's decode step:
# every loop body becomes one CUDA graph.  XLA's default (``xla_gpu_graph_min_graph_size`` 5)
# graphs only bodies of at least 5 kernels, so a path that launches fewer kernels is launched
# kernel by kernel from the host and measures slower than with more: on an H200 the shared path
# at Hq=8 B=16 P=1K S=64 took 23.6 us with 2 launches under the default against 13.8 us with 5,
# and 11.4 us with 2 launches under these options.  Inside a model's step the body holds many
# kernels and is graphed either way.
GRAPH_ALWAYS = {"xla_gpu_graph_min_graph_size": 1}

LOOP_COUNTS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # static trip counts loop_time may compile


def loop_time(fn: Callable, q, rest: tuple, *, target_s: float = 0.03, reps: int = 3,
              compiler_options: dict | None = None, n: int | None = None,
              unroll: int = 1) -> float:
    """Seconds per call of ``fn(q, *rest) -> out`` (``out.shape == q.shape``), measured as ``n``
    dependent calls in one jitted ``fori_loop`` (each iteration's output perturbs the next
    query, so XLA can neither hoist nor merge them); ``n`` is chosen from :data:`LOOP_COUNTS` so
    one timed call takes about ``target_s``; median of ``reps`` timed calls divided by ``n``,
    after a compile call.

    The trip count is a compile-time constant (one compile at ``n = 4``, one more at the chosen
    ``n``).  With a traced trip count XLA's GPU while loop copies its predicate to the host
    every iteration: on an H200 that added 14-20 us per call (an elementwise op: 24 us per
    iteration with a traced count, 10 us with a constant one; the shared path at B=256 P=4K:
    0.111 ms against 0.096 ms).

    ``compiler_options``: XLA options for the timed loop's compilation (``jax.jit``'s
    ``compiler_options``), e.g. the command-buffer scheduling mode.

    ``n``: a fixed trip count instead of the search from :data:`LOOP_COUNTS` (one compile
    instead of two).  ``unroll``: calls per loop iteration (``fori_loop``'s ``unroll``): with
    :data:`GRAPH_ALWAYS` the ``unroll`` dependent calls of one iteration form one CUDA graph,
    so the loop's own per-iteration cost is shared by ``unroll`` calls."""
    @functools.partial(jax.jit, static_argnums=(1,), compiler_options=compiler_options)
    def run(q, n, *rest):
        def body(_, q):
            out = fn(q, *rest)
            return (q + out.astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q, unroll=unroll)

    n0 = LOOP_COUNTS[0]
    if n is None:
        jax.block_until_ready(run(q, n0, *rest))  # compile + warm up
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, n0, *rest))
        t1 = (time.perf_counter() - t0) / n0
        want = target_s / max(t1, 1e-6)
        n = max([c for c in LOOP_COUNTS if c <= want], default=n0)
        if n != n0:
            jax.block_until_ready(run(q, n, *rest))  # compile + warm up
    else:
        jax.block_until_ready(run(q, n, *rest))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, n, *rest))
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of an XLA elementwise ``x + 1`` over ``nbytes`` of bf16 (read + write counted).

    The best of 30 calls: a ceiling (the floor it feeds must not be inflated by a slow call;
    medians of 10 moved between 2.1 and 2.6 TB/s from run to run on one H200).
    """
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    t = time_fn(f, [(x,)], warmup=3, iters=30, stat="min")
    del x
    return 2 * nbytes / t


def measure_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an XLA bf16 ``n^3`` matmul (best of 20 calls)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    t = time_fn(f, [(a, b)], warmup=3, iters=20, stat="min")
    return 2 * n ** 3 / t


_SMI_FIELDS = ("driver_version", "power.limit", "clocks.max.sm", "clocks.max.memory", "clocks.sm",
               "temperature.gpu", "pci.bus_id")


def _nvidia_smi() -> dict | None:
    """Driver, power limit and clocks of GPU 0 (machines of one kind can differ in these;
    timings of identical kernels moved by up to 45% between two H200 machines), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(_SMI_FIELDS),
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    vals = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(_SMI_FIELDS, vals))


def is_oom(exc: BaseException) -> bool:
    """True for XLA's resource-exhausted (out of memory) errors.  A kernel asking for more
    shared memory than an SM has is also reported as RESOURCE_EXHAUSTED: that is a bug, not an
    out-of-memory point, and is recorded as an error."""
    msg = f"{type(exc).__name__}: {exc}"
    if "shared memory" in msg.lower():
        return False
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() or isinstance(exc, MemoryError)


def git_commit(explicit: str | None) -> tuple[str | None, str | None]:
    """``(commit, source)`` of a result: ``explicit`` where given (``"argument"``; a copied
    checkout's git can be stale), else ``git rev-parse --short HEAD`` of this repository
    (``"git"``), else ``(None, None)``."""
    if explicit:
        return explicit, "argument"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip(), "git"
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def device_info() -> dict:
    dev = jax.devices()[0]
    info = {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if dev.platform == "gpu":
        smi = _nvidia_smi()
        if smi:
            info["nvidia_smi"] = smi
    return info


def gpu_slug() -> str:
    """Short device name for result file names, e.g. ``h100`` or ``h200``."""
    kind = device_info()["device"].lower()
    for name in ("h200", "h100", "a100", "l4", "cpu"):
        if name in kind:
            return name
    return "".join(c if c.isalnum() else "_" for c in kind)[:24]
