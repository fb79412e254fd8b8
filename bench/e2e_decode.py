"""End-to-end decode throughput with a shared prompt (Hydragen 4.1 / Tables 1-6 / Figure 3).

``B`` completions are sampled from one prompt of ``P`` tokens; we measure decode-only throughput
as in Hydragen D.1: the time to generate ``k`` tokens minus the time to generate 1, i.e.
``tokens/s = B * (k - 1) / (t(k) - t(1))`` where ``t(n)`` is one jitted call running ``n``
dependent decode steps (all layers + LM head + greedy argmax feeding the next step; the step
count is a traced argument, so ``t(1)`` and ``t(k)`` use the same executable).  Prefill is
excluded: the prompt's keys/values are random (random-weight models; only time matters), the
suffix buffers start empty (the completions) and grow to ``k`` tokens.

Backends (``models``): ``shared`` (prefix stored once, shared-prefix attention), ``flat``
(every sequence holds its own copy of the prompt: the FlashAttention baseline) and ``none``
(attention product skipped: the upper bound; it does not depend on ``P``, so it is measured
once per batch with ``prefix: null``).  Points that do not fit in memory are recorded as
``status: "oom"`` ("X" in the tables): predicted from the byte count when they cannot fit,
otherwise caught from XLA's RESOURCE_EXHAUSTED error.

Timing per point: one compile call (n=1), a warm-up call (n=min(k,16)), ``t(1)`` = median of 3
calls, ``t(k)`` = median of ``--reps`` calls (``--flat-reps`` for ``flat``, whose runs are long).

Roofline (``bench/roofline.py``): every ``shared`` / ``flat`` point records the attention floor of
one layer (``attn_floor_ms_per_layer``: the shared path's bytes and flops at the mean suffix of
the timed steps 2..k, ``(k + 2) / 2``, with the copy bandwidth and matmul rate measured in the run)
and, against the ``none`` point of its batch, ``roofline_ms = none step_ms + layers x floor``,
``measured_over_roofline`` and ``roofline_fraction``; ``shared_over_none_time`` is the old
``shared / none`` ratio as a time ratio.

Models (random bf16 weights, unrolled layer list = the decoder's fast GPU layout):
``llama3.1-8b`` (grouped-query, part ``gqa``) and ``codellama-7b`` (multi-head, Hydragen's
model, part ``mha``), both at ``--layers`` layers (default 16 of 32: the full grid then fits
one 80 GB GPU and the time budget; the setting is recorded in every point).  Part
``flat-probe``: Llama-3.1-8B shapes at ``--probe-layers`` (default 4) layers, batch >= 256 and
prefix >= 8K, where ``flat`` only fits at reduced depth (for the "shared >= 10x flat" target).

Usage::

    python bench/e2e_decode.py --part gqa --budget-min 8.5     # -> bench/results/e2e_decode_<gpu>.json
    python bench/e2e_decode.py --part mha --budget-min 8.5
    python bench/e2e_decode.py --part flat-probe
    python bench/e2e_decode.py --quick                          # small grid
    python bench/e2e_decode.py --smoke                          # tiny model on CPU
    python bench/plots.py                                       # tables, plots, targets
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

import jax_prefix_attn  # noqa: E402
from bench import e2e_common as ec  # noqa: E402
from bench import roofline  # noqa: E402
from bench.plots import e2e_targets  # noqa: E402
from models.kv_cache import KVCache, PrefixCache, empty_prefix_cache  # noqa: E402
from models.llama import Llama  # noqa: E402

NAME = "e2e_decode"
KEY_FIELDS = ("part", "model", "layers", "batch", "prefix", "backend")
BACKENDS = ("shared", "flat", "none")
FULL_BATCHES = (32, 64, 128, 256, 512, 1024)
FULL_PREFIXES = (1024, 2048, 4096, 8192, 16256)   # "16K" = 16256 as in Hydragen (fits 16384 with 128 new)
PART_MODELS = {"gqa": "llama3.1-8b", "mha": "codellama-7b", "flat-probe": "llama3.1-8b"}
NONE_PREFIX = 128                                  # prefix tokens held by the cache of "none" points


def plan_points(args) -> list[dict]:
    """Every point of the requested parts, in run order (per part: batch, prefix, backend)."""
    if args.smoke:
        grids = {"gqa": ((2, 4), (8, 16), args.layers), "mha": ((4,), (16,), args.layers),
                 "flat-probe": ((4,), (16,), args.probe_layers)}
    elif args.quick:
        grids = {"gqa": ((32, 256, 1024), (1024, 2048, 16256), args.layers),
                 "flat-probe": ((256,), (8192,), args.probe_layers)}
    else:
        grids = {"gqa": (FULL_BATCHES, FULL_PREFIXES, args.layers), "mha": (FULL_BATCHES, FULL_PREFIXES, args.layers),
                 "flat-probe": ((256, 512, 1024), (8192, 16256), args.probe_layers)}
    if args.batches:
        grids = {k: (tuple(args.batches), g[1], g[2]) for k, g in grids.items()}
    if args.prefixes:
        grids = {k: (g[0], tuple(args.prefixes), g[2]) for k, g in grids.items()}
    backends = tuple(args.backends)
    plan = []
    for part, (batches, prefixes, layers) in grids.items():
        if args.part not in ("all", part):
            continue
        for b in batches:
            if "none" in backends:
                plan.append({"part": part, "model": PART_MODELS[part], "layers": layers, "batch": b,
                             "prefix": None, "backend": "none"})
            for p in prefixes:
                for backend in ("shared", "flat"):
                    if backend in backends:
                        plan.append({"part": part, "model": PART_MODELS[part], "layers": layers, "batch": b,
                                     "prefix": p, "backend": backend})
    return plan


class Bench:
    """Holds the current model's parameters and the jitted decode runner."""

    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.k = args.gen_tokens
        self.loaded: tuple | None = None
        self.params = None
        self.first_logits: dict = {}
        self.rates: dict | None = None

    # -- model ------------------------------------------------------------------------------
    def cfg(self, point):
        return ec.model_config(point["model"], point["layers"], smoke=self.args.smoke)

    def model(self, point):
        key = (point["model"], point["layers"])
        if self.loaded != key:
            self.params = None
            ec.free_memory()
            cfg = self.cfg(point)
            t0 = time.perf_counter()
            self.params = ec.random_params(cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
            self.model_obj = Llama(cfg)
            self.runner = make_runner(self.model_obj)
            self.loaded = key
            print(f"model {key}: {cfg.num_params() / 1e9:.2f}B params, built in {time.perf_counter() - t0:.1f}s",
                  flush=True)
        return self.model_obj

    # -- memory prediction ------------------------------------------------------------------
    def predicted_bytes(self, point) -> int:
        cfg = self.cfg(point)
        b, k = point["batch"], self.k
        p = point["prefix"] if point["prefix"] is not None else NONE_PREFIX
        per_tok = ec.kv_bytes_per_token(cfg, jnp.dtype(self.dtype).itemsize)
        held = b * (p + k) if point["backend"] == "flat" else p + b * k
        act = b * cfg.vocab_size * 4 * 3 + b * (cfg.hidden_size * 8 + cfg.intermediate_size * 6) * 4
        return ec.param_bytes(cfg, jnp.dtype(self.dtype).itemsize) + held * per_tok + act + (256 << 20)

    def predict_oom(self, point) -> str | None:
        return ec.oom_reason(self.predicted_bytes(point), self.args.mem_limit, "weights + KV cache + logits")

    # -- one point --------------------------------------------------------------------------
    def normal(self, key, i: int, shape) -> jax.Array:
        """Standard normal values (numpy in smoke runs: XLA:CPU compiles random programs slowly)."""
        if self.args.smoke:
            seed = int(np.asarray(jax.random.key_data(jax.random.fold_in(key, i))).sum())
            return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), self.dtype)
        return jax.random.normal(jax.random.fold_in(key, i), shape, self.dtype)

    def caches(self, point, cfg):
        """Prefix cache + suffix buffers for shared/none, or the flat buffers (prompt copied)."""
        b, k, backend = point["batch"], self.k, point["backend"]
        p = point["prefix"] if point["prefix"] is not None else NONE_PREFIX
        hkv, d, nl = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        key = jax.random.fold_in(jax.random.PRNGKey(1), b * 100_003 + p)
        pre_layers, layers = [], []
        fill_flat = jax.jit(lambda pk: jnp.zeros((b, p + k, hkv, d), self.dtype).at[:, :p].set(
            jnp.broadcast_to(pk, (b, p, hkv, d))))
        for i in range(nl):
            pk, pv = self.normal(key, 2 * i, (1, p, hkv, d)), self.normal(key, 2 * i + 1, (1, p, hkv, d))
            if backend == "flat":
                layers.append({"k": fill_flat(pk), "v": fill_flat(pv)})
            else:
                pre_layers.append({"k": (pk,), "v": (pv,)})
                layers.append({"k": jnp.zeros((b, k, hkv, d), self.dtype), "v": jnp.zeros((b, k, hkv, d), self.dtype)})
            del pk, pv
        if backend == "flat":
            prefix = empty_prefix_cache(cfg, self.dtype, stacked=False)
            lengths0, pos0 = jnp.full((b,), p, jnp.int32), jnp.zeros((b,), jnp.int32)
        else:
            prefix = PrefixCache(layers=pre_layers, lengths=(jnp.full((1,), p, jnp.int32),),
                                 last_logits=jnp.zeros((1, cfg.vocab_size), jnp.float32))
            lengths0, pos0 = jnp.zeros((b,), jnp.int32), jnp.full((b,), p, jnp.int32)
        tokens0 = jnp.asarray(np.random.default_rng(b * 7 + p).integers(0, cfg.vocab_size, b), jnp.int32)
        return jax.block_until_ready((prefix, layers, lengths0, pos0, tokens0))

    def measure(self, point) -> dict:
        model = self.model(point)
        cfg = model.config
        args, k, backend = self.args, self.k, point["backend"]
        b = point["batch"]
        prefix, layers, lengths0, pos0, tokens0 = self.caches(point, cfg)
        run = self.runner

        def call(n):
            nonlocal layers
            t0 = time.perf_counter()
            layers, tok, head, finite = run(self.params, prefix, layers, lengths0, pos0, tokens0, jnp.int32(n),
                                            backend=backend)
            jax.block_until_ready((layers, tok))
            return time.perf_counter() - t0, head, finite

        compile_s, head, finite = call(1)
        head = np.asarray(head, np.float64)
        call(min(k, 16))
        t1 = [call(1)[0] for _ in range(3)]
        reps = args.flat_reps if backend == "flat" else args.reps
        tk = []
        for _ in range(reps):
            dt, _, fin = call(k)
            tk.append(dt)
            finite = finite & fin
        del layers, prefix
        m1, mk = statistics.median(t1), statistics.median(tk)
        decode_s = mk - m1
        valid = decode_s > 0    # False only when timing noise exceeds the decode time (tiny smoke shapes)
        rec = {"gen_tokens": k, "t1_s": t1, "tk_s": tk, "decode_s": decode_s, "timing_valid": valid,
               "step_ms": 1e3 * decode_s / (k - 1) if valid else None,
               "tokens_per_s": b * (k - 1) / decode_s if valid else None,
               "tokens_per_s_reps": [b * (k - 1) / (t - m1) if t > m1 else None for t in tk],
               "compile_and_first_call_s": compile_s, "logits_finite": bool(finite),
               "predicted_bytes": int(self.predicted_bytes(point))}
        if backend == "shared":    # which kernel path impl="auto" picks for the first decode step
            rec["shared_prefix_auto_path"] = auto_path(cfg, b, point["prefix"], k)
        if backend in ("shared", "flat"):
            rec.update(self.floor(cfg, b, point["prefix"]))
        # same cache contents and first tokens for shared and flat: their first-step logits agree
        ckey = (point["part"], point["model"], point["layers"], b, point["prefix"])
        if backend in ("shared", "flat"):
            other = self.first_logits.get(ckey)
            if other is not None and other[0] != backend:
                ref = other[1]
                rec[f"rel_err_first_logits_vs_{other[0]}"] = float(np.linalg.norm(head - ref) /
                                                                   max(np.linalg.norm(ref), 1e-30))
            self.first_logits[ckey] = (backend, head)
        return rec


    def floor(self, cfg, batch: int, prefix: int) -> dict:
        """One layer's attention floor per decode step at the timed steps' mean suffix."""
        if self.rates is None:
            self.rates = roofline.measure_rates(self.args.smoke)
        mean_s = (self.k + 2) / 2
        f = roofline.attention_floor(batch=batch, tq=1, prefix=prefix, suffix=mean_s,
                                     heads_q=cfg.num_attention_heads, heads_kv=cfg.num_key_value_heads,
                                     head_dim=cfg.head_dim, bw=self.rates["copy_bw_Bps"],
                                     mma=self.rates["matmul_flops"], itemsize=jnp.dtype(self.dtype).itemsize)
        return {"attn_floor_ms_per_layer": f["ms"], "attn_floor_mean_suffix": mean_s, **self.rates}


