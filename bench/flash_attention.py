"""Benchmark grid: flash attention kernels (ours) against peers, forward and forward+backward, bf16.

Contenders (``--contenders``, each optional: one that fails to import, lower, compile or run is
recorded in the JSON with the reason and the grid goes on):

* ``triton``: :func:`pallas_kernels.flash_attention.flash_attention` (ours, Pallas Triton lowering);
* ``mgpu``: :func:`pallas_kernels.flash_attention_mgpu_vjp.flash_attention_mgpu_vjp` (ours, Pallas
  Mosaic GPU forward and backward kernels);
* ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention(implementation=...)``; ``xla`` materialises the
  ``[B, Hq, T, T]`` float32 scores, so points whose scores exceed ``--xla-max-scores-gib`` are
  recorded as skipped rather than run;
* ``tokamax``: ``tokamax.dot_product_attention(..., implementation="mosaic")`` (tokamax's Pallas
  Mosaic GPU kernels; needs Python >= 3.12 and jax >= 0.11.1).

Grid (:class:`Point`): sequence length ``T`` from 1K to 32K at a fixed number of tokens
``B x T`` (16K or 32K, ``B = tokens // T``), head_dim 64/128/256, GQA group ``G = Hq / Hkv`` of
1/4/8 with ``Hq = 32`` for head_dim <= 128 and ``Hq = 16`` for head_dim 256 (a model width of
2048 to 4096), causal and full attention.  ``--grid full`` is every combination (198 points);
``--grid core`` (default, 40 points) is the subset that one 10-minute call on one H200 runs:
head_dim 128 at every ``T`` of 16K tokens with ``G`` 1 and 8, head_dim 64 and 256 at ``T`` 2K and
8K, and head_dim 128 ``G = 8`` at 32K tokens with ``T`` 2K and 32K, each causal and full.
``--points i:j`` runs a slice of the grid's list (``--list`` prints it with indices), so a grid
too large for one call is split across calls that ``--resume`` into one JSON.

FLOP convention: forward = ``4 * B * Hq * T * T * D`` (two matmuls), halved for causal (half the
scores); forward+backward = 3.5 x forward (2 forward matmuls + 5 backward matmuls, the
recomputation of ``S`` counted).  GQA does not change the count.

Execution: points run in batches of ``--batch-points``.  Every program of a batch (per point,
contender and direction, and each point's input generator) is traced and lowered on the main
thread and compiled in a pool of ``--compile-workers`` threads (XLA compiles release the GIL;
the Mosaic GPU contenders are submitted first, see :data:`COMPILE_ORDER`), then the programs are
timed one after another with :func:`bench.timing.time_fn` (median of
``--iters`` calls after ``--warmup``, two input sets rotating); timing never overlaps
compilation, whose autotuning also runs on the GPU.  Each contender's forward output is compared
with cuDNN's (or XLA's where cuDNN failed): ``check.rel_err``.  The JSON is rewritten after
every point, so a run cut off by the time limit keeps what finished; ``--budget-s`` (seconds
from the start of the run) starts no batch that the slowest batch so far would carry past
it, and times no point past it.  ``--resume`` keeps the points already in the JSON and appends
the new ones and the run's record; without it an existing file is refused.

Result: ``bench/results/flash_attention_<gpu>.json`` by default: per run the device, the jax,
jaxlib, cuDNN and tokamax versions, the commit (``--commit``, else ``git rev-parse``), the
command line, the grid and its slice; per point its shape and, per contender and direction,
``ms``, ``tflops`` and ``vs_cudnn`` (cuDNN's time over the contender's: above 1 is faster than
cuDNN), or ``error`` / ``skipped``.  ``bench/plot_flash_attention.py`` plots it.

tokamax on the GPU machine (no network there): ``python3 bench/pack_tokamax.py .whl/tokamax``
here packs its wheels (see that script); there, with ``.whl`` carried::

    python3 -m pip install -q --no-index --no-deps --target /tmp/tk .whl/tokamax/*.whl
    PYTHONPATH=/tmp/tk:$PWD python3 bench/flash_attention.py --budget-s 530 --commit <hash> --out <path>

Other usage: ``--grid full --points 40:80 --resume``; ``--contenders triton,cudnn``.
``bench/flash_attention_sweep.py`` tunes the tiles of our Triton kernel.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import shlex
import sys
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.timing import device_info, git_commit, gpu_slug, is_oom, time_fn  # noqa: E402

__all__ = ["Point", "Job", "Program", "Harness", "Budget", "ResultStore", "CONTENDERS", "GRIDS",
           "fwd_flops", "heads_q", "core_grid", "full_grid", "select_points", "run_grid",
           "measure_point", "main"]

BENCHMARK = "flash_attention"
SCHEMA = 2
CONTENDERS = ("triton", "mgpu", "cudnn", "xla", "tokamax")
DIRECTIONS = ("fwd", "fwd_bwd")
FWD_BWD_FACTOR = 3.5
REFERENCES = ("cudnn", "xla")   # the forward output the others are checked against: the first that ran
INPUTS = "inputs"               # Job.contender of a point's input generator
K = 1024
FLOP_CONVENTION = ("fwd = 4*B*Hq*T*T*D, halved for causal; fwd+bwd = 3.5 x fwd "
                   "(2 forward + 5 backward matmuls)")
TIMING = "median of jitted calls after warm-up, 2 rotating input sets (bench.timing.time_fn)"

# ------------------------------------------------------------------------------------------ grid
def heads_q(head_dim: int) -> int:
    """Query heads at ``head_dim``: 32 up to 128 and 16 at 256 (model widths of 2K to 4K)."""
    return 32 if head_dim <= 128 else 16


def fwd_flops(b: int, t: int, h: int, d: int, causal: bool = True) -> float:
    """Forward FLOPs of attention over ``[b, t, h, d]`` queries and ``t`` keys: two matmuls of
    ``2 * b * h * t * t * d`` each, half of them for causal attention."""
    f = 4 * b * h * t * t * d
    return f / 2 if causal else float(f)


@dataclasses.dataclass(frozen=True)
class Point:
    """One shape: ``B = tokens // t`` sequences of ``t`` tokens, ``Hq = heads_q(d)`` query heads,
    ``Hkv = Hq // group`` kv heads of width ``d``."""
    tokens: int
    t: int
    d: int
    group: int
    causal: bool

    @property
    def b(self) -> int:
        return self.tokens // self.t

    @property
    def hq(self) -> int:
        return heads_q(self.d)

    @property
    def hkv(self) -> int:
        return self.hq // self.group

    @property
    def key(self) -> str:
        return f"N{self.tokens}_T{self.t}_D{self.d}_G{self.group}_{'causal' if self.causal else 'full'}"

    def flops(self, direction: str) -> float:
        f = fwd_flops(self.b, self.t, self.hq, self.d, self.causal)
        return f * FWD_BWD_FACTOR if direction == "fwd_bwd" else f

    def scores_bytes(self) -> int:
        """Bytes of the ``[B, Hq, T, T]`` float32 scores."""
        return self.b * self.hq * self.t * self.t * 4

    def describe(self) -> dict:
        return dict(key=self.key, tokens=self.tokens, b=self.b, t=self.t, hq=self.hq, hkv=self.hkv,
                    d=self.d, group=self.group, causal=self.causal)


