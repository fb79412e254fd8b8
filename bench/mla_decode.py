"""Shared-prefix MLA decode (DeepSeek-V2/V3 absorbed form): ours against per-sequence baselines
and FlashInfer's MLA paged decode, bf16, one query per sequence, on one GPU in one process.

A point: ``B`` sequences continue one prompt of ``P`` tokens, each with ``S`` tokens of its own
after it (every suffix full), ``H`` query heads.  The latent cache holds per token
``c [R = 512]`` (kv_lora_rank) and ``k_rope [Dr = 64]``, read by every head;
``sm_scale = 1 / sqrt(128 + 64)`` (the model's query-key width).  Grid (:func:`full_grid`, 80
points, ``--list``): DeepSeek-V2-Lite (``H = 16``) and DeepSeek-V3 (``H = 128``) heads x
``S`` in {128, 1024} x ``P`` in {4K, 8K, 16K, 32K} x ``B`` in {64, 128, 256, 512, 1024}.

Contenders (``--contenders``; ``results[<name>]`` of each point):

* ``ours``: ``jax_prefix_attn.mla_attention(..., impl="mgpu")``: the prefix latents read once
  for all ``B * H`` query rows, each suffix per sequence, merged through the LSE;
* ``ours_flat``: the same function with no shared prefix (a placeholder of length 0, whose empty
  part still writes and merges ``B H R`` float32 states) and each sequence's own copy of
  prefix + suffix as its suffix: our kernels without prefix sharing;
* ``flat_xla``: XLA over per-sequence caches ``[B, P + S, R]`` / ``[B, P + S, Dr]`` (the prefix
  copied into every sequence's cache, as a cache without sharing holds it; built outside the
  timed region): scores by two batched dots (bf16, float32 accumulation), the softmax in
  float32, ``p c`` with ``p`` in bf16: what XLA makes of a per-sequence decode (the
  library's ``impl="reference"`` computes in float32 at HIGHEST precision: a reference, not
  a decode path);
* ``flashinfer``: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` over a paged cache whose
  every sequence lists the shared prefix pages then its own suffix pages (``--page-size``, 64;
  ``bench/mla_decode_flashinfer.py``).  Optional: where it cannot be imported, the reason is
  recorded per point and the grid goes on.

Timing: ours and the flat columns as ``n`` dependent calls in one jitted loop whose body is one
CUDA graph (:func:`bench.timing.loop_time`, median of 3 / ``n``, ``n`` for ~30 ms from the
floor); where the floor predicts under 200 us, 8 calls per loop iteration (``unroll``), so the
loop's own 15-19 us per iteration is shared by 8 calls; ``runs[i].harness`` records the loop's
per-call cost with an identity body at unroll 1 and 8.  FlashInfer: planned outside the timed
region, a ``torch.cuda.CUDAGraph`` of 10-200 calls on the same inputs (independent calls, as
FlashInfer's own benchmarks), median of 7 replays timed with CUDA events
(:func:`bench.peers_flashinfer.graph_time`; ``runs[i].harness.torch_graph_empty_kernel``).  With
``--interpret`` (CPU smoke) every column is the wall time of one call, compile included: no
measurement.

Floor: ``max(bytes / copy bandwidth, flops / matmul rate)``, both rates measured at the start of
the run (``runs[i].rates``); bytes = the prefix latents once + every suffix + queries + outputs,
flops = ``2 B H (P + S) (R + Dr + R)``.  ``floor_flat_ms``: the same with the prefix read once per
sequence (what any per-sequence read costs).  Per contender ``over_floor = ms / floor_ms``;
``speedup.vs_<name> = <name>'s ms / ours``.  ``check``: each column's output against ours
(relative Frobenius error, max abs).

Memory: a contender whose estimated bytes (:func:`memory_bytes`) exceed what the allocator has
free is recorded as skipped with the reason; an out-of-memory error is recorded (``oom``) and
the grid goes on.  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.8 (the rest for torch).

Output (``--out``, default ``bench/results/mla_decode_<gpu>.json``): per run the device, the
jax / jaxlib / torch / FlashInfer versions, the commit (``--commit``, else git), the command
line, the rates; per point its shape, bytes, flops, floors and the entries above.  The file is
rewritten atomically after every point; an existing file is refused unless ``--resume`` (which
keeps its points of status ``ok`` and measures the others).  ``--budget-s`` starts no point
past that many seconds.  FlashInfer compiles its MLA module on first use (minutes) in a
background thread while our columns of the first points are measured (status ``partial``,
``jax_during_flashinfer_compile``); their FlashInfer entries follow the compile.

GPU machine (FlashInfer unpacked as in ``bench/README.md``)::

    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 bench/mla_decode.py --budget-s 500 --commit SHA
    python3 bench/mla_decode.py --resume --budget-s 500 --commit SHA      # the rest, repeatable
    python3 bench/mla_decode.py --tiny --interpret --flashinfer-module reference --out /tmp/m.json  # CPU
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")   # the rest of the GPU for torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402

import jax_prefix_attn as jpa  # noqa: E402
from bench import mla_decode_flashinfer as mfi  # noqa: E402
from bench.mla_decode_plot import point_line  # noqa: E402
from bench.peers_ours import loop_calls  # noqa: E402
from bench.timing import (GRAPH_ALWAYS, device_info, git_commit, gpu_slug, is_oom, loop_time,  # noqa: E402
                          measure_copy_bandwidth, measure_matmul_rate)

__all__ = ["Point", "Inputs", "full_grid", "tiny_grid", "select_points", "cost", "floors", "memory_bytes",
           "fits", "make_inputs", "flat_xla", "Store", "main", "CONTENDERS", "SM_SCALE"]

BENCHMARK, SCHEMA = "mla_decode", 1
CONTENDERS = ("ours", "ours_flat", "flat_xla", "flashinfer")
MODELS = {"v2lite": 16, "v3": 128}        # query heads of DeepSeek-V2-Lite and DeepSeek-V3
SUFFIXES, PREFIXES, BATCHES = (128, 1024), (4096, 8192, 16384, 32768), (64, 128, 256, 512, 1024)
SM_SCALE = 1 / math.sqrt(128 + 64)
UNROLL, UNROLL_BELOW_S = 8, 200e-6
MEM_USE = 0.9                             # share of the free memory a contender may plan on


@dataclasses.dataclass(frozen=True)
class Point:
    """``batch`` sequences of ``heads`` query heads over one shared prefix of ``prefix`` tokens
    and ``suffix`` tokens each; latent width ``rank``, RoPE width ``rope``."""
    model: str
    heads: int
    batch: int
    prefix: int
    suffix: int
    rank: int = 512
    rope: int = 64

    @property
    def key(self) -> str:
        return f"{self.model}_B{self.batch}_P{self.prefix}_S{self.suffix}"

    def describe(self) -> dict:
        return dict(dataclasses.asdict(self), key=self.key)


def full_grid() -> list[Point]:
    """Both head counts x S x P x B, in that nesting order."""
    return [Point(m, h, b, p, s) for m, h in MODELS.items() for s in SUFFIXES for p in PREFIXES
            for b in BATCHES]


def tiny_grid() -> list[Point]:
    """Two CPU smoke points at the kernels' smallest widths (``R = 128``)."""
    return [Point("tiny", 2, 2, 64, 64, rank=128), Point("tiny", 2, 3, 32, 48, rank=128)]


