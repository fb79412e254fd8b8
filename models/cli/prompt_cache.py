"""The Prompt Cache path of ``jpa-sample``: prompts written in PML against a schema, served from
the stored keys/values of the schema's modules (:mod:`models.prompt_cache`).

    jpa-sample --schema docs.pml --prompt-pml q1.pml --prompt-pml q2.pml --cache-dir pc --compare

* Inputs, checked before the model loads: the schema file and every prompt file are parsed
  (`parse_schema`; `parse_prompt` against that schema: unknown modules or parameters, two
  members of one union, imports out of order) and each prompt must end with new text, from
  which the first token is computed. Arguments longer than their `len` (counted in tokens) are
  found once the tokenizer is loaded. Every problem is a UsageError naming the file.
* Modules (`PromptCache.encode_or_load`): the device, host and disk (`--cache-dir`) tiers are
  looked up in that order, else every module of the schema is encoded in one batched call and
  stored (written to the directory too). A directory made for another model, dtype or
  tokenizer is refused; a schema whose text changed since it was stored is encoded again and
  replaces its file; a stored file or manifest that fails its check (`models.prompt_cache.store`)
  is reported on stderr in one line, kept aside and encoded (or rebuilt) again. When the
  tokenizer prepends a BOS token to ordinary prompts, the schema's layout starts with it as
  well, so the assembled prompt is the token sequence an ordinary prompt of the same text
  would have.
* Generation: every prompt, `-n` samples each, in one `cached_generate` call (the imported
  modules stored once per batch as shared prefix levels, the new text prefilled at its
  positions) with the sampling settings of the plain path (`sampling_params(args).config()`:
  temperature, top-k, top-p, min-p and the penalties); sample `i` of prompt `j` draws with
  `sample_keys(seed, j, i)`. `--compare` also runs `prefill_generate`: an ordinary causal
  prefill of the same assembled tokens at the same positions, then the same decode loop.
  `--stop` strings cut the completions afterwards.
* Times: a path's TTFT runs from its call to its first sampled token on the host. The first
  call in a process compiles; the seconds of its TTFT spent tracing and compiling are measured
  (`CompileTimeline`) and shown, but not subtracted (execution dispatched before a compilation
  overlaps it). `--compare` therefore calls both paths a second time with the same arguments and
  compares those TTFTs (`warm_ttft_s` in the records); completions come from the first calls.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from models.cli.args import UsageError, sampling_params
from models.cli.inputs import check_writable, output_mode, read_text
from models.cli.interrupt import deferred_interrupt
from models.cli.jsonl import kept_on_error, open_records
from models.cli.output import completion_fields, mesh_fields, printable, run_fields
from models.cli.progress import Progress
from models.compile_watch import CompileWatch
from models.llm import LLM
from models.prefix_sharing import format_bytes
from models.prompt_cache import (PromptCache, PromptCacheOutput, Schema, cached_generate, layout_prompt, parse_prompt,
                                 parse_schema, prefill_generate)
from models.prompt_cache.store import TIERS
from models.sample_text import SampleText

__all__ = ["CompileTimeline", "PathResult", "PmlInputs", "PmlRun", "bos_token_id", "read_pml_inputs",
           "run_prompt_cache"]

_COMPILE_EVENTS = "/jax/core/compile/"     # jaxpr tracing, lowering and backend compile durations


class CompileTimeline:
    """While active (``with CompileTimeline() as c``): the end time (``time.perf_counter``) and
    duration of every JAX tracing, lowering and compilation, so that ``c.seconds(t0, t1)`` gives
    the time of a window (e.g. a call up to its first token) spent in them."""

    def __init__(self):
        self.events: list[tuple[float, float]] = []

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event.startswith(_COMPILE_EVENTS) and event.endswith("_duration"):
            self.events.append((time.perf_counter(), float(duration)))

    def seconds(self, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1]`` spent tracing, lowering or compiling: the measure of the union
        of the events' intervals (a nested function's tracing lies inside its caller's)."""
        total, end = 0.0, t0
        for start, stop in sorted((max(t - d, t0), min(t, t1)) for t, d in self.events):
            if stop > end and stop > start:
                total += stop - max(start, end)
                end = stop
        return total

    def __enter__(self) -> "CompileTimeline":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)


@dataclasses.dataclass(frozen=True)
class PmlInputs:
    """The parsed schema and prompts with the files they came from."""
    schema: Schema
    schema_file: str
    prompts: tuple
    prompt_files: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class PmlRun:
    """What a run prepared before generating: the load and module times (seconds), where the
    modules came from (a tier, or "encoded"), the encoded schema, the prompts' layouts and the
    cache statistics after the lookup."""
    load_s: float
    modules_s: float
    source: str
    encoded: object
    layouts: tuple
    stats: object