def full_grid() -> list[Point]:
    """Every combination: tokens 16K (T 1K..16K) and 32K (T 1K..32K), head_dim 64/128/256, G 1/4/8,
    causal and full; ordered by tokens, head_dim, G, causal, T."""
    return [Point(n * K, t * K, d, g, c)
            for n in (16, 32) for d in (64, 128, 256) for g in (1, 4, 8) for c in (True, False)
            for t in (1, 2, 4, 8, 16, 32) if t <= n]


def core_grid() -> list[Point]:
    """The subset one 10-minute call runs, most telling first: head_dim 128 at 16K tokens (every
    T, G 1 and 8), head_dim 64 and 256 at T 2K and 8K, then 32K tokens at T 2K and 32K (G 8)."""
    pts = [Point(16 * K, t * K, 128, g, c) for g in (1, 8) for c in (True, False) for t in (1, 2, 4, 8, 16)]
    pts += [Point(16 * K, t * K, d, g, c) for d in (64, 256) for g in (1, 8) for c in (True, False) for t in (2, 8)]
    pts += [Point(32 * K, t * K, 128, 8, c) for c in (True, False) for t in (2, 32)]
    return pts


GRIDS = {"core": core_grid, "full": full_grid}


def select_points(points: Sequence[Point], spec: str | None) -> list[Point]:
    """``points[i:j]`` for ``spec = "i:j"`` (either side may be empty, as a Python slice)."""
    if not spec:
        return list(points)
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise ValueError(f"--points takes i:j, got {spec!r}")
    return list(points)[slice(int(lo) if lo else None, int(hi) if hi else None)]