def select_points(points, spec: str | None) -> list[Point]:
    """``points[i:j]`` for ``spec = "i:j"`` (either side may be empty, as a Python slice)."""
    if not spec:
        return list(points)
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise ValueError(f"--points takes i:j, got {spec!r}")
    return list(points)[slice(int(lo) if lo else None, int(hi) if hi else None)]


def cost(pt: Point, itemsize: int = 2) -> dict:
    """``bytes`` (prefix once), ``bytes_flat`` (prefix per sequence) and ``flops`` of a point."""
    w = pt.rank + pt.rope
    io = pt.batch * pt.heads * (w + pt.rank) * itemsize
    return {"bytes": float((pt.prefix + pt.batch * pt.suffix) * w * itemsize + io),
            "bytes_flat": float(pt.batch * (pt.prefix + pt.suffix) * w * itemsize + io),
            "flops": 2.0 * pt.batch * pt.heads * (pt.prefix + pt.suffix) * (w + pt.rank)}


def floors(c: dict, bw: float, mma: float) -> dict:
    ms = lambda nbytes: max(nbytes / bw, c["flops"] / mma) * 1e3  # noqa: E731
    return {"floor_ms": ms(c["bytes"]), "floor_flat_ms": ms(c["bytes_flat"]),
            "floor_bound": "memory" if c["bytes"] / bw >= c["flops"] / mma else "compute"}


