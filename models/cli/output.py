"""What ``jpa-sample`` writes: completion blocks with control characters escaped
(:func:`printable`, :func:`completion_header`), the summary line on stderr
(:func:`summary_line`), one JSONL record per completion (:func:`jsonl_record`, built from
:func:`completion_fields` and :func:`run_fields`, which the Prompt Cache records share; its
``timings`` from :func:`sequence_timings`) and one-line errors (:func:`error_line`)."""
from __future__ import annotations

import argparse
import types

import jax

from models.completion import Completion, Generation
from models.llm import LLM

__all__ = ["completion_fields", "completion_header", "error_line", "jsonl_record", "printable", "run_fields",
           "sequence_timings", "summary_line"]

_CONTROL = types.MappingProxyType({c: f"\\x{c:02x}" for c in (*range(0x20), 0x7f, *range(0x80, 0xa0))
                                   if c not in (0x09, 0x0a)})


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab written as `\\xNN` escapes:
    generated text cannot move the cursor or send escape sequences to the terminal."""
    return text.translate(_CONTROL)


def error_line(message: str) -> str:
    """`message` on one line: its non-blank lines joined by spaces."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def completion_header(j: int, i: int, c: Completion, questions: list[str] | None, n: int) -> str:
    """The line above a printed completion: question, sample, finish reason, token count."""
    where = f"question {j + 1}: {questions[j]}, " if questions else ""
    return f"--- {where}sample {i + 1}/{n} ({c.finish_reason}, {len(c.token_ids)} tokens) ---\n"


def summary_line(llm: LLM, result: Generation | None, *, b: int, groups: int, n: int, load_s: float,
                 interrupted: bool, drawn_seed: int | None = None) -> str:
    """The run's summary: sequences and tokens, ``seed=N`` when ``drawn_seed`` is given (the seed
    ``--seed random`` drew: what reproduces the run), load / compile / prefill / first-token /
    decode times and rate, what was shared, the device (and the mesh, when there is one)."""
    t = result.timings if result is not None else None
    plural = lambda k, word: f"{k} {word}{'s' if k > 1 else ''}"  # noqa: E731
    head = f"{plural(b, 'sequence')} ({plural(groups, 'prompt')} x {plural(n, 'sample')})"
    seed = [] if drawn_seed is None else [f"seed={drawn_seed}"]
    if t is None:
        return " | ".join([head, *seed, f"load {load_s:.2f} s", "interrupted" if interrupted else "no result"])
    rate = t.decode_tokens_per_s
    device = f"{jax.default_backend()} {llm.info.get('dtype', '')}".rstrip()
    if llm.mesh is not None:
        device += f" tensor_parallel={llm.tensor_parallel} data_parallel={llm.data_parallel}"
    parts = [f"{head}, {t.new_tokens} new tokens in {t.total_s:.2f} s", *seed, f"load {load_s:.2f} s",
             f"compile {t.compile_s:.2f} s", f"prefill {t.prefill_s:.2f} s", f"first token {t.first_token_s:.2f} s",
             f"decode {t.decode_tokens} tokens {t.decode_s:.2f} s"
             + (f", {rate:.1f} tok/s without compilation" if rate is not None else ""),
             str(result.sharing), device]
    return " | ".join(parts)


def completion_fields(c: Completion, logprobs: bool) -> dict:
    """A record's ``completion``, ``token_ids``, ``finish_reason``, ``stop_reason`` (the matched
    stop string or stop token id, else null), (``logprobs``) ``logprobs``, and ``top_logprobs``
    (per token, ``[[id, logprob], ...]``) / ``prompt_logprobs`` when the completion has them."""
    rec = {"completion": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason}
    if logprobs:
        rec["logprobs"] = list(c.logprobs) if c.logprobs is not None else None
    if c.top_logprobs is not None:
        rec["top_logprobs"] = [[list(pair) for pair in alts] for alts in c.top_logprobs]
    if c.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [e if e is None or isinstance(e, float) else [e[0], [list(p) for p in e[1]]]
                                  for e in c.prompt_logprobs]
    return rec


def run_fields(args: argparse.Namespace) -> dict:
    """A record's ``seed`` and ``sampling`` settings (temperature, top-k, top-p, min-p, penalties,
    max new tokens, stop strings and token ids, ignore-eos, include-stop-str)."""
    return {"seed": args.seed, "sampling": {"temperature": args.temperature, "top_k": args.top_k,
                                            "top_p": args.top_p, "min_p": args.min_p,
                                            "repetition_penalty": args.repetition_penalty,
                                            "presence_penalty": args.presence_penalty,
                                            "frequency_penalty": args.frequency_penalty,
                                            "max_new_tokens": args.max_new_tokens, "stop": args.stop or [],
                                            "stop_token_ids": args.stop_token_ids or [],
                                            "ignore_eos": args.ignore_eos,
                                            "include_stop_str": args.include_stop_str}}


def mesh_fields(llm: LLM) -> dict:
    """A record's ``mesh``: the devices each model is split over and the data-parallel groups."""
    return {"tensor_parallel": llm.tensor_parallel, "data_parallel": llm.data_parallel}


def sequence_timings(*, load_s: float, call: float, prefill: float | None, first_token: float | None,
                     end: float, compile_s: float) -> dict:
    """A record's ``timings`` (seconds, 4 decimals) for one sequence: ``load_s``, and of the
    generation call (``perf_counter`` values: its start ``call``, the prefill's start, the first
    tokens on the host, this sequence's ``end``) the ``compile_s`` spent compiling up to ``end``,
    ``prefill_s``, ``first_token_s``, ``decode_s`` (first token to ``end``) and ``total_s`` (start
    to ``end``). The phases a sequence did not reach (interrupted before) are left out."""
    t = {"load_s": load_s, "compile_s": compile_s}
    if prefill is not None and first_token is not None:
        t |= {"prefill_s": first_token - prefill, "first_token_s": first_token - call, "decode_s": end - first_token}
    t["total_s"] = end - call
    return {k: round(v, 4) for k, v in t.items()}


def jsonl_record(llm: LLM, args: argparse.Namespace, j: int, i: int, c: Completion, prompt_text: str | None,
                 question: str | None, *, attention: str | None, timings: dict) -> dict:
    """The JSONL record of sample ``i`` of prompt ``j``: model identity, prompt, completion,
    seed, sampling settings, log-probs (``--logprobs``), the KV-cache layout ``attention`` (None
    while the run has not ended: the layout is reported with the run's result), device, mesh and
    ``timings`` (:func:`sequence_timings`)."""
    rec = {"model": llm.info, "prompt_index": j, "sample": i, "question": question, "prompt": prompt_text}
    rec |= completion_fields(c, args.logprobs) | run_fields(args)
    rec["attention"] = attention
    rec["device"] = jax.default_backend()
    rec["mesh"] = mesh_fields(llm)
    rec["timings"] = dict(timings)
    return rec