# ------------------------------------------------------------------------------------ contenders
@dataclasses.dataclass(frozen=True)
class Contender:
    """``attention(causal) -> fn(q, k, v) -> out``, or why the contender cannot run at all."""
    name: str
    attention: Callable[[bool], Callable] | None = None
    error: str | None = None
    version: str | None = None


def _short_error(e: BaseException, limit: int = 400) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:limit]}"


def load_contenders(names: Iterable[str]) -> dict[str, Contender]:
    """Import each contender; an import failure becomes :attr:`Contender.error`."""
    out = {}
    for name in names:
        try:
            out[name] = _load_contender(name)
        except Exception as e:  # noqa: BLE001 (any import failure is a recorded result)
            out[name] = Contender(name, error=f"import: {_short_error(e)}")
    return out


def _load_contender(name: str) -> Contender:
    if name == "triton":
        from pallas_kernels.flash_attention import flash_attention  # noqa: PLC0415
        return Contender(name, lambda causal: lambda q, k, v: flash_attention(q, k, v, causal=causal)[0])
    if name == "mgpu":
        from pallas_kernels.flash_attention_mgpu_vjp import flash_attention_mgpu_vjp  # noqa: PLC0415
        return Contender(name, lambda causal: lambda q, k, v: flash_attention_mgpu_vjp(q, k, v, causal=causal)[0])
    if name in ("cudnn", "xla"):
        return Contender(name, lambda causal: lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=name))
    if name == "tokamax":
        import tokamax  # noqa: PLC0415
        return Contender(name, lambda causal: lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="mosaic"), version=tokamax.__version__)
    raise ValueError(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")


# -------------------------------------------------------------------------------------- programs
@dataclasses.dataclass(frozen=True)
class Job:
    """One program: ``contender``'s ``direction`` ("fwd" or "fwd_bwd") at ``point``, or with
    ``contender == INPUTS`` the point's input generator."""
    point: Point
    contender: str
    direction: str = ""


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled program (``fn``), or why there is none (``error`` / ``skipped``)."""
    fn: Callable | None = None
    error: str | None = None
    skipped: str | None = None
    lower_s: float | None = None
    compile_s: float | None = None


def _abstract(point: Point, direction: str) -> tuple:
    q = jax.ShapeDtypeStruct((point.b, point.t, point.hq, point.d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((point.b, point.t, point.hkv, point.d), jnp.bfloat16)
    return (q, kv, kv, q) if direction == "fwd_bwd" else (q, kv, kv)


def _program_fn(attention: Callable, direction: str) -> Callable:
    if direction == "fwd":
        return attention
    return lambda q, k, v, do: jax.vjp(attention, q, k, v)[1](do)


def _random_inputs(seed, point: Point) -> tuple:
    """``(q, k, v, dout)`` of ``point``, standard normal bf16."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [a.shape for a in _abstract(point, "fwd_bwd")]
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16) for kk, s in zip(ks, shapes))


def _skip_reason(job: Job, xla_max_scores_gib: float) -> str | None:
    gib = job.point.scores_bytes() / 2 ** 30
    if job.contender == "xla" and gib > xla_max_scores_gib:
        return f"the [B, Hq, T, T] float32 scores take {gib:g} GiB (over --xla-max-scores-gib {xla_max_scores_gib:g})"
    return None


def _compile(lowered) -> tuple:
    t0 = time.perf_counter()
    return lowered.compile(), time.perf_counter() - t0


def compile_jobs(jobs: Sequence[Job], contenders: dict[str, Contender], *, workers: int,
                 xla_max_scores_gib: float) -> dict[Job, Program]:
    """Lower every job on this thread and compile them in a pool of ``workers`` threads, each
    compile submitted as soon as its lowering is done."""
    out: dict[Job, Program] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        pending = {}
        for job in jobs:
            if job.contender == INPUTS:
                fn, args = functools.partial(_random_inputs, point=job.point), (jax.ShapeDtypeStruct((), jnp.int32),)
            else:
                c = contenders[job.contender]
                if c.error:
                    out[job] = Program(error=c.error)
                    continue
                skip = _skip_reason(job, xla_max_scores_gib)
                if skip:
                    out[job] = Program(skipped=skip)
                    continue
                fn, args = _program_fn(c.attention(job.point.causal), job.direction), _abstract(job.point, job.direction)
            t0 = time.perf_counter()
            try:
                lowered = jax.jit(fn).lower(*args)
            except Exception as e:  # noqa: BLE001
                out[job] = Program(error=f"lower: {_short_error(e)}")
                continue
            pending[job] = (time.perf_counter() - t0, pool.submit(_compile, lowered))
        for job, (lower_s, fut) in pending.items():
            try:
                compiled, compile_s = fut.result()
                out[job] = Program(fn=compiled, lower_s=lower_s, compile_s=compile_s)
            except Exception as e:  # noqa: BLE001
                out[job] = Program(error=f"compile: {_short_error(e)}", lower_s=lower_s)
    return out