def memory_bytes(pt: Point) -> dict:
    """Estimated device bytes: the point's inputs, the per-sequence caches of the flat columns,
    and each contender's own buffers (with the caches for the flat ones): float32 partial
    states, XLA's float32 scores and bf16 probabilities, FlashInfer's paged copy of the cache
    and its output."""
    w, rows, ctx = pt.rank + pt.rope, pt.batch * pt.heads, pt.prefix + pt.suffix
    cache, states = pt.batch * ctx * w * 2, rows * pt.rank * 4 * 4
    return {"inputs": (pt.prefix + pt.batch * pt.suffix) * w * 2 + rows * w * 2, "cache": cache,
            "ours": states + pt.prefix * w * 2, "ours_flat": cache + states, "flat_xla": cache + 16 * rows * ctx,
            "flashinfer": (pt.prefix + pt.batch * pt.suffix) * w * 2 + rows * pt.rank * 6}


def free_bytes(limit_gb: float | None) -> float | None:
    """Bytes the JAX allocator has free (``limit_gb`` caps it), None where unknown (CPU)."""
    free = None
    try:
        st = jax.devices()[0].memory_stats()
        if st and "bytes_limit" in st:
            free = st["bytes_limit"] - st.get("bytes_in_use", 0)
    except Exception:  # noqa: BLE001 - no statistics on this backend
        pass
    if limit_gb is not None:
        free = limit_gb * 2 ** 30 if free is None else min(free, limit_gb * 2 ** 30)
    return free


def fits(need: float, free: float | None) -> str | None:
    """None when ``need`` bytes fit in ``MEM_USE`` of ``free``, else the reason."""
    if free is None or need <= MEM_USE * free:
        return None
    return f"needs ~{need / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free (x{MEM_USE})"


class Inputs(NamedTuple):
    """``q_nope [B, 1, H, R]``, ``q_rope [B, 1, H, Dr]``, ``prefix_c [P, R]``, ``prefix_k [P, Dr]``,
    ``suffix_c [B, S, R]``, ``suffix_k [B, S, Dr]`` (bf16 standard normal), ``lengths [B]``."""
    q_nope: jax.Array
    q_rope: jax.Array
    prefix_c: jax.Array
    prefix_k: jax.Array
    suffix_c: jax.Array
    suffix_k: jax.Array
    lengths: jax.Array


def make_inputs(pt: Point) -> Inputs:
    """The point's inputs, seeded by its key (the same arrays on every call)."""
    b, h, r, dr, p, s = pt.batch, pt.heads, pt.rank, pt.rope, pt.prefix, pt.suffix
    shapes = ((b, 1, h, r), (b, 1, h, dr), (p, r), (p, dr), (b, s, r), (b, s, dr))
    ks = jax.random.split(jax.random.PRNGKey(zlib.crc32(pt.key.encode()) & 0x7FFFFFFF), len(shapes))
    arrs = [jax.random.normal(k, sh, jnp.bfloat16) for k, sh in zip(ks, shapes)]
    return Inputs(*arrs, lengths=jnp.full((b,), s, jnp.int32))


@jax.jit
def per_sequence_cache(prefix, suffix):
    """``prefix [P, X]``, ``suffix [B, S, X]`` -> ``[B, P + S, X]``: the prefix copied per sequence."""
    b, _, x = suffix.shape
    return jnp.concatenate([jnp.broadcast_to(prefix, (b,) + prefix.shape), suffix], axis=1)