@dataclasses.dataclass(frozen=True)
class PathResult:
    """One generation path: its output and completions ``[prompt][sample]``; ``ttft_s`` of that
    call with ``ttft_compile_s`` of it spent tracing and compiling, ``compile_s`` of the whole
    call; ``warm_ttft_s``: the TTFT of a second, identical call (compiled already), or None."""
    out: PromptCacheOutput
    completions: tuple
    ttft_s: float
    ttft_compile_s: float
    compile_s: float
    warm_ttft_s: float | None = None


def read_pml_inputs(args: argparse.Namespace) -> PmlInputs:
    """Parse ``--schema`` and every ``--prompt-pml`` file (module docstring); UsageError naming
    the file for any problem."""
    try:
        schema = parse_schema(read_text(args.schema, "schema file"))
    except ValueError as e:
        raise UsageError(f"schema file {args.schema}: {e}") from None
    prompts = []
    for path in args.prompt_pml:
        try:
            prompt = parse_prompt(read_text(path, "prompt file"), schema)
        except ValueError as e:
            raise UsageError(f"prompt file {path}: {e}") from None
        if not prompt.items or not isinstance(prompt.items[-1], str):
            raise UsageError(f"prompt file {path}: the prompt ends with an import; it must end with new text (e.g. "
                             f"the question) after its last module")
        prompts.append(prompt)
    return PmlInputs(schema, args.schema, tuple(prompts), tuple(args.prompt_pml))