# Compile order within a batch: the Mosaic GPU contenders first, their backward first.  Mosaic
# GPU kernels are compiled under one process-wide lock (jaxlib's kernel cache), one after
# another, so their chain is the batch's critical path and starts while the rest compile.
COMPILE_ORDER = ("tokamax", "mgpu", "triton", "cudnn", "xla")


def batch_jobs(points: Sequence[Point], names: Sequence[str]) -> list[Job]:
    """Every contender's directions at every point, in :data:`COMPILE_ORDER`, then each point's
    input generator."""
    order = sorted(names, key=lambda n: COMPILE_ORDER.index(n) if n in COMPILE_ORDER else len(COMPILE_ORDER))
    return ([Job(p, c, d) for c in order for p in points for d in reversed(DIRECTIONS)]
            + [Job(p, INPUTS) for p in points])


# -------------------------------------------------------------------------------------- measuring
@dataclasses.dataclass(frozen=True)
class Harness:
    """The device-facing steps of a run (tests substitute fakes).

    ``compile(jobs) -> {job: Program}``; ``time(fn, arg_sets) -> seconds per call``;
    ``rel_err(out, ref) -> float``."""
    compile: Callable[[Sequence[Job]], dict]
    time: Callable[[Callable, list], float]
    rel_err: Callable


@jax.jit
def _rel_err(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)


def device_harness(contenders: dict[str, Contender], *, workers: int, warmup: int, iters: int,
                   xla_max_scores_gib: float) -> Harness:
    return Harness(
        compile=functools.partial(compile_jobs, contenders=contenders, workers=workers,
                                  xla_max_scores_gib=xla_max_scores_gib),
        time=functools.partial(time_fn, warmup=warmup, iters=iters),
        rel_err=lambda out, ref: float(_rel_err(out, ref)))


def _error_entry(e: BaseException, stage: str) -> dict:
    entry = {"error": f"{stage}: {_short_error(e)}"}
    if is_oom(e):
        entry["oom"] = True
    return entry


def measure_point(point: Point, programs: dict[Job, Program], names: Sequence[str], harness: Harness) -> dict:
    """Time every contender's directions at ``point`` and check forward outputs; the point's record."""
    rec = dict(point.describe(), fwd_gflop=point.flops("fwd") / 1e9, results={}, check={})
    gen = programs[Job(point, INPUTS)]
    if gen.fn is None:
        rec["error"] = f"inputs: {gen.error}"
        return rec
    sets = [tuple(gen.fn(jnp.int32(100 + i))) for i in range(2)]
    ref_name, ref_out, rel = None, None, {}
    for name in [n for n in REFERENCES if n in names] + [n for n in names if n not in REFERENCES]:
        res = {}
        for direction in DIRECTIONS:
            prog = programs[Job(point, name, direction)]
            args = [s[:3] for s in sets] if direction == "fwd" else sets
            if prog.fn is None:
                res[direction] = {"error": prog.error} if prog.error else {"skipped": prog.skipped}
                continue
            entry = {"lower_s": round(prog.lower_s, 3), "compile_s": round(prog.compile_s, 3)}
            try:
                secs = harness.time(prog.fn, args)
                entry.update(ms=secs * 1e3, tflops=point.flops(direction) / secs / 1e12)
            except Exception as e:  # noqa: BLE001
                entry.update(_error_entry(e, "run"))
            res[direction] = entry
            if direction == "fwd" and "ms" in entry:
                try:
                    out = prog.fn(*args[0])
                    if ref_out is None and name in REFERENCES:
                        ref_name, ref_out = name, out
                    elif ref_out is not None:
                        err = harness.rel_err(out, ref_out)
                        rel[name] = err if math.isfinite(err) else str(err)
                    del out
                except Exception as e:  # noqa: BLE001
                    rel[name] = _error_entry(e, "check")["error"]
        rec["results"][name] = res
    rec["results"] = {name: rec["results"][name] for name in names}
    rec["check"] = {"ref": ref_name, "rel_err": rel} if ref_name else {"ref": None}
    add_ratios(rec)
    return rec