def flat_xla(qn, qr, cache_c, cache_k, lengths):
    """Absorbed MLA decode in XLA over per-sequence caches: ``qn [B, H, R]``, ``qr [B, H, Dr]``,
    ``cache_c [B, T, R]``, ``cache_k [B, T, Dr]``, ``lengths [B]`` (each >= 1) -> ``[B, H, R]``."""
    f32 = jnp.float32
    s = (jnp.einsum("bhr,btr->bht", qn, cache_c, preferred_element_type=f32)
         + jnp.einsum("bhd,btd->bht", qr, cache_k, preferred_element_type=f32)) * SM_SCALE
    s = jnp.where((jnp.arange(cache_c.shape[1]) < lengths[:, None])[:, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bht,btr->bhr", p.astype(cache_c.dtype), cache_c, preferred_element_type=f32)
    return (o / jnp.sum(p, axis=-1, keepdims=True)).astype(qn.dtype)


def _ours(impl: str, interpret: bool, no_prefix: bool = False):
    """``fn(q_nope, q_rope, prefix_c, prefix_k, suffix_c, suffix_k, lengths) -> [B, 1, H, R]``;
    ``no_prefix``: the prefix is a placeholder of length 0 (everything in the suffix)."""
    def fn(qn, qr, pc, pk, sc, sk, sl):
        kw = {"prefix_lengths": jnp.zeros((1,), jnp.int32)} if no_prefix else {}
        return jpa.mla_attention(qn, qr, pc, pk, sc, sk, suffix_lengths=sl, sm_scale=SM_SCALE, impl=impl,
                                 interpret=interpret, **kw)
    return fn


@jax.jit
def _compare(out, ref):
    d = out.astype(jnp.float32) - ref.astype(jnp.float32)
    return jnp.linalg.norm(d) / jnp.linalg.norm(ref.astype(jnp.float32)), jnp.max(jnp.abs(d))


def _error(e: BaseException) -> dict:
    entry = {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}
    if is_oom(e):
        entry["oom"] = True
    return entry


def time_jax(fn, q, rest, pred_s: float, loop: bool) -> tuple[dict, jax.Array]:
    """``({"ms", "timing"}, output)`` of ``fn(q, *rest)`` (see the module doc's timing)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(jax.jit(fn)(q, *rest))
    if not loop:
        return {"ms": (time.perf_counter() - t0) * 1e3, "timing": {"method": "one call, compile included"}}, out
    n, u = loop_calls(max(2 * pred_s, 15e-6)), UNROLL if pred_s < UNROLL_BELOW_S else 1
    ms = loop_time(fn, q, rest, compiler_options=GRAPH_ALWAYS, n=n, unroll=u) * 1e3
    return {"ms": ms, "timing": {"method": "loop_time", "n": n, "unroll": u}}, out


@dataclasses.dataclass
class Context:
    """What every point of a run shares."""
    names: list
    impl: str
    interpret: bool
    rates: dict
    mem_limit_gb: float | None
    fi_cls: object = None
    fi_why: str | None = None
    ws: object = None
    page_size: int = 64
    fi_backend: str = "auto"


def measure_jax(pt: Point, ctx: Context) -> tuple[dict, Inputs | None, jax.Array | None]:
    """The point's record with the JAX columns, its inputs and our output (None where skipped)."""
    rec = dict(pt.describe(), **cost(pt), status="ok", results={},
               check={"ref": "ours", "rel_err": {}, "max_abs": {}})
    rec.update(floors(rec, ctx.rates["copy_bw_Bps"], ctx.rates["matmul_flops"]))
    need, res, loop = memory_bytes(pt), rec["results"], not ctx.interpret
    why = fits(need["inputs"] + need["ours"], free_bytes(ctx.mem_limit_gb))
    if why:
        rec.update(status="skipped", skipped=f"inputs: {why}")
        return rec, None, None
    inp, ours_out = make_inputs(pt), None
    if "ours" in ctx.names:
        try:
            res["ours"], ours_out = time_jax(_ours(ctx.impl, ctx.interpret), inp.q_nope, inp[1:],
                                             rec["floor_ms"] * 1e-3, loop)
        except Exception as e:  # noqa: BLE001 - recorded, the other columns run
            res["ours"] = _error(e)
    cache = None     # the per-sequence caches [B, P + S, R] / [B, P + S, Dr] of the flat columns
    for name in [n for n in ("ours_flat", "flat_xla") if n in ctx.names]:
        why = fits(need[name] - (need["cache"] if cache else 0), free_bytes(ctx.mem_limit_gb))
        if why:
            res[name] = {"skipped": why}
            continue
        try:
            if cache is None:
                cache = (per_sequence_cache(inp.prefix_c, inp.suffix_c), per_sequence_cache(inp.prefix_k, inp.suffix_k))
            full, pred = jnp.full_like(inp.lengths, pt.prefix + pt.suffix), rec["floor_flat_ms"] * 1e-3
            if name == "ours_flat":      # a placeholder prefix of length 0: everything in the suffix
                none_c, none_k = jnp.zeros((64, pt.rank), jnp.bfloat16), jnp.zeros((64, pt.rope), jnp.bfloat16)
                res[name], out = time_jax(_ours(ctx.impl, ctx.interpret, no_prefix=True), inp.q_nope,
                                          (inp.q_rope, none_c, none_k, *cache, full), pred, loop)
            else:
                res[name], out = time_jax(flat_xla, inp.q_nope[:, 0], (inp.q_rope[:, 0], *cache, full), pred, loop)
            if ours_out is not None:
                err, mx = _compare(out.reshape(ours_out.shape), ours_out)
                rec["check"]["rel_err"][name], rec["check"]["max_abs"][name] = float(err), float(mx)
            del out
        except Exception as e:  # noqa: BLE001
            res[name] = _error(e)
    del cache
    return rec, inp, ours_out


def measure_flashinfer(rec: dict, pt: Point, inp: Inputs, ours_out, ctx: Context) -> None:
    """FlashInfer's entry and check of ``rec`` (or the reason it is skipped)."""
    res = rec["results"]
    if ctx.fi_cls is None:
        res["flashinfer"] = {"skipped": ctx.fi_why}
        return
    why = fits(memory_bytes(pt)["flashinfer"], free_bytes(ctx.mem_limit_gb))
    if why:
        res["flashinfer"] = {"skipped": why}
        return
    res["flashinfer"], check = mfi.measure(ctx.fi_cls, pt, inp, ours_out, ctx.ws, page_size=ctx.page_size,
                                           backend=ctx.fi_backend, sm_scale=SM_SCALE)
    if check:
        rec["check"]["rel_err"]["flashinfer"] = check["rel_err"]
        rec["check"]["max_abs"]["flashinfer"] = check["max_abs"]


def skip_failed_warm_up(ctx: Context, warm: dict) -> None:
    """No FlashInfer entries after a failed warm-up (each would compile again, for minutes)."""
    if ctx.fi_cls is not None and warm.get("errors"):
        ctx.fi_cls, ctx.fi_why = None, f"FlashInfer's warm-up failed: {warm['errors'][0]}"[:300]


def finish(rec: dict) -> None:
    """``over_floor`` per measured contender and ours' speedups against the others."""
    ms = {n: e["ms"] for n, e in rec["results"].items() if isinstance(e.get("ms"), (int, float))}
    for n, v in ms.items():
        rec["results"][n]["over_floor"] = v / rec["floor_ms"]
    if "ours" in ms:
        rec["speedup"] = {f"vs_{n}": v / ms["ours"] for n, v in ms.items() if n != "ours"}


class Store:
    """The result JSON: a header, ``runs`` (one record per invocation) and ``points`` (keyed by
    :attr:`Point.key`); rewritten whole, atomically (a temporary file and ``os.replace``)."""

    def __init__(self, path: str, run: dict, *, resume: bool):
        self.path, doc = path, None
        if os.path.exists(path):
            if not resume:
                raise FileExistsError(f"{path} exists: pass --resume to keep its points and add this run's, "
                                      f"or another --out")
            with open(path) as f:
                doc = json.load(f)
            if doc.get("benchmark") != BENCHMARK or doc.get("schema") != SCHEMA:
                raise ValueError(f"{path} holds benchmark {doc.get('benchmark')!r} schema {doc.get('schema')!r}, "
                                 f"not {BENCHMARK!r} schema {SCHEMA}: cannot resume it")
            devices = {r["device"].get("device") for r in doc["runs"]}
            if devices and run["device"].get("device") not in devices:
                raise ValueError(f"{path} was measured on {sorted(map(str, devices))}, this run is on "
                                 f"{run['device'].get('device')!r}: cannot resume it")
            doc["points"] = [p for p in doc["points"] if p.get("status") == "ok"]
        if doc is None:
            doc = {"benchmark": BENCHMARK, "schema": SCHEMA, "dtype": "bfloat16", "sm_scale": SM_SCALE,
                   "doc": __doc__.split("\n\n")[0], "runs": [], "points": []}
        doc["runs"].append(run)
        self.doc, self.run_index = doc, len(doc["runs"]) - 1
        self.done = {p["key"] for p in doc["points"]}

    @property
    def run(self) -> dict:
        return self.doc["runs"][self.run_index]

    def put(self, rec: dict) -> None:
        """Adds or replaces the point ``rec["key"]`` and saves."""
        rec["run"] = self.run_index
        keys = [p["key"] for p in self.doc["points"]]
        if rec["key"] in keys:
            self.doc["points"][keys.index(rec["key"])] = rec
        else:
            self.doc["points"].append(rec)
        self.done.add(rec["key"])
        self.save()

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1)
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=None, help="i:j, a slice of the grid (see --list)")
    ap.add_argument("--list", action="store_true", help="print the grid with indices and exit")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="subset of " + ",".join(CONTENDERS))
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/mla_decode_<gpu>.json)")
    ap.add_argument("--resume", action="store_true", help="keep the measured points of --out, add the others")
    ap.add_argument("--budget-s", type=float, default=None, help="start no point past this many seconds")
    ap.add_argument("--commit", default=None, help="the commit measured (takes precedence over git)")
    ap.add_argument("--page-size", type=int, default=None, help="FlashInfer's page size (64; --tiny: 16)")
    ap.add_argument("--flashinfer-module", default="flashinfer", help="or 'reference': the torch reference")
    ap.add_argument("--flashinfer-backend", default="auto", help="the wrapper's backend (auto, fa2, fa3)")
    ap.add_argument("--mem-limit-gb", type=float, default=None, help="cap on the memory a contender may plan on")
    ap.add_argument("--tiny", action="store_true", help="one tiny point (CPU smoke)")
    ap.add_argument("--interpret", action="store_true", help="our kernels in interpret mode, one timed call each")
    ap.add_argument("--impl", default="mgpu", choices=("mgpu", "reference"), help="mla_attention's impl for ours")
    return ap.parse_args(argv)