def annotate_roofline(store) -> None:
    """Roofline fields of every stored shared / flat point against its batch's ``none`` point."""
    roofline.annotate(store.data["points"], time_key="step_ms", group=("part", "model", "layers", "batch"))
    store.save()


def auto_path(cfg, batch: int, prefix: int, suffix: int) -> str:
    """The planner's choice ("shared" / "flat" kernel path) for one bf16 decode step, or why not known."""
    try:
        return jax_prefix_attn.plan_shared_prefix(
            batch=batch, tq=1, heads_q=cfg.num_attention_heads, heads_kv=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, groups=1, prefix_len=prefix, suffix_len=suffix, dtype=jnp.bfloat16).impl
    except Exception as e:  # noqa: BLE001 - informative only
        return f"unknown: {e!r}"[:200]


def make_runner(model: Llama):
    """``run(params, prefix, layers, lengths0, pos0, tokens0, n)``: ``n`` greedy decode steps."""
    def run(params, prefix, layers, lengths0, pos0, tokens0, n, *, backend):
        cache = KVCache(prefix=prefix, layers=layers, lengths=lengths0, pos_offset=pos0, backend=backend)
        rows = min(tokens0.shape[0], 4)

        def body(i, carry):
            cache, tok, head, finite = carry
            logits, cache = model.decode_step(params, cache, tok)
            new = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            # the first step's logits (identical inputs for every backend) are returned
            head = jnp.where(i == 0, logits[:rows], head)
            return cache, new, head, finite & jnp.all(jnp.isfinite(logits))

        init = (cache, tokens0, jnp.zeros((rows, model.config.vocab_size), jnp.float32), jnp.bool_(True))
        cache, tok, head, finite = jax.lax.fori_loop(0, n, body, init)
        return cache.layers, tok, head, finite

    return jax.jit(run, static_argnames=("backend",), donate_argnames=("layers",))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, PART_MODELS)
    ap.add_argument("--layers", type=int, default=None, help="layers of the gqa/mha models (default 16)")
    ap.add_argument("--probe-layers", type=int, default=None, help="layers of the flat-probe part (default 4)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="k, generated tokens per sequence (default 128)")
    ap.add_argument("--reps", type=int, default=2, help="timed k-token calls per point")
    ap.add_argument("--flat-reps", type=int, default=1, help="timed k-token calls per flat point")
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="override the batch sizes")
    ap.add_argument("--prefixes", type=int, nargs="*", default=None, help="override the prefix lengths")
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args(argv)
    ec.finish_args(args, dict(layers=16, probe_layers=4, gen_tokens=128),
                   smoke=dict(layers=1, probe_layers=1, gen_tokens=8))
    if args.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2 (decode-only time is t(k) - t(1))")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    fixed = {"gen_tokens": args.gen_tokens, "smoke": args.smoke,
             "dtype": "float32" if args.smoke else "bfloat16",
             "models": {m: ec.MODELS[m][0] for m in sorted(set(PART_MODELS.values()))},
             "definition": "tokens_per_s = batch * (k - 1) / (t(k) - t(1)); t(n) = one call of n greedy decode "
                           "steps (Hydragen D.1: time for k tokens minus time for 1); prefill excluded",
             "none_backend": "attention product skipped (functionally wrong): upper bound, independent of prefix"}

    def after(store, bench, counts):
        store.note("commit", args.commit or ec.commit_of_checkout())
        annotate_roofline(store)
        ec.report_targets(store, e2e_targets)
    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, after=after)


if __name__ == "__main__":
    main()