def add_ratios(rec: dict) -> None:
    """``vs_cudnn`` = cuDNN's time / the contender's, per direction, where both ran."""
    cud = rec["results"].get("cudnn", {})
    for res in rec["results"].values():
        for direction, entry in res.items():
            base = cud.get(direction, {}).get("ms")
            if base and entry.get("ms"):
                entry["vs_cudnn"] = base / entry["ms"]


# ----------------------------------------------------------------------------------------- store
class ResultStore:
    """The result JSON: a header, ``runs`` (one record per invocation) and ``points`` (one record
    per measured point, keyed by :attr:`Point.key`); rewritten whole (atomically) on save."""

    def __init__(self, path: str, run: dict, *, resume: bool):
        self.path = path
        doc = None
        if not resume and os.path.exists(path):
            raise FileExistsError(f"{path} exists: pass --resume to add this run's points to it, "
                                  f"or another --out")
        if resume and os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            if doc.get("benchmark") != BENCHMARK or doc.get("schema") != SCHEMA:
                raise ValueError(f"{path} holds benchmark {doc.get('benchmark')!r} schema {doc.get('schema')!r}, "
                                 f"not {BENCHMARK!r} schema {SCHEMA}: cannot resume it")
            devices = {r.get("device", {}).get("device") for r in doc["runs"]}
            if devices and run.get("device", {}).get("device") not in devices:
                raise ValueError(f"{path} was measured on {sorted(map(str, devices))}, this run is on "
                                 f"{run.get('device', {}).get('device')!r}: cannot resume it")
        if doc is None:
            doc = {"benchmark": BENCHMARK, "schema": SCHEMA, "dtype": "bfloat16",
                   "flop_convention": FLOP_CONVENTION, "timing": TIMING, "runs": [], "points": []}
        doc["runs"].append(run)
        self.doc = doc
        self.run_index = len(doc["runs"]) - 1
        self.done = {p["key"] for p in doc["points"]}

    @property
    def run(self) -> dict:
        return self.doc["runs"][self.run_index]

    def add(self, rec: dict) -> None:
        rec["run"] = self.run_index
        self.doc["points"].append(rec)
        self.done.add(rec["key"])
        self.save()

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)


@dataclasses.dataclass(frozen=True)
class Budget:
    """Seconds from ``start`` (``time.monotonic``) after which no new work begins; None: no limit."""
    seconds: float | None
    start: float

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, more_s: float = 0.0) -> bool:
        return self.seconds is None or self.elapsed() + more_s <= self.seconds


def _fmt_point(rec: dict, names: Sequence[str]) -> str:
    cells = []
    for name in names:
        res = rec.get("results", {}).get(name, {})
        vals = [res.get(d, {}).get("tflops") for d in DIRECTIONS]
        cells.append(f"{name} " + "/".join("-" if v is None else f"{v:.0f}" for v in vals))
    return f"{rec['key']:>28}  TF/s fwd/fwd+bwd: " + "  ".join(cells)


def run_grid(points: Sequence[Point], store: ResultStore, names: Sequence[str], harness: Harness, budget: Budget,
             *, batch_points: int, log: Callable[[str], None]) -> dict:
    """Measure the points not yet in ``store``, batch by batch; returns the run's counts."""
    todo = [p for p in points if p.key not in store.done]
    counts = {"measured": 0, "skipped_existing": len(points) - len(todo), "not_started_budget": 0}
    slowest = 0.0
    for i in range(0, len(todo), max(1, batch_points)):
        batch = todo[i:i + max(1, batch_points)]
        if not budget.allows(slowest):
            counts["not_started_budget"] += len(todo) - i
            log(f"budget: {len(todo) - i} points not started ({budget.elapsed():.0f} s of {budget.seconds:g})")
            break
        t0 = time.monotonic()
        programs = harness.compile(batch_jobs(batch, names))
        log(f"compiled {len(programs)} programs of {len(batch)} points in {time.monotonic() - t0:.1f} s")
        for j, point in enumerate(batch):
            if not budget.allows():
                counts["not_started_budget"] += len(todo) - i - j
                log(f"budget: {len(todo) - i - j} points not started ({budget.elapsed():.0f} s)")
                return counts
            tp = time.monotonic()
            rec = measure_point(point, programs, names, harness)
            rec["wall_s"] = round(time.monotonic() - tp, 2)
            store.add(rec)
            counts["measured"] += 1
            log(_fmt_point(rec, names))
        del programs
        slowest = max(slowest, time.monotonic() - t0)
    return counts