def bos_token_id(tokenizer) -> int | None:
    """The token the tokenizer prepends to an ordinary prompt (``encode(text)`` against
    ``encode(text, add_special_tokens=False)``), or None."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    return int(full[0]) if len(full) == len(plain) + 1 and full[1:] == plain else None


def _open_cache(llm: LLM, directory: str | None) -> PromptCache:
    try:
        return PromptCache(llm.model, llm.params, llm.tokenizer, directory=directory,
                           bos_id=bos_token_id(llm.tokenizer))
    except (ValueError, NotImplementedError) as e:   # NotImplementedError: a family without the Prompt Cache
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"--cache-dir {directory}: {e.strerror or e}") from None


def _modules(cache: PromptCache, schema: Schema):
    """`(encoded, source)`: where the modules came from, a tier or "encoded"."""
    held = cache.directory is not None and schema.name in cache.names("disk")
    before = cache.stats()
    try:
        encoded = cache.encode_or_load(schema, replace=True)
    except (ValueError, OSError) as e:
        raise UsageError(f"--cache-dir {cache.directory}: {e}") from None
    after = cache.stats()
    hit = [t for t in TIERS if after.hits[t] > before.hits[t]]
    if hit:
        return encoded, hit[0]
    if after.verification_failures > before.verification_failures:
        return encoded, "encoded again (the stored file failed its check, kept aside)"
    return encoded, "encoded again (the stored schema text differs)" if held else "encoded"


def _completions(llm: LLM, out: PromptCacheOutput, args, n: int) -> tuple:
    """Completions ``[prompt][sample]`` of an output: end-of-sequence ids and ``--stop`` strings
    applied to each row's tokens."""
    eos = frozenset(llm.eos_token_ids)
    rows = []
    for r in range(out.tokens.shape[0]):
        text = SampleText(llm.tokenizer, tuple(args.stop or ()), eos)
        for s in range(int(out.lengths[r])):
            text.push(int(out.tokens[r, s]), float(out.logprobs[r, s]), last=s + 1 == args.max_new_tokens)
            if text.finish:
                break
        rows.append(text.completion(logprobs=True))
    return tuple(tuple(rows[j * n:(j + 1) * n]) for j in range(len(rows) // n))


def _run_path(generate: Callable, llm: LLM, encoded, layouts, args, clock: CompileTimeline) -> PathResult:
    sampling = sampling_params(args).config()  # temperature, top-k, top-p, min-p and the penalties
    t0 = time.perf_counter()
    try:
        out = generate(llm.model, llm.params, encoded, layouts, max_new_tokens=args.max_new_tokens,
                       n=args.num_samples, sampling=sampling, seed=args.seed, eos_token_ids=llm.eos_token_ids,
                       logprobs=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return PathResult(out, _completions(llm, out, args, args.num_samples), out.ttft_s,
                      clock.seconds(t0, t0 + out.ttft_s), clock.seconds(t0, time.perf_counter()))


def _timed_again(first: PathResult, generate: Callable, llm: LLM, encoded, layouts, args,
                 clock: CompileTimeline) -> PathResult:
    """`first` with the TTFT of a second, identical call (the first compiled its shapes)."""
    again = _run_path(generate, llm, encoded, layouts, args, clock)
    return dataclasses.replace(first, warm_ttft_s=again.ttft_s)


def _record(llm, args, inputs: PmlInputs, run: PmlRun, j: int, i: int, cached: PathResult,
            compare: PathResult | None) -> dict:
    """The JSONL record of sample ``i`` of prompt ``j`` (module docstring of ``models.cli.command``'s
    records plus the schema, the prompt file, the assembled prompt and the cache)."""
    ids = [int(t) for t in cached.out.prompt_token_ids[j]]
    new = len(run.layouts[j].new_token_ids)
    c = cached.completions[j][i]
    rec = {"model": llm.info, "schema": inputs.schema.name, "schema_file": inputs.schema_file,
           "prompt_file": inputs.prompt_files[j], "prompt_index": j, "sample": i,
           "prompt": llm.tokenizer.decode(ids), "prompt_token_ids": ids, "cached_tokens": len(ids) - new,
           "new_tokens": new}
    rec |= completion_fields(c, args.logprobs) | run_fields(args)
    rec["attention"] = "prompt_cache"
    rec["device"] = jax.default_backend()
    rec["mesh"] = mesh_fields(llm)
    s = run.stats
    rec["cache"] = {"dir": args.cache_dir, "modules": run.source, "hits": s.hits, "misses": s.misses,
                    "bytes": s.bytes, "bytes_per_token": s.bytes_per_token}
    rec["timings"] = {"load_s": round(run.load_s, 4), "modules_s": round(run.modules_s, 4)} | _times(cached)
    if compare is not None:
        base = compare.completions[j][i]
        rec["compare"] = {"same_tokens": base.token_ids == c.token_ids, **completion_fields(base, args.logprobs),
                          "timings": _times(compare)}
    return rec


def _times(p: PathResult) -> dict:
    pairs = (("ttft_s", p.ttft_s), ("ttft_compile_s", p.ttft_compile_s), ("total_s", p.out.total_s),
             ("compile_s", p.compile_s), ("warm_ttft_s", p.warm_ttft_s))
    return {k: round(v, 4) for k, v in pairs if v is not None}


def _summary(llm, inputs: PmlInputs, run: PmlRun, cached: PathResult, compare: PathResult | None, n: int,
             drawn_seed: int | None = None) -> str:
    """The run's summary line: sequences, cached and new prompt tokens, ``seed=N`` when
    ``drawn_seed`` is given (the seed ``--seed random`` drew), load and module times,
    TTFT with the cache (with ``--compare``: of second calls, with and without the cache, and
    their ratio), decode, cache hits and bytes per tier."""
    plural = lambda k, word: f"{k} {word}{'s' if k != 1 else ''}"  # noqa: E731
    p = len(inputs.prompts)
    new = sum(len(lay.new_token_ids) for lay in run.layouts)
    cached_tokens = sum(map(len, cached.out.prompt_token_ids)) - new
    parts = [f"{plural(p * n, 'sequence')} ({plural(p, 'prompt')} x {plural(n, 'sample')}) of schema "
             f"{inputs.schema.name!r}, {cached_tokens} cached + {new} new prompt tokens",
             *([] if drawn_seed is None else [f"seed={drawn_seed}"]),
             f"load {run.load_s:.2f} s",
             f"modules {run.source} {run.modules_s:.2f} s ({len(run.encoded.names)} modules, "
             f"{int(np.asarray(run.encoded.lengths).sum())} tokens)"]
    if compare is None:
        parts.append(f"TTFT with cache {cached.ttft_s:.3f} s ({cached.ttft_compile_s:.2f} s of it compiling)")
    else:
        a, b = cached.warm_ttft_s, compare.warm_ttft_s
        pairs = [(x, y) for r, q in zip(cached.completions, compare.completions) for x, y in zip(r, q)]
        same = sum(x.token_ids == y.token_ids for x, y in pairs)
        parts.append(f"TTFT with cache {a:.3f} s, without cache {b:.3f} s: "
                     + (f"{b / a:.1f}x lower" if a > 0 else "n/a")
                     + f" (second calls; first calls {cached.ttft_s:.2f} s and {compare.ttft_s:.2f} s with "
                       f"compilation); same tokens {same}/{len(pairs)}")
    decoded = sum(len(c.token_ids) for row in cached.completions for c in row)
    parts.append(f"{decoded} new tokens in {cached.out.total_s:.2f} s")
    s = run.stats
    parts.append("cache hits " + ", ".join(f"{t} {s.hits[t]}" for t in TIERS) + "; bytes "
                 + ", ".join(f"{t} {format_bytes(s.bytes[t])}" for t in TIERS)
                 + f" ({format_bytes(s.bytes_per_token)} per token)")
    parts.append(f"{jax.default_backend()} {llm.info.get('dtype', '')}".rstrip())
    return " | ".join(parts)


def _show(llm: LLM, args, inputs: PmlInputs, run: PmlRun, cached: PathResult, records) -> None:
    """The completions, as soon as the cached path has them: a record each to ``records``
    (without the comparison, which comes later), or printed when there is no ``--output``."""
    n = args.num_samples
    if records is not None:
        for j in range(len(run.layouts)):
            for i in range(n):
                records.write(_record(llm, args, inputs, run, j, i, cached, None))
    elif len(run.layouts) * n == 1:
        print(printable(cached.completions[0][0].text))
    else:
        for j, row in enumerate(cached.completions):
            for i, c in enumerate(row):
                sys.stdout.write(f"--- prompt {j + 1}: {inputs.prompt_files[j]}, sample {i + 1}/{n} "
                                 f"({c.finish_reason}, {len(c.token_ids)} tokens) ---\n{printable(c.text)}\n")


def _layouts(llm: LLM, inputs: PmlInputs, cache: PromptCache, max_new_tokens: int) -> tuple:
    """Every prompt's layout; UsageError naming the file for an argument longer than its
    parameter or a prompt whose last position plus ``max_new_tokens`` exceeds the context."""
    lay = cache.schema_layout(inputs.schema)
    limit = llm.config.max_position_embeddings
    out = []
    for prompt, f in zip(inputs.prompts, inputs.prompt_files):
        try:
            out.append(layout_prompt(prompt, inputs.schema, lay, llm.tokenizer))
        except ValueError as e:
            raise UsageError(f"prompt file {f}: {e}") from None
        end = int(out[-1].new_positions[-1]) + 1 + max_new_tokens
        if end > limit:
            raise UsageError(f"prompt file {f}: its last position plus --max-new-tokens reaches {end}, beyond the "
                             f"model's context of {limit} positions")
    return tuple(out)


def run_prompt_cache(args: argparse.Namespace, load: Callable) -> int:
    """Runs the Prompt Cache flags (module docstring); ``load(path, dtype)`` reads the model.
    Returns the exit status."""
    inputs = read_pml_inputs(args)
    if args.output:
        check_writable(args.output)
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model file not found: {args.model}")
    if args.cache_dir is not None and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"--cache-dir {args.cache_dir}: is not a directory")
    records = open_records(args.output, output_mode(args)) if args.output else None
    n = args.num_samples
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    compare = None
    with kept_on_error(records), CompileWatch() as watch, Progress(show, watch) as progress, CompileTimeline() as clock:
        progress.phase("load")
        t0 = time.perf_counter()
        llm = load(args.model, args.dtype)
        load_s = time.perf_counter() - t0
        progress.phase("modules")
        t0 = time.perf_counter()
        cache = _open_cache(llm, args.cache_dir)
        encoded, source = _modules(cache, inputs.schema)
        modules_s = time.perf_counter() - t0
        run = PmlRun(load_s, modules_s, source, encoded, _layouts(llm, inputs, cache, args.max_new_tokens),
                     cache.stats())
        progress.phase("generate with cache")
        with deferred_interrupt():  # Ctrl-C: the call finishes, its completions are kept, then the run stops
            cached = _run_path(cached_generate, llm, encoded, run.layouts, args, clock)
            with progress.paused():
                _show(llm, args, inputs, run, cached, records)
        if args.compare:
            progress.phase("generate without cache")
            compare = _run_path(prefill_generate, llm, encoded, run.layouts, args, clock)
            progress.phase("timing both again")
            cached = _timed_again(cached, cached_generate, llm, encoded, run.layouts, args, clock)
            compare = _timed_again(compare, prefill_generate, llm, encoded, run.layouts, args, clock)
    if records is not None:  # the run ended: the final records, with the comparison
        records.commit([_record(llm, args, inputs, run, j, i, cached, compare) for j in range(len(run.layouts))
                        for i in range(n)])
    print(_summary(llm, inputs, run, cached, compare, n, args.seed if args.seed_drawn else None), file=sys.stderr)
    return 0
