"""Long-document question answering (Hydragen 4.3 / Figure 5 / D.3): time vs number of questions.

One shared document of ``--doc-tokens`` (default 19947, as Hydragen's War-and-Peace prefix)
is prefilled once (excluded from the timings, as in Figure 5); then ``Q`` questions of ~20
tokens (uniform in [16, 24], all distinct) are answered with ``--answer-tokens`` (default 32)
tokens each.  One timed call = :func:`models.generate` with the prefilled ``prefix_cache``:
prefill of the ``Q`` questions against the document + the whole greedy decode loop (EOS
disabled, so every answer has 32 tokens).  Backends ``shared`` (document stored once), ``flat``
(the document's keys/values copied into every sequence: the FlashAttention baseline; the copy is
part of its time) and ``none`` (attention skipped: the lower bound of the time).

Model: Yi-6B-200K shapes (Hydragen's model: grouped-query, 4 KV heads), random bf16 weights, the
unrolled layer list, ``--layers`` layers (default 16 of 32, recorded).  Out-of-memory points are
recorded as "X" (predicted from the byte count when they cannot fit, else caught).

Timing per point: one warm-up call (compiles; ``compile_and_first_call_s``), then the median of
``--reps`` calls (default 3).

Roofline (``bench/roofline.py``): ``shared`` / ``flat`` points record the attention floor of one
layer over the whole call (``attn_floor_ms_per_layer``: the questions' prefill -- ``Q`` sequences
of the mean question length attending the document and themselves -- plus ``answer_tokens - 1``
decode steps at the mean suffix ``question + answer_tokens / 2``; the shared path's bytes and
flops, rates measured in the run) and, against the ``none`` point of the same ``Q``,
``roofline_ms = none time + layers x floor``, ``measured_over_roofline``, ``roofline_fraction``.

Usage::

    python bench/long_document.py --budget-min 8.5     # -> bench/results/long_document_<gpu>.json
    python bench/long_document.py --quick              # Q in {64, 256, 1024}
    python bench/long_document.py --smoke              # tiny model on CPU
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run: cheaper XLA:CPU compiles (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench import roofline  # noqa: E402
from models.generate import PromptBatch, generate, prefill_prefix_cache  # noqa: E402
from models.llama import Llama  # noqa: E402

NAME = "long_document"
KEY_FIELDS = ("model", "layers", "questions", "backend")
BACKENDS = ("shared", "flat", "none")
MODEL = "yi-6b-200k"
FULL_QUESTIONS = (64, 128, 256, 512, 1024)


def make_tokens(cfg, doc_tokens: int, n_questions: int, q_len: tuple[int, int], seed: int = 0):
    """Random document tokens and ``n_questions`` distinct random questions (lengths in ``q_len``)."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(3, cfg.vocab_size, size=doc_tokens).tolist()
    lens = rng.integers(q_len[0], q_len[1] + 1, size=n_questions)
    questions = [rng.integers(3, cfg.vocab_size, size=int(n)).tolist() for n in lens]
    return doc, questions


