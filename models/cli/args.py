"""The flags of ``jpa-sample``: :func:`build_parser` (every help text states its default once),
:func:`parse_args` (plus the checks between flags), and :class:`UsageError` -- a user error the
CLI reports as one line on stderr with exit status 2."""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import re
import string
from typing import Sequence

import jax

from models.generate import ATTENTION
from models.llm import DEFAULT_MAX_NEW_TOKENS
from models.sampling import DEFAULT_SAMPLING, SEED_MAX
from models.sampling_params import SamplingParams, resolve_seed

__all__ = ["PROG", "STDIN", "UsageError", "build_parser", "parse_args", "sampling_params", "unescape", "version"]

PROG = "jpa-sample"
STDIN = "-"  # --prompt-file / --questions-file value that reads standard input


class UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints the usage too otherwise)
        raise UsageError(message)


def version() -> str:
    """``jpa-sample VERSION (jax VERSION)``."""
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


def _seed(s):
    """An argparse type: an integer in [0, SEED_MAX], or `random` (None: drawn by `parse_args`)."""
    if s == "random":
        return None
    try:
        int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'random', got {s!r}") from None
    return _int_at_least(0, SEED_MAX)(s)


def _logprobs_count(s):
    """An argparse type for `--logprobs K` / `--prompt-logprobs K`: 0 is the bare flag (True)."""
    k = _int_at_least(0)(s)
    return k or True


def _token_ids(s):
    """An argparse type: comma-separated token ids (integers >= 0)."""
    return [_int_at_least(0)(t.strip()) for t in s.split(",") if t.strip()]