# ------------------------------------------------------------------------------------------- run
def versions(contenders: dict[str, Contender]) -> dict:
    out = {"jax": jax.__version__}
    try:
        import jaxlib  # noqa: PLC0415
        out["jaxlib"] = jaxlib.__version__
    except ImportError:
        out["jaxlib"] = None
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415
        out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # noqa: BLE001 (absent on CPU builds)
        out["cudnn"] = None
    for c in contenders.values():
        if c.version:
            out[c.name] = c.version
    return out


def _log_fn(start: float) -> Callable[[str], None]:
    return lambda msg: print(f"[{time.monotonic() - start:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="core")
    ap.add_argument("--points", default=None, help="i:j, a slice of the grid's points (see --list)")
    ap.add_argument("--list", action="store_true", help="print the grid's points with their indices and exit")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS))
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/flash_attention_<gpu>.json)")
    ap.add_argument("--resume", action="store_true", help="keep the points already in --out and add the others")
    ap.add_argument("--budget-s", type=float, default=None, help="start no work past this many seconds")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-points", type=int, default=4, help="points compiled together before timing")
    ap.add_argument("--compile-workers", type=int, default=12)
    ap.add_argument("--xla-max-scores-gib", type=float, default=8.0,
                    help="skip xla where the float32 scores [B, Hq, T, T] take more")
    ap.add_argument("--commit", default=None, help="the source's commit, where git cannot tell")
    return ap.parse_args(argv)


def main(argv=None, harness: Harness | None = None) -> dict:
    """Run the benchmark; returns ``{"counts": ..., "out": path}`` (``--list``: the points)."""
    start = time.monotonic()
    args = parse_args(argv)
    log = _log_fn(start)
    points = select_points(GRIDS[args.grid](), args.points)
    if args.list:
        offset = int((args.points or "0:").partition(":")[0] or 0)
        offset = offset + len(GRIDS[args.grid]()) if offset < 0 else offset
        for i, p in enumerate(points):
            print(f"{offset + i:4d} {p.key:>28} B={p.b} Hq={p.hq} Hkv={p.hkv} fwd {p.flops('fwd') / 1e12:.2f} TFLOP")
        return {"points": [p.key for p in points]}
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    contenders = load_contenders(names)
    for c in contenders.values():
        if c.error:
            log(f"{c.name}: {c.error}")
    out = args.out or os.path.join(ROOT, "bench", "results", f"flash_attention_{gpu_slug()}.json")
    commit, source = git_commit(args.commit)
    run = {"device": device_info(), "versions": versions(contenders), "commit": commit, "commit_source": source,
           "argv": " ".join(shlex.quote(a) for a in ["bench/flash_attention.py"] + list(
               argv if argv is not None else sys.argv[1:])),
           "grid": args.grid, "points_slice": args.points, "n_points": len(points), "contenders": names,
           "contender_errors": {c.name: c.error for c in contenders.values() if c.error},
           "iters": args.iters, "warmup": args.warmup, "batch_points": args.batch_points,
           "compile_workers": args.compile_workers, "xla_max_scores_gib": args.xla_max_scores_gib,
           "budget_s": args.budget_s, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    store = ResultStore(out, run, resume=args.resume)
    store.save()
    harness = harness or device_harness(contenders, workers=args.compile_workers, warmup=args.warmup,
                                        iters=args.iters, xla_max_scores_gib=args.xla_max_scores_gib)
    log(f"{len(points)} points ({args.grid} grid, slice {args.points or 'all'}), contenders {', '.join(names)}, "
        f"out {out}")
    counts = run_grid(points, store, names, harness, Budget(args.budget_s, start),
                      batch_points=args.batch_points, log=log)
    store.run.update(counts=counts, wall_s=round(time.monotonic() - start, 1))
    store.save()
    log(f"done: {counts}")
    return {"counts": counts, "out": out}


if __name__ == "__main__":
    main()