def _print_list(grid, points, spec):
    lo = int((spec or "0:").partition(":")[0] or 0)
    for i, p in enumerate(points):
        c, m = cost(p), memory_bytes(p)
        print(f"{(lo if lo >= 0 else lo + len(grid)) + i:3d} {p.key:>22} H={p.heads:<3} {c['bytes'] / 1e9:6.2f} GB "
              f"(flat {c['bytes_flat'] / 1e9:5.1f}) {c['flops'] / 1e12:5.2f} TFLOP; flat_xla needs "
              f"{(m['inputs'] + m['flat_xla']) / 2 ** 30:5.1f} GiB")


def _run_record(args, argv, ctx: Context, fi_mod, info: dict) -> dict:
    commit, source = git_commit(args.commit)
    cmd = ["bench/mla_decode.py"] + list(sys.argv[1:] if argv is None else argv)
    return {"device": info, "versions": dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
                                             **mfi.versions(ctx.fi_cls, fi_mod)),
            "commit": commit, "commit_source": source, "argv": " ".join(shlex.quote(a) for a in cmd),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rates": ctx.rates,
            "contenders": ctx.names, "impl": ctx.impl, "interpret": ctx.interpret, "points_slice": args.points,
            "budget_s": args.budget_s, "harness": {},
            "flashinfer": {"available": ctx.fi_cls is not None, "reason": ctx.fi_why, "module": args.flashinfer_module,
                           "wrapper": mfi.WRAPPER, "backend": ctx.fi_backend, "page_size": ctx.page_size,
                           "workspace_bytes": mfi.WORKSPACE_BYTES}}


