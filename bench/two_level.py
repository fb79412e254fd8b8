"""Two-level (tree) vs single-level prefix sharing (Hydragen 4.4 / Figure 6 / D.4).

Competitive-programming shape: a few-shot root of ``--root-tokens`` (default 2400) shared by
every sequence; problems of 300-800 tokens (seeded uniform lengths); ``--samples`` (default 128)
completions per problem; ``--gen-tokens`` (default 512) generated tokens each (EOS disabled).
A batch holds ``p`` problems, i.e. ``p * samples`` sequences.

* ``tree``: :meth:`PromptBatch.two_level` -- root and problems are prefix levels, each stored
  and prefilled once; attention reads the root once per batch (inter-sequence batching) and each
  problem once per problem (``models.attention.cache_attention``, backend ``shared``).
* ``single``: :meth:`PromptBatch.shared` -- only the root is shared; every sequence holds (and
  prefills) its own copy of its problem in its suffix, as Hydragen's single-level baseline.

Points: ``single`` and ``tree`` at the same batch (``p_equal`` problems: by default the largest
that single-level fits in memory), and ``tree`` at the larger batch its memory saving allows
(``p_large``: by default the largest that fits, capped by ``--max-problems``; on an
out-of-memory error the next smaller batch is tried).  Timed per point: one ``generate`` call
for all ``gen_tokens`` (``total_s``: prefill of root + problems + decoding) and one for 1 token;
``decode_s = total_s - t(1)`` (Hydragen D.1's decode-only time).  Reported per problem
(Hydragen reports the time for its 120 APPS problems; ``time_120_problems_s`` extrapolates).

Model: CodeLlama-7B shapes (Hydragen's model, multi-head), random bf16 weights, ``--layers``
layers (default 16 of 32, recorded).

Usage::

    python bench/two_level.py --budget-min 8.5        # -> bench/results/two_level_<gpu>.json
    python bench/two_level.py --gen-tokens 256         # shorter completions (recorded)
    python bench/two_level.py --quick                  # the equal-batch pair only
    python bench/two_level.py --smoke                  # tiny model on CPU
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

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench.plots import two_level_targets  # noqa: E402
from models.generate import PromptBatch, generate  # noqa: E402
from models.llama import Llama  # noqa: E402

NAME = "two_level"
KEY_FIELDS = ("model", "layers", "method", "problems")
MODEL = "codellama-7b"
METHODS = ("single", "tree")


class Bench:
    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.cfg = ec.model_config(MODEL, args.layers, smoke=args.smoke)
        rng = np.random.default_rng(0)
        v = self.cfg.vocab_size
        self.root = rng.integers(3, v, size=args.root_tokens).tolist()
        lo, hi = args.problem_len
        self.problem_lens = rng.integers(lo, hi + 1, size=args.max_problems).tolist()
        self.problems = [rng.integers(3, v, size=n).tolist() for n in self.problem_lens]
        self.model = None

    def load(self):
        if self.model is None:
            self.params = ec.random_params(self.cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
            self.model = Llama(self.cfg)

    def prompts(self, method: str, p: int) -> PromptBatch:
        s = self.args.samples
        if method == "tree":
            return PromptBatch.two_level(self.root, self.problems[:p], num_samples=s)
        return PromptBatch.shared(self.root, suffixes=self.problems[:p], num_samples=s)

    def predicted_bytes(self, method: str, p: int) -> int:
        cfg, a = self.cfg, self.args
        isz = jnp.dtype(self.dtype).itemsize
        per_tok = ec.kv_bytes_per_token(cfg, isz)
        b = p * a.samples
        pmax = max(self.problem_lens[:p])
        if method == "tree":
            held = a.root_tokens + p * pmax + b * a.gen_tokens
            act = p * pmax * (cfg.hidden_size * 12 + cfg.intermediate_size * 6)
        else:
            held = a.root_tokens + b * (pmax + a.gen_tokens)
            act = b * pmax * (cfg.hidden_size * 12 + cfg.intermediate_size * 6)
        act += b * cfg.vocab_size * 4 * 3
        return ec.param_bytes(cfg, isz) + held * per_tok + act + (256 << 20)

    def fits(self, method: str, p: int) -> bool:
        lim = self.args.mem_limit
        return lim is None or self.predicted_bytes(method, p) <= lim

    def predict_oom(self, point) -> str | None:
        return ec.oom_reason(self.predicted_bytes(point["method"], point["problems"]), self.args.mem_limit)

    def measure(self, point) -> dict:
        self.load()
        a = self.args
        method, p = point["method"], point["problems"]
        prompts = self.prompts(method, p)
        b = prompts.batch

        def call(k):
            t0 = time.perf_counter()
            out = generate(self.model, self.params, prompts, max_new_tokens=k, attention="shared", eos_token_ids=())
            dt = time.perf_counter() - t0       # host arrays returned: the work is finished
            ok = bool((out.lengths == k).all())
            del out                             # free the cache before the next call
            return dt, ok

        first_k, ok = call(a.gen_tokens)
        tk = []
        for _ in range(a.reps):
            dt, ok_i = call(a.gen_tokens)
            tk.append(dt)
            ok = ok and ok_i
        first_1, _ = call(1)
        t1 = [call(1)[0] for _ in range(3)]
        total, m1 = statistics.median(tk), statistics.median(t1)
        decode = total - m1
        valid = decode > 0      # False only when timing noise exceeds the decode time (tiny smoke shapes)
        return {"batch": b, "samples": a.samples, "gen_tokens": a.gen_tokens, "tk_s": tk, "t1_s": t1,
                "total_s": total, "decode_s": decode, "timing_valid": valid, "per_problem_s": total / p,
                "decode_per_problem_s": decode / p if valid else None, "time_120_problems_s": 120 * total / p,
                "tokens_per_s": b * a.gen_tokens / total,
                "decode_tokens_per_s": b * (a.gen_tokens - 1) / decode if valid else None,
                "compile_and_first_call_s": [first_k, first_1], "all_full_length": ok,
                "problem_tokens": [len(x) for x in self.problems[:p]],
                "predicted_bytes": int(self.predicted_bytes(method, p))}


def choose_problems(bench: Bench) -> tuple[int, int]:
    """``(p_equal, p_large)`` from the flags or the memory estimate."""
    a = bench.args
    p_eq = a.equal_problems or max([p for p in range(1, a.max_problems + 1) if bench.fits("single", p)] or [1])
    p_large = a.large_problems or max([p for p in range(1, a.max_problems + 1) if bench.fits("tree", p)] or [1])
    return p_eq, max(p_large, p_eq)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, ("equal", "large"))
    ap.add_argument("--layers", type=int, default=None, help="model layers (default 16 of 32)")
    ap.add_argument("--root-tokens", type=int, default=None, help="few-shot root length (default 2400)")
    ap.add_argument("--problem-len", type=int, nargs=2, default=None, help="problem length range (300 800)")
    ap.add_argument("--samples", type=int, default=None, help="completions per problem (default 128)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="generated tokens per completion (default 512)")
    ap.add_argument("--equal-problems", type=int, default=None, help="problems per batch at equal batch")
    ap.add_argument("--large-problems", type=int, default=None, help="problems per batch of the larger tree batch")
    ap.add_argument("--max-problems", type=int, default=None, help="cap of problems per batch (default 8)")
    ap.add_argument("--reps", type=int, default=1, help="timed gen-token calls per point (after a warm-up call)")
    args = ap.parse_args(argv)
    if args.quick and args.part == "all":   # quick: the equal-batch pair only
        args.part = "equal"
    ec.finish_args(args, dict(layers=16, root_tokens=2400, problem_len=[300, 800], samples=128,
                              gen_tokens=512, max_problems=8),
                   smoke=dict(layers=1, root_tokens=24, problem_len=[6, 12], samples=2, gen_tokens=3,
                              equal_problems=1, large_problems=2, max_problems=2))
    if args.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2")
    for name in ("equal_problems", "large_problems"):
        v = getattr(args, name)
        if v is not None and not 1 <= v <= args.max_problems:
            ap.error(f"--{name.replace('_', '-')} must be in [1, --max-problems={args.max_problems}], got {v}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    bench = Bench(args)
    p_eq, p_large = choose_problems(bench)
    base = {"model": MODEL, "layers": args.layers}
    plan = []
    if args.part in ("all", "equal"):
        plan += [dict(base, method=m, problems=p_eq, role="equal_batch") for m in METHODS]
    large = [dict(base, method="tree", problems=p, role="larger_batch") for p in range(p_large, p_eq, -1)]
    if args.list:
        for p in plan + large[:1]:
            print(p)
        return {"planned": len(plan) + len(large[:1]), "p_equal": p_eq, "p_large": p_large}
    fixed = {"root_tokens": args.root_tokens, "problem_len_range": list(args.problem_len), "samples": args.samples,
             "gen_tokens": args.gen_tokens, "smoke": args.smoke, "dtype": "float32" if args.smoke else "bfloat16",
             "model": ec.MODELS[MODEL][0],
             "definition": "total_s = one generate() call (prefill of root + problems + gen_tokens of decoding); "
                           "decode_s = total_s - t(1 token); per problem = / problems per batch"}
    budget = ec.Budget(args.budget_min)

    def after(store, bench, counts):
        store.note("p_equal_p_large", [p_eq, p_large])
        if args.part in ("all", "large"):
            for pt in large:   # the largest tree batch that fits (out-of-memory: the next smaller one)
                c = ec.run_points(store, [pt], bench.measure, budget, predict_oom=bench.predict_oom)
                counts = {k: counts[k] + c[k] for k in counts}
                rec = store.done(pt)
                if rec is not None and rec["status"] == "ok":
                    break
        store.note("counts", counts)
        ec.report_targets(store, two_level_targets)
        return counts
    title = f"equal batch {p_eq} x {args.samples}, larger tree batch <= {p_large} x {args.samples}"
    res = ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan, lambda _: bench, budget=budget,
                          title=title, after=after)
    return dict(res, p_equal=p_eq, p_large=p_large)


if __name__ == "__main__":
    main()