class Bench:
    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.cfg = ec.model_config(MODEL, args.layers, smoke=args.smoke)
        self.doc, self.questions = make_tokens(self.cfg, args.doc_tokens, max(args.questions), tuple(args.q_len))
        self.model = None
        self.rates: dict | None = None

    def floor(self, q: int) -> dict:
        """One layer's attention floor over one call (question prefill + answer decode steps)."""
        if self.rates is None:
            self.rates = roofline.measure_rates(self.args.smoke)
        a, cfg = self.args, self.cfg
        tq = sum(len(x) for x in self.questions[:q]) / q
        kw = dict(prefix=a.doc_tokens, heads_q=cfg.num_attention_heads, heads_kv=cfg.num_key_value_heads,
                  head_dim=cfg.head_dim, bw=self.rates["copy_bw_Bps"], mma=self.rates["matmul_flops"],
                  itemsize=jnp.dtype(self.dtype).itemsize)
        prefill = roofline.attention_floor(batch=q, tq=max(1, round(tq)), suffix=tq, **kw)["ms"]
        step = roofline.attention_floor(batch=q, tq=1, suffix=tq + a.answer_tokens / 2, **kw)["ms"]
        return {"attn_floor_ms_per_layer": prefill + (a.answer_tokens - 1) * step, **self.rates}

    def load(self):
        if self.model is None:
            t0 = time.perf_counter()
            self.params = ec.random_params(self.cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
            self.model = Llama(self.cfg)
            t1 = time.perf_counter()
            self.prefix_cache = jax.block_until_ready(
                prefill_prefix_cache(self.model, self.params, PromptBatch.shared(self.doc)))
            self.doc_prefill_s = time.perf_counter() - t1
            print(f"model built in {t1 - t0:.1f}s, document ({len(self.doc)} tokens) prefilled in "
                  f"{self.doc_prefill_s:.1f}s (excluded)", flush=True)

    def predicted_bytes(self, point) -> int:
        cfg, a = self.cfg, self.args
        q = point["questions"]
        isz = jnp.dtype(self.dtype).itemsize
        per_tok = ec.kv_bytes_per_token(cfg, isz)
        qmax = a.q_len[1]
        held = q * (a.doc_tokens + qmax + a.answer_tokens) if point["backend"] == "flat" else \
            q * (qmax + a.answer_tokens)
        if point["backend"] == "flat":   # flatten_prefix gathers one layer's document copy at a time
            held += q * a.doc_tokens // max(cfg.num_hidden_layers, 1)
        act = q * qmax * (cfg.hidden_size * 12 + cfg.intermediate_size * 6) + q * cfg.vocab_size * 4 * 3
        return ec.param_bytes(cfg, isz) + (a.doc_tokens + held) * per_tok + act + (256 << 20)

    def predict_oom(self, point) -> str | None:
        return ec.oom_reason(self.predicted_bytes(point), self.args.mem_limit, "weights + KV cache")

    def measure(self, point) -> dict:
        self.load()
        a = self.args
        q, backend = point["questions"], point["backend"]
        prompts = PromptBatch.shared(self.doc, suffixes=self.questions[:q])

        def call():
            t0 = time.perf_counter()
            out = generate(self.model, self.params, prompts, max_new_tokens=a.answer_tokens, attention=backend,
                           prefix_cache=self.prefix_cache, eos_token_ids=())
            dt = time.perf_counter() - t0       # generate returns host arrays: the work is finished
            ok = bool((out.lengths == a.answer_tokens).all())
            del out                             # free the cache before the next call
            return dt, ok

        first_s, ok = call()
        times = []
        for _ in range(a.reps):
            dt, ok_i = call()
            times.append(dt)
            ok = ok and ok_i
        t = statistics.median(times)
        extra = self.floor(q) if backend in ("shared", "flat") else {}
        return {**extra, "answer_tokens": a.answer_tokens, "times_s": times, "time_s": t,
                "tokens_per_s": q * a.answer_tokens / t, "compile_and_first_call_s": first_s,
                "all_answers_full_length": ok, "question_tokens": int(sum(len(x) for x in self.questions[:q])),
                "predicted_bytes": int(self.predicted_bytes(point))}


def plan_points(args) -> list[dict]:
    return [{"model": MODEL, "layers": args.layers, "questions": q, "backend": b}
            for q in args.questions for b in BACKENDS if b in args.backends]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, ())
    ap.add_argument("--layers", type=int, default=None, help="model layers (default 16 of 32)")
    ap.add_argument("--doc-tokens", type=int, default=None, help="shared document length (default 19947)")
    ap.add_argument("--questions", type=int, nargs="*", default=None, help="numbers of questions")
    ap.add_argument("--q-len", type=int, nargs=2, default=None, help="question length range (default 16 24)")
    ap.add_argument("--answer-tokens", type=int, default=None, help="tokens per answer (default 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps = min(args.reps, 2)
    ec.finish_args(args, dict(layers=16, doc_tokens=19947, q_len=[16, 24], answer_tokens=32,
                              questions=[64, 256, 1024] if args.quick else list(FULL_QUESTIONS)),
                   smoke=dict(layers=1, doc_tokens=48, questions=[2, 4], q_len=[3, 5], answer_tokens=3))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    fixed = {"doc_tokens": args.doc_tokens, "question_len_range": list(args.q_len),
             "answer_tokens": args.answer_tokens, "smoke": args.smoke,
             "dtype": "float32" if args.smoke else "bfloat16", "model": ec.MODELS[MODEL][0],
             "definition": "time_s = one generate() call with the prefilled document cache: question prefill + "
                           "answer decoding (document prefill excluded, as in Hydragen Figure 5)"}
    def after(store, bench, counts):
        store.note("commit", args.commit or ec.commit_of_checkout())
        roofline.annotate(store.data["points"], time_key="time_s", group=("model", "layers", "questions"),
                          scale=1e3)
        store.save()
        if bench.model is not None:
            store.note("doc_prefill_s_excluded", bench.doc_prefill_s)
    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, after=after)


if __name__ == "__main__":
    main()