def main(argv=None) -> dict:
    """Run the benchmark; returns ``{"out", "counts"}`` (``--list``: ``{"points"}``)."""
    start = time.monotonic()
    args = parse_args(argv)
    log = lambda msg: print(f"[{time.monotonic() - start:7.1f}s] {msg}", flush=True)  # noqa: E731
    remaining = lambda: None if args.budget_s is None else args.budget_s - (time.monotonic() - start)  # noqa: E731
    grid = tiny_grid() if args.tiny else full_grid()
    points = select_points(grid, args.points)
    if args.list:
        _print_list(grid, points, args.points)
        return {"points": [p.key for p in points]}
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    if set(names) - set(CONTENDERS):
        raise ValueError(f"unknown contenders {sorted(set(names) - set(CONTENDERS))}; known: {', '.join(CONTENDERS)}")
    out = args.out or os.path.join(ROOT, "bench", "results", f"mla_decode_{gpu_slug()}.json")
    if os.path.exists(out) and not args.resume:
        raise FileExistsError(f"{out} exists: pass --resume to keep its points and add this run's, or another --out")
    fi_cls, fi_mod, fi_why = (mfi.load(args.flashinfer_module) if "flashinfer" in names
                              else (None, None, "not among --contenders"))
    info = device_info()           # JAX first: it takes its share of the GPU memory before torch
    small = args.tiny and jax.devices()[0].platform == "cpu"
    rates = {"copy_bw_Bps": measure_copy_bandwidth(1 << 22 if small else 2 << 30),
             "matmul_flops": measure_matmul_rate(128 if small else 8192)}
    ctx = Context(names, args.impl, args.interpret, rates, args.mem_limit_gb, fi_cls, fi_why,
                  page_size=args.page_size or (16 if args.tiny else 64), fi_backend=args.flashinfer_backend)
    store = Store(out, _run_record(args, argv, ctx, fi_mod, info), resume=args.resume)
    run = store.run
    store.save()
    todo = [p for p in points if p.key not in store.done]
    log(f"{len(todo)} of {len(points)} points to measure -> {out}; copy {rates['copy_bw_Bps'] / 1e12:.2f} TB/s, "
        f"matmul {rates['matmul_flops'] / 1e12:.0f} TFLOP/s; FlashInfer: {fi_why or run['versions']}")
    if not args.interpret and todo:
        q = jnp.ones((8, 16, 512), jnp.bfloat16)
        run["harness"]["jax_loop_identity"] = {
            f"u{u}_ms": loop_time(lambda x: x, q, (), compiler_options=GRAPH_ALWAYS, n=256, unroll=u) * 1e3
            for u in (1, UNROLL)}
    warm, thread = {}, None
    if fi_cls is not None and todo:     # FlashInfer compiles (nvcc) while our first columns run
        ctx.ws, thread = mfi.start(fi_cls, fi_mod, {(p.heads, p.rank, p.rope) for p in todo}, ctx.page_size,
                                   ctx.fi_backend, run, warm)
    counts, deferred = {"measured": 0, "skipped_existing": len(points) - len(todo), "not_started_budget": 0}, []
    over = lambda: remaining() is not None and remaining() <= 0  # noqa: E731

    def flush_deferred():
        """The FlashInfer entries of the points measured during its compile, once it is done
        (past the budget they stay "partial", measured again by --resume)."""
        if thread is None or thread.is_alive():
            return
        run["flashinfer"].setdefault("warm_up", warm)
        while deferred and not over():
            pt, ours_host = deferred.pop(0)
            rec = next(p for p in store.doc["points"] if p["key"] == pt.key)
            skip_failed_warm_up(ctx, warm)
            measure_flashinfer(rec, pt, make_inputs(pt), None if ours_host is None else jnp.asarray(ours_host), ctx)
            rec["status"] = "ok"
            finish(rec)
            store.put(rec)
            log(point_line(rec))

    for i, pt in enumerate(todo):
        flush_deferred()
        if over():
            counts["not_started_budget"], run["not_started_budget"] = len(todo) - i, [p.key for p in todo[i:]]
            log(f"budget: {len(todo) - i} points not started")
            break
        t0 = time.monotonic()
        try:
            rec, inp, ours_out = measure_jax(pt, ctx)
        except Exception as e:  # noqa: BLE001 - the point is recorded as failed, the grid goes on
            rec, inp, ours_out = dict(pt.describe(), status="error", **_error(e)), None, None
        if inp is not None and "flashinfer" in names:
            if thread is not None and thread.is_alive():    # its FlashInfer entry after the compile
                rec.update(status="partial", jax_during_flashinfer_compile=True)
                rec["results"]["flashinfer"] = {"pending": "FlashInfer's kernels were compiling"}
                deferred.append((pt, None if ours_out is None else np.asarray(ours_out)))
            else:
                skip_failed_warm_up(ctx, warm)
                measure_flashinfer(rec, pt, inp, ours_out, ctx)
        del inp, ours_out
        if rec["status"] != "error":
            finish(rec)
        rec["wall_s"] = round(time.monotonic() - t0, 2)
        store.put(rec)
        counts["measured"] += 1
        log(point_line(rec))
    if thread is not None:
        thread.join(timeout=None if remaining() is None else max(0.0, remaining()))
        if thread.is_alive():
            run["flashinfer"]["warm_up"] = {"error": "still compiling at the budget"}
        flush_deferred()
        log(f"FlashInfer warm-up: {run['flashinfer']['warm_up']}")
    run.update(counts=counts, wall_s=round(time.monotonic() - start, 1))
    store.save()
    log(f"done: {counts}")
    return {"out": out, "counts": counts}


if __name__ == "__main__":
    main()