def _question_format(s):
    """An argparse type: a `str.format` template with a `{question}` field and no other, with
    `\\n`, `\\t` and `\\\\` unescaped as in `--stop` (the default as `--help` prints it means the default)."""
    s = unescape(s)
    try:
        s.format(question="q")
        fields = [f for _, f, _, _ in string.Formatter().parse(s) if f is not None]
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"bad template {s!r}: {type(e).__name__}: {e}") from None
    if "question" not in fields:
        raise argparse.ArgumentTypeError(f"template {s!r} has no {{question}} field: every question would be "
                                         f"dropped")
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
                   help="without --chat: how a question is appended to the prompt, with a {question} field; \\n, "
                        "\\t and \\\\ as in --stop (default: %(default)r)")
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
    p.add_argument("--min-p", type=_float_in(0, 1, what="in [0, 1]"), default=0.0,
                   help="keep tokens whose probability is at least MIN_P times the most probable one's (after "
                        "temperature, before top-k/top-p), 0 = off (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=_float_in(0, 1e6, lo_open=True, what="in (0, 1000000]"), default=1.0,
                   help="divide positive / multiply negative logits of tokens in the prompt or generated so far, "
                        "1 = off (default: %(default)s)")
    p.add_argument("--presence-penalty", type=_float_in(-2, 2, what="in [-2, 2]"), default=0.0,
                   help="subtract from the logits of tokens generated at least once, 0 = off (default: %(default)s)")
    p.add_argument("--frequency-penalty", type=_float_in(-2, 2, what="in [-2, 2]"), default=0.0,
                   help="subtract this times each token's count in the generated tokens, 0 = off "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=_seed, default=0,
                   help=f"PRNG seed, an integer in [0, {SEED_MAX}], or 'random' (a seed is drawn and written in "
                        "the records); sample i of question j depends only on the seed, i and j "
                        "(default: %(default)s)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end a completion at this string, not included; repeatable; \\n, \\t and \\\\ are "
                        "newline, tab and backslash (default: only the model's end-of-sequence tokens)")
    p.add_argument("--stop-token-ids", type=_token_ids, action="extend", default=None, metavar="ID[,ID...]",
                   help="end a completion at any of these token ids, like an end-of-sequence id; repeatable "
                        "(default: none)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not end a completion at the model's end-of-sequence ids (default: off)")
    p.add_argument("--include-stop-str", action="store_true",
                   help="keep the matched --stop string (or the stop token's text) in the completion "
                        "(default: off)")
    p.add_argument("--prompt-logprobs", type=_logprobs_count, nargs="?", const=True, default=False, metavar="K",
                   help="each prompt token's log-probability in the --output records; with K >= 1 also the K most "
                        "probable tokens at each position; needs --output FILE or - (default: off)")
    p.add_argument("--logprobs", type=_logprobs_count, nargs="?", const=True, default=False, metavar="K",
                   help="each token's log-probability in the --output records; with K >= 1 also the K most "
                        "probable tokens at each step; needs --output FILE or - (default: off)")
    p.add_argument("--attention", choices=ATTENTION, default="auto",
                   help="KV-cache layout: shared prefixes stored once, or flat copies; auto = shared when "
                        "sequences share a prefix (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter/cache dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--tensor-parallel", type=_int_at_least(1), default=1, metavar="N",
                   help="split the model's heads, FFN and vocabulary over N devices (default: %(default)s)")
    p.add_argument("--data-parallel", type=_int_at_least(1), default=1, metavar="M",
                   help="split the sequences over M groups of --tensor-parallel devices; the first N x M devices "
                        "are used (default: %(default)s)")
    p.add_argument("--devices", type=_int_at_least(1), default=None, metavar="N",
                   help="run on the first N devices with the tensor x data parallel split modelled fastest "
                        "for this run's prompts, samples and --max-new-tokens, and say which and why on "
                        "standard error; instead of --tensor-parallel / --data-parallel (default: off)")
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="join a run of several processes (one per host, each running the same command): "
                        "process 0's address; with --num-processes and --process-id (default: the "
                        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID environment variables; "
                        "default: none, one process)")
    p.add_argument("--num-processes", type=_int_at_least(1), default=None, metavar="P",
                   help="processes in the run, with --coordinator-address (default: none)")
    p.add_argument("--process-id", type=_int_at_least(0), default=None, metavar="I",
                   help="this process's index in [0, P), with --coordinator-address (default: none)")
    p.add_argument("--output", "-o", default=None,
                   help="write one JSON object per completion to this .jsonl as each finishes ('-': standard "
                        "output, the completions are then not printed); the file appears when the run ends, "
                        "an existing one only with --overwrite or --append (default: print the completions)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--overwrite", action="store_true",
                     help="replace an existing --output file when the run ends (default: refuse it)")
    how.add_argument("--append", action="store_true",
                     help="add the records to an existing --output file when the run ends (default: refuse it)")
    p.add_argument("--demo", action="store_true",
                   help="built-in example: chat, a shared system prompt and three questions; --prompt / "
                        "--questions-file still override them (default: off)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="live progress line on stderr; auto = when stderr is a terminal (default: %(default)s)")
    pc = p.add_argument_group("Prompt Cache", "prompts of a PML schema, served from the stored keys/values of "
                              "their modules (see models.cli.prompt_cache)")
    pc.add_argument("--schema", default=None, metavar="FILE",
                    help="a PML schema (<schema name=...>) whose modules are encoded once; '-' for standard "
                         "input (default: none)")
    pc.add_argument("--prompt-pml", action="append", default=None, metavar="FILE",
                    help="a PML prompt (<prompt schema=...>) of --schema; repeatable, all prompts run in one "
                         "batch; '-' for standard input (default: none)")
    pc.add_argument("--cache-dir", default=None, metavar="DIR",
                    help="keep the encoded modules in DIR (one safetensors file per schema and manifest.json) "
                         "so later runs load them; a schema whose text changed is encoded again (default: "
                         "memory only)")
    pc.add_argument("--compare", action="store_true",
                    help="also run the prompts without the cache (ordinary prefill of the same tokens) and "
                         "report both times to first token (default: off)")
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` plus the checks between flags (via `parser.error`); `--seed
    random` is drawn here (`seed_drawn` says whether it was)."""
    args = parser.parse_args(argv)
    if args.prompt_file == STDIN and args.questions_file == STDIN:
        parser.error("--prompt-file and --questions-file cannot both be '-' (standard input)")
    _check_prompt_cache_flags(parser, args)
    if args.devices is not None and (args.tensor_parallel, args.data_parallel) != (1, 1):
        parser.error("--devices chooses the split: it cannot be used with --tensor-parallel / --data-parallel")
    given = [args.coordinator_address is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        parser.error("--coordinator-address, --num-processes and --process-id go together")
    if all(given) and args.process_id >= args.num_processes:
        parser.error(f"--process-id must be in [0, --num-processes={args.num_processes}), got {args.process_id}")
    for flag, given in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if given and not args.output:
            parser.error(f"{flag} needs --output FILE or --output - (the log-probabilities are written in the "
                         f"JSONL records)")
    args.seed_drawn = args.seed is None
    if args.seed_drawn:  # --seed random: drawn now, so every record names the seed that reproduces it
        args.seed = resolve_seed(SamplingParams(seed=None)).seed
    if args.stop is not None:
        args.stop = [unescape(s) for s in args.stop]
        if any(not s for s in args.stop):
            parser.error("argument --stop: expected a non-empty string")
    return args


def _check_prompt_cache_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--schema` goes with `--prompt-pml` (and only there `--cache-dir`, `--compare`); the
    flags of ordinary prompts, of several devices, of stop token ids, `--include-stop-str`, top
    and prompt log-probabilities do not apply to it (the sampling flags do)."""
    if args.schema is None:
        for flag, given in (("--prompt-pml", args.prompt_pml), ("--cache-dir", args.cache_dir),
                            ("--compare", args.compare)):
            if given:
                parser.error(f"{flag} needs --schema FILE")
        return
    if not args.prompt_pml:
        parser.error("--schema needs at least one --prompt-pml FILE")
    for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file is not None),
                        ("--questions-file", args.questions_file is not None), ("--chat", args.chat),
                        ("--demo", args.demo)):
        if given:
            parser.error(f"{flag} cannot be used with --schema (the prompts are the --prompt-pml files)")
    if args.attention != "auto":
        parser.error(f"--attention {args.attention} cannot be used with --schema (the modules are stored once "
                     f"per batch as shared prefix levels)")
    if (args.tensor_parallel, args.data_parallel) != (1, 1):
        parser.error("--tensor-parallel / --data-parallel cannot be used with --schema (it runs on one device)")
    if args.devices is not None:
        parser.error("--devices cannot be used with --schema (it runs on one device)")
    ends = "completions end at the model's end-of-sequence ids, --stop strings and --max-new-tokens"
    for flag, given, why in (
            ("--stop-token-ids", bool(args.stop_token_ids), ends), ("--ignore-eos", args.ignore_eos, ends),
            ("--include-stop-str", args.include_stop_str, "--stop strings are cut from the completions"),
            ("--logprobs K", args.logprobs is not True and bool(args.logprobs),
             "it reports each token's log-probability only: give a bare --logprobs"),
            ("--prompt-logprobs", bool(args.prompt_logprobs), "it computes no prompt log-probabilities")):
        if given:
            parser.error(f"{flag} cannot be used with --schema (the Prompt Cache path: {why})")
    if [args.schema, *args.prompt_pml].count(STDIN) > 1:
        parser.error("only one of --schema and --prompt-pml can be '-' (standard input)")


def unescape(s: str) -> str:
    """`\\n`, `\\t` and `\\\\` in a flag value as newline, tab and backslash (a shell passes
    `--stop "\\n"` as a backslash and an n)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m[1]], s)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The :class:`~models.sampling_params.SamplingParams` of the parsed flags."""
    return SamplingParams(n=args.num_samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
                          stop_token_ids=args.stop_token_ids or (), ignore_eos=args.ignore_eos,
                          include_stop_str_in_output=args.include_stop_str, logprobs=args.logprobs,
                          prompt_logprobs=args.prompt_logprobs)
