"""Accuracy of Prompt Cache on a small built-in document question set: how often the greedy
answer with the cache (each document encoded as an independent module) equals the answer
without it, and how far apart the first-token distributions are.

    python bench/prompt_cache_accuracy.py --out bench/results/prompt_cache_accuracy_cpu.json

Data (`bench/data/prompt_cache_docs.json`): short fictional documents (invented names and
numbers, 117-151 SmolLM2 tokens each) and 24 items of two or three documents plus one question
about one of them. The schema (`build_schema`) holds the chat header (system message, start of
the user turn) as anonymous text and one union per document slot whose members are the
documents used at that slot; an item imports one document per slot and its question is new
text that also closes the user turn and opens the assistant's. Union members share a start
position, so a document shorter than its slot's longest leaves a gap in the position ids before
the next slot (reported per item as `gap_positions`).

Three paths generate greedily from the same assembled token ids, each as one batched call:

* `cached`: `cached_generate`, the modules' stored K/V (each document attended only to itself
  when encoded) and the question prefilled at its positions;
* `prefill`: `prefill_generate`, an ordinary causal prefill of the assembled prompt at the same
  position ids: differs from `cached` only by the cross-module attention the cache leaves out;
* `ordinary`: `models.generate` on the assembled ids at positions 0..n-1, what the model answers
  to the same tokens without Prompt Cache: differs from `prefill` only by the position gaps.

Reported for each pair (`cached_vs_prefill`, `cached_vs_ordinary`, `prefill_vs_ordinary`): the
rate of exact answer matches (token ids up to and including the end-of-sequence token), the rate
of equal first tokens and the mean / median / max KL divergence of the first-token distributions
(KL(baseline || other), natural log); and per path how often the answer contains the expected
answer (case-insensitive, commas ignored). The first-token distributions come from replaying
each path's prefill (`prefill_at_positions` on the prefix levels the call built, or on no
prefix for the baselines); `checks` records that the replay's argmax equals each call's first
token and the largest difference of the first token's log-probability.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.e2e_common import commit_of_checkout  # noqa: E402
from models import PromptBatch, generate  # noqa: E402
from models import kv_cache as kvc  # noqa: E402
from models.generate import resolve_layout  # noqa: E402
from models.prompt_cache import (Import, Prompt, assemble, cached_generate, check_prompt, layout_prompt,  # noqa: E402
                                 layout_schema, module, prefill_generate, schema, union)
from models.prompt_cache.encode import encode_schema  # noqa: E402
from models.prompt_cache.infer import prefill_at_positions  # noqa: E402

DATA = os.path.join(ROOT, "bench", "data", "prompt_cache_docs.json")
PAIRS = (("cached", "prefill"), ("cached", "ordinary"), ("prefill", "ordinary"))
_replay = jax.jit(prefill_at_positions, static_argnames=("model", "capacity"))


def load_data(path: str = DATA) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def build_schema(data: dict, items: list, name: str = "docqa"):
    """`(schema, prompts)`: the chat header as anonymous text, one union per document slot (module
    `s<slot>_<document id>`), and per item a `Prompt` importing its documents and asking its
    question (module docstring)."""
    slots = max(len(it["docs"]) for it in items)
    members = [list(dict.fromkeys(it["docs"][s] for it in items if len(it["docs"]) > s)) for s in range(slots)]
    doc_text = lambda d: data["document"].format(text=data["documents"][d])  # noqa: E731
    sch = schema(name, data["header"].format(system=data["system"]),
                 *(union(*(module(f"s{s}_{d}", doc_text(d)) for d in members[s])) for s in range(slots)))
    prompts = []
    for it in items:
        imports = tuple(Import(f"s{s}_{d}", {}) for s, d in enumerate(it["docs"]))
        prompts.append(check_prompt(Prompt(name, imports + (data["question"].format(question=it["question"]),)),
                                    sch))
    return sch, prompts


def _left_pad(rows):
    t = max(len(ids) for ids, _ in rows)
    toks, pos = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.int32)
    for b, (ids, p) in enumerate(rows):
        toks[b, t - len(ids):], pos[b, t - len(p):] = ids, p
    return toks, pos, np.asarray([len(ids) for ids, _ in rows], np.int32), t


def first_token_logits(model, params, prefix, rows) -> np.ndarray:
    """float32 `[B, V]`: the logits after each row's last token, prefilling `rows` (`(token ids,
    positions)` per batch row) on `prefix` (a `PrefixCache` whose levels fit `len(rows)` rows)."""
    toks, pos, n_b, t = _left_pad(rows)
    logits, _ = _replay(model, params, prefix, toks, pos, n_b, capacity=t)
    return np.asarray(logits, np.float32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per row of two logit arrays `[B, V]` (float64)."""
    lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def _answers(tokens, lengths) -> list:
    return [[int(t) for t in tokens[b, :int(lengths[b])]] for b in range(len(lengths))]


def _contains(text: str, answer: str) -> bool:
    norm = lambda s: " ".join(s.lower().replace(",", "").split())  # noqa: E731
    return norm(answer) in norm(text)


def _pair_stats(a: dict, b: dict, kl: np.ndarray) -> dict:
    same = [x == y for x, y in zip(a["answers"], b["answers"])]
    first = [x[:1] == y[:1] for x, y in zip(a["answers"], b["answers"])]
    return {"exact_match_rate": float(np.mean(same)), "first_token_agreement": float(np.mean(first)),
            "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)), "kl_max": float(kl.max())}


def evaluate(model, params, tokenizer, data: dict, *, max_new_tokens: int = 20, eos_token_ids=None,
             bos_id: int | None = None, limit: int | None = None) -> dict:
    """Run the three paths on the first `limit` items of `data` (all with None); the summary,
    per-item answers and checks described in the module docstring."""
    items = data["items"][:limit]
    sch, prompts = build_schema(data, items)
    times = {}
    t0 = time.perf_counter()
    lay = layout_schema(sch, tokenizer, bos_id=bos_id)
    enc = encode_schema(model, params, lay)
    jax.block_until_ready(enc.k)
    times["encode_s"] = time.perf_counter() - t0
    layouts = [layout_prompt(p, sch, lay, tokenizer) for p in prompts]
    kw = {"max_new_tokens": max_new_tokens, "eos_token_ids": eos_token_ids}
    runs = {}
    t0 = time.perf_counter()
    runs["cached"] = cached_generate(model, params, enc, layouts, logprobs=True, **kw)
    times["cached_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    runs["prefill"] = prefill_generate(model, params, enc, layouts, logprobs=True, **kw)
    times["prefill_s"] = time.perf_counter() - t0
    assembled = [assemble(enc, p) for p in layouts]
    t0 = time.perf_counter()
    runs["ordinary"] = generate(model, params, PromptBatch.plain([ids.tolist() for ids, _ in assembled]), **kw)
    times["ordinary_s"] = time.perf_counter() - t0

    run_params = resolve_layout(model, params, "auto")
    empty = kvc.empty_prefix_cache(model.config, params["embed"].dtype, stacked=kvc.is_stacked(run_params["layers"]))
    c = runs["cached"]
    rows = [(layouts[j].new_token_ids, layouts[j].new_positions) for j in c.row_prompt]
    real = [int(np.flatnonzero((c.row_prompt == j) & ~c.row_padding)[0]) for j in range(len(items))]
    t0 = time.perf_counter()
    logits = {"cached": first_token_logits(model, run_params, c.cache.prefix, rows)[real],
              "prefill": first_token_logits(model, run_params, empty, assembled),
              "ordinary": first_token_logits(model, run_params, empty,
                                             [(ids, np.arange(len(ids), dtype=np.int32)) for ids, _ in assembled])}
    times["replay_s"] = time.perf_counter() - t0

    paths, checks = {}, {"replay_first_token_mismatches": {}, "replay_first_logprob_max_abs_diff": {}}
    for name, out in runs.items():
        answers = _answers(out.tokens, out.lengths)
        texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
        paths[name] = {"answers": answers, "texts": texts}
        lsm = _log_softmax(logits[name])
        first = np.asarray(out.tokens[:, 0])
        checks["replay_first_token_mismatches"][name] = int(np.sum(lsm.argmax(-1) != first))
        diff = np.abs(lsm[np.arange(len(first)), first] - np.asarray(out.logprobs[:, 0], np.float64))
        checks["replay_first_logprob_max_abs_diff"][name] = float(diff.max())

    kls = {f"{a}_vs_{b}": kl_divergence(logits[b], logits[a]) for a, b in PAIRS}
    summary = {f"{a}_vs_{b}": _pair_stats(paths[a], paths[b], kls[f"{a}_vs_{b}"]) for a, b in PAIRS}
    summary["answer_contains_expected"] = {
        name: float(np.mean([_contains(t, it["answer"]) for t, it in zip(p["texts"], items)]))
        for name, p in paths.items()}
    per_item = []
    for j, (it, lay_j, (ids, pos)) in enumerate(zip(items, layouts, assembled)):
        per_item.append({
            "id": it["id"], "docs": it["docs"], "question": it["question"], "answer": it["answer"],
            "prompt_tokens": len(ids), "new_tokens": len(lay_j.new_token_ids),
            "gap_positions": int(pos[-1]) + 1 - len(ids),
            **{name: {"text": p["texts"][j], "token_ids": p["answers"][j],
                      "contains_answer": _contains(p["texts"][j], it["answer"])} for name, p in paths.items()},
            "kl": {k: float(v[j]) for k, v in kls.items()}})
    return {"summary": summary, "checks": checks, "timings": {k: round(v, 3) for k, v in times.items()},
            "setup": {"items": len(items), "documents_per_item": [len(it["docs"]) for it in items],
                      "modules": len(enc.names), "module_tokens": [int(x) for x in enc.lengths],
                      "schema_positions": int(lay.length), "max_new_tokens": max_new_tokens},
            "items": per_item}


def _meta(argv) -> dict:
    checkout = commit_of_checkout()
    commit = checkout and checkout.removesuffix("+dirty")
    dirty = checkout and checkout.endswith("+dirty")
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "commit": commit, "uncommitted_changes": dirty,
            "command": "python bench/prompt_cache_accuracy.py " + " ".join(argv), "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    from models import LLM  # noqa: PLC0415
    from models.cli.prompt_cache import bos_token_id  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "prompt_cache_accuracy_cpu.json"))
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: built-in SmolLM2)")
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--limit", type=int, default=None, help="first N items only")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM.load(args.model)
    res = evaluate(llm.model, llm.params, llm.tokenizer, load_data(args.data), max_new_tokens=args.max_new_tokens,
                   eos_token_ids=llm.eos_token_ids, bos_id=bos_token_id(llm.tokenizer), limit=args.limit)
    res = {"meta": _meta(argv) | {"model": llm.info, "seconds": round(time.perf_counter() - t0, 1)}, **res}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for k, v in res["summary"].items():
        print(k, json.dumps(v))
    print("checks", json.dumps(res["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
