"""End-to-end decode throughput of a DeepSeek (MLA + MoE) decoder with a shared prompt: the
latent prefix stored once (``shared``) against every sequence's own copy (``flat``), with the
step's roofline.

``B`` completions continue one prompt of ``P`` tokens; decode-only throughput as
``bench/e2e_decode.py`` measures it (Hydragen D.1): ``tokens/s = B * (k - 1) / (t(k) - t(1))``,
``t(n)`` one jitted call of ``n`` dependent greedy decode steps of
:meth:`models.deepseek.Deepseek.decode_step` (all layers, LM head, argmax feeding the next
step; the step count is traced, so ``t(1)`` and ``t(k)`` run one executable).  Prefill is
excluded: the prompt's latents and RoPE keys are random, the completions' buffers start empty.
Per point: a compile call (n=1), a warm-up call (n=min(k, 16)), ``t(1)`` = median of 3,
``t(k)`` = median of ``--reps`` (2; ``--flat-reps`` 1).

Layouts (:class:`models.deepseek.LatentCache`, every layer's attention through
:func:`jax_prefix_attn.mla_attention` with ``impl="auto"``: the Mosaic GPU kernels on an H200):

* ``shared``: one prompt entry (``G = 1``: latents ``[1, P, R]``, RoPE keys ``[1, P, Dr]``),
  ``seq_to_prefix`` all 0, suffix buffers ``[B, k, R]`` starting empty: the one-prefix layout the
  kernels take without a device-side check (the prefix kernel over all ``B x H`` query rows,
  the suffix kernel per sequence);
* ``flat``: a placeholder prompt of length 0 and every sequence's suffix buffer
  ``[B, P + k, R]`` holding its own copy of the prompt's latents (lengths start at ``P``): the
  same kernels without sharing.  (``PromptBatch`` prefill's flat layout, ``G = B`` prompt
  entries of one sequence each, runs the prefix kernel once per sequence; not timed here.)

Both start from identical cache contents and tokens: every point stores a corner of its first
step's logits (``first_logits_head``, 2 x 64) and every ``flat`` point the relative error of its
corner against its ``shared`` twin's (``rel_err_first_logits_vs_shared``, filled in at the end of
every run).  ``mla_auto_impl`` records what ``impl="auto"`` picks for the
point's shapes on this device (and why).

Roofline (:func:`bench.roofline.mla_moe_roofline`): per step ``max(bytes / copy rate, flops /
matmul rate)`` with both rates measured in the run; bytes = the weights read once (the routed
experts ``min(64, 6 B)`` touch, the shared experts, the dense layer, attention, the LM head) +
the latent cache (``shared``: the prefix once + every suffix; ``flat``: the prefix per
sequence) ; flops = ``2 B`` per matrix parameter a token uses + absorbed attention.
``roofline_step_ms`` averages the timed steps 2..k, ``roofline_ms`` sums all k steps;
``roofline_fraction = roofline_step_ms / step_ms``.  The routed experts run in per-expert
buckets of twice the mean rows, in more rounds where an expert has more
(``models/deepseek/moe.py``): at least twice the routed experts' flops, which the roofline does
not include.  The key field ``moe_lowering`` names that form (``"buckets"``; points measured
before it took rounds say ``"xla_default"``).

Model: DeepSeek-V2-Lite shapes (``models.deepseek.config.PRESETS``; 27 layers, hidden 2048, 16
heads, R=512, Dr=64, 64 routed experts of 1408, 6 per token, 2 shared, layer 0 dense of 10944,
vocab 102400; 15.7B parameters, 31.4 GB in bf16) with random bf16 weights drawn on the device,
``--layers`` keeping the first ``N`` layers (default all 27).  Grid: B in {64, ..., 1024} x P in
{1K, 4K, 16K} x {shared, flat}.  A point whose weights + latent caches + activations exceed the
allocator's limit is recorded as out of memory with the estimate (``flat`` at B >= 1024 x 4K,
B >= 256 x 16K on an H200).

Result file: ``--out`` (default ``bench/results/e2e_decode_mla_<gpu>.json``), rewritten
atomically after every point.  An existing file is refused unless ``--resume``, which keeps its
points and measures the missing ones.  ``--budget-s`` (or ``--budget-min``) starts no point after
that many seconds.  ``--commit`` names the measured commit (default ``git rev-parse HEAD`` of
this checkout; a copied checkout's git may be stale), recorded per point and per run.

Usage::

    python bench/e2e_decode_mla.py --budget-s 360 --commit SHA            # then the same with --resume
    python bench/e2e_decode_mla.py --quick --out /tmp/q.json                # B 256, 1024 x P 1K, 16K
    python bench/e2e_decode_mla.py --smoke                                  # tiny model on CPU
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run: cheaper XLA:CPU compiles (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench import roofline  # noqa: E402
from jax_prefix_attn.device import device_info as planning_device  # noqa: E402
from jax_prefix_attn.mla_kernels import auto_impl  # noqa: E402
from models.deepseek import Deepseek, DeepseekConfig, LatentCache, LatentPrefix  # noqa: E402
from models.deepseek.config import PRESETS  # noqa: E402

NAME = "e2e_decode_mla"
KEY_FIELDS = ("model", "layers", "batch", "prefix", "backend", "moe_lowering")
BACKENDS = ("shared", "flat")
BATCHES = (64, 128, 256, 512, 1024)
PREFIXES = (1024, 4096, 16384)
MODELS = {"deepseek-v2-lite": "DeepSeek-V2-Lite"}
FLAT_PLACEHOLDER = 64       # rows of the flat layout's empty prompt entry (one kernel key block)
TARGET = {"min_batch": 256, "min_prefix": 4096, "roofline_fraction": 0.9}


def model_config(name: str, layers: int, *, smoke: bool) -> DeepseekConfig:
    """The config of ``--model`` at ``layers`` layers (``smoke``: the tiny CPU model)."""
    if smoke:
        return ec.deepseek_smoke_config(layers)
    return PRESETS[MODELS[name]].replace(num_hidden_layers=layers)


def plan_points(args) -> list[dict]:
    """Every point, in run order: ``shared`` over the grid (batch, prefix), then ``flat``."""
    if args.smoke:
        batches, prefixes = (2,), (8,)
    elif args.quick:
        batches, prefixes = (256, 1024), (1024, 16384)
    else:
        batches, prefixes = BATCHES, PREFIXES
    batches, prefixes = tuple(args.batches or batches), tuple(args.prefixes or prefixes)
    return [{"model": args.model, "layers": args.layers, "batch": b, "prefix": p, "backend": backend,
             "moe_lowering": args.moe_lowering}
            for backend in BACKENDS if backend in args.backends for b in batches for p in prefixes]


class Bench:
    """The current model's parameters, its jitted decode runner and the run's rates."""

    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.k = args.gen_tokens
        self.loaded = None
        self.rates: dict | None = None

    def cfg(self, point) -> DeepseekConfig:
        return model_config(point["model"], point["layers"], smoke=self.args.smoke)

    def model(self, point) -> Deepseek:
        key = (point["model"], point["layers"])
        if self.loaded != key:
            self.params = None
            ec.free_memory()
            cfg = self.cfg(point)
            if self.rates is None:   # before the weights take the memory the copy measurement uses
                self.rates = roofline.measure_rates(self.args.smoke)
            t0 = time.perf_counter()
            self.params = ec.deepseek_random_params(cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
            # CPU smoke runs take the reference attention; "auto" takes the kernels on the GPU
            self.model_obj = Deepseek(cfg, impl="reference" if self.args.smoke else "auto")
            self.runner = make_runner(self.model_obj)
            self.loaded = key
            print(f"model {key}: {ec.deepseek_param_bytes(cfg, 1) / 1e9:.2f}B params, built in "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
        return self.model_obj

    # -- memory prediction ------------------------------------------------------------------
    def predicted_bytes(self, point) -> int:
        """Weights + latent caches + the step's largest activations (logits, the routed
        experts' buckets, the attention's partial states)."""
        c, item = self.cfg(point), jnp.dtype(self.dtype).itemsize
        b, p, k = point["batch"], point["prefix"], self.k
        w = c.kv_lora_rank + c.qk_rope_head_dim
        tokens = p + b * k if point["backend"] == "shared" else FLAT_PLACEHOLDER + b * (p + k)
        rows = b * (c.num_experts_per_tok or 1)
        buckets = 2 * rows * max(c.hidden_size, c.moe_intermediate_size or 1) * item * 4   # [E, C, .] x 4
        act = b * c.vocab_size * 4 * 3 + buckets + b * c.num_attention_heads * c.kv_lora_rank * 4 * 4
        return ec.deepseek_param_bytes(c, item) + c.num_hidden_layers * tokens * w * item + act + (512 << 20)

    def predict_oom(self, point) -> str | None:
        return ec.oom_reason(self.predicted_bytes(point), self.args.mem_limit,
                             "weights + latent caches + activations")

    # -- one point --------------------------------------------------------------------------
    def normal(self, key, i: int, shape) -> jax.Array:
        if self.args.smoke:
            seed = int(np.asarray(jax.random.key_data(jax.random.fold_in(key, i))).sum())
            return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), self.dtype)
        return jax.random.normal(jax.random.fold_in(key, i), shape, self.dtype)

    def cache(self, point, c: DeepseekConfig) -> tuple[LatentCache, jax.Array]:
        """The point's :class:`LatentCache` (the module docstring's layouts) and first tokens."""
        b, p, k = point["batch"], point["prefix"], self.k
        r, dr, nl = c.kv_lora_rank, c.qk_rope_head_dim, c.num_hidden_layers
        key = jax.random.fold_in(jax.random.PRNGKey(1), b * 100_003 + p)
        flat = point["backend"] == "flat"
        fill = jax.jit(lambda x: jnp.zeros((b, p + k, x.shape[-1]), self.dtype).at[:, :p].set(
            jnp.broadcast_to(x, (b, p, x.shape[-1]))))
        pre_c, pre_k, suf_c, suf_k = [], [], [], []
        for i in range(nl):
            lat, rk = self.normal(key, 2 * i, (1, p, r)), self.normal(key, 2 * i + 1, (1, p, dr))
            if flat:
                suf_c.append(fill(lat))
                suf_k.append(fill(rk))
                pre_c.append(jnp.zeros((1, FLAT_PLACEHOLDER, r), self.dtype))
                pre_k.append(jnp.zeros((1, FLAT_PLACEHOLDER, dr), self.dtype))
            else:
                pre_c.append(lat)
                pre_k.append(rk)
                suf_c.append(jnp.zeros((b, k, r), self.dtype))
                suf_k.append(jnp.zeros((b, k, dr), self.dtype))
            del lat, rk
        prefix = LatentPrefix(latent=tuple(pre_c), rope_k=tuple(pre_k),
                              lengths=jnp.full((1,), 0 if flat else p, jnp.int32),
                              last_logits=jnp.zeros((1, c.vocab_size), jnp.float32))
        cache = LatentCache(prefix=prefix, latent=tuple(suf_c), rope_k=tuple(suf_k),
                            lengths=jnp.full((b,), p if flat else 0, jnp.int32),
                            seq_to_prefix=jnp.zeros((b,), jnp.int32))
        tokens0 = jnp.asarray(np.random.default_rng(b * 7 + p).integers(0, c.vocab_size, b), jnp.int32)
        return jax.block_until_ready((cache, tokens0))

    def measure(self, point) -> dict:
        model = self.model(point)
        c, args, k, b = model.config, self.args, self.k, point["batch"]
        cache, tokens0 = self.cache(point, c)
        kept, suffix = model.split_cache(cache)
        rec = {"commit": args.commit_measured, **mla_auto(c, point, k, self.dtype)}

        def call(n):
            nonlocal suffix
            t0 = time.perf_counter()
            suffix, tok, head, finite = self.runner(self.params, kept, suffix, tokens0, jnp.int32(n))
            jax.block_until_ready((suffix, tok))
            return time.perf_counter() - t0, head, finite

        compile_s, head, finite = call(1)
        head = np.asarray(head[:2, :64], np.float64)
        call(min(k, 16))
        t1 = [call(1)[0] for _ in range(3)]
        tk = []
        for _ in range(args.flat_reps if point["backend"] == "flat" else args.reps):
            dt, _, fin = call(k)
            tk.append(dt)
            finite = finite & fin
        del suffix, cache
        m1, mk = statistics.median(t1), statistics.median(tk)
        decode_s = mk - m1
        valid = decode_s > 0     # False only when timing noise exceeds the decode time (tiny smoke shapes)
        step_ms = 1e3 * decode_s / (k - 1) if valid else None
        rec.update({"gen_tokens": k, "t1_s": t1, "tk_s": tk, "decode_s": decode_s, "timing_valid": valid,
                    "step_ms": step_ms, "tokens_per_s": b * (k - 1) / decode_s if valid else None,
                    "tokens_per_s_reps": [b * (k - 1) / (t - m1) if t > m1 else None for t in tk],
                    "compile_and_first_call_s": compile_s, "logits_finite": bool(finite),
                    "predicted_bytes": int(self.predicted_bytes(point)), "first_logits_head": head.tolist()})
        rec.update(self.roofline(c, point, step_ms))
        return rec

    def roofline(self, c: DeepseekConfig, point, step_ms: float | None) -> dict:
        if self.rates is None:
            self.rates = roofline.measure_rates(self.args.smoke)
        roof = roofline.mla_moe_roofline(c, batch=point["batch"], prefix=point["prefix"], steps=self.k,
                                         shared=point["backend"] == "shared", bw=self.rates["copy_bw_Bps"],
                                         mma=self.rates["matmul_flops"], itemsize=jnp.dtype(self.dtype).itemsize)
        out = {**roof, **self.rates, "roofline_tokens_per_s": point["batch"] / (roof["roofline_step_ms"] * 1e-3)}
        if step_ms:
            out.update(roofline_fraction=roof["roofline_step_ms"] / step_ms,
                       measured_over_roofline=step_ms / roof["roofline_step_ms"])
        return out


def compare_layouts(points: list[dict]) -> int:
    """``rel_err_first_logits_vs_shared`` of every finished ``flat`` point whose ``shared`` twin
    (the other key fields equal) finished; returns how many were compared."""
    twin = lambda p: tuple(p.get(k) for k in KEY_FIELDS if k != "backend")  # noqa: E731
    shared = {twin(p): p for p in points if p.get("backend") == "shared" and "first_logits_head" in p}
    n = 0
    for p in points:
        ref = shared.get(twin(p))
        if p.get("backend") == "flat" and "first_logits_head" in p and ref is not None:
            a, r = np.asarray(p["first_logits_head"]), np.asarray(ref["first_logits_head"])
            p["rel_err_first_logits_vs_shared"] = float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30))
            n += 1
    return n


def mla_auto(c: DeepseekConfig, point, k: int, dtype) -> dict:
    """What ``mla_attention(impl="auto")`` takes for the point's decode-step shapes on this
    device, and why."""
    b, p = point["batch"], point["prefix"]
    flat = point["backend"] == "flat"
    s = jax.ShapeDtypeStruct
    q = s((b, 1, c.num_attention_heads, c.kv_lora_rank), dtype)
    qr = s((b, 1, c.num_attention_heads, c.qk_rope_head_dim), dtype)
    pre = s((1, FLAT_PLACEHOLDER if flat else p, c.kv_lora_rank), dtype)
    suf = s((b, p + k if flat else k, c.kv_lora_rank), dtype)
    impl, why = auto_impl(q, qr, pre, suf, planning_device())
    return {"mla_auto_impl": impl, "mla_auto_reason": why, "prefix_groups": 1}


def make_runner(model: Deepseek):
    """``run(params, kept, suffix, tokens0, n) -> (suffix, last tokens, first-step logits
    [rows, V], all logits finite)``: ``n`` greedy decode steps from the cache
    ``model.join_cache(kept, suffix)`` (the suffix buffers donated)."""
    def run(params, kept, suffix, tokens0, n):
        cache = model.join_cache(kept, suffix)
        rows = min(tokens0.shape[0], 4)

        def body(i, carry):
            cache, tok, head, finite = carry
            logits, cache = model.decode_step(params, cache, tok)
            head = jnp.where(i == 0, logits[:rows], head)   # the first step's inputs are every layout's
            return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), head, finite & jnp.all(jnp.isfinite(logits))

        init = (cache, tokens0, jnp.zeros((rows, model.config.vocab_size), jnp.float32), jnp.bool_(True))
        cache, tok, head, finite = jax.lax.fori_loop(0, n, body, init)
        return model.split_cache(cache)[1], tok, head, finite

    return jax.jit(run, donate_argnames=("suffix",))


def targets(data: dict) -> dict:
    """``roofline_fraction`` of ``shared`` at B >= 256 and P >= 4K (target 0.9), and
    shared / flat throughput where both ran."""
    pts = [p for p in data["points"] if p.get("status") == "ok"]
    lines = []
    big = [p for p in pts if p["backend"] == "shared" and p["batch"] >= TARGET["min_batch"]
           and p["prefix"] >= TARGET["min_prefix"] and p.get("roofline_fraction") is not None]
    res: dict = {"lines": lines}
    if big:
        worst = min(big, key=lambda p: p["roofline_fraction"])
        met = all(p["roofline_fraction"] >= TARGET["roofline_fraction"] for p in big)
        res["shared_roofline"] = {"min": worst["roofline_fraction"], "points": len(big), "met": met}
        lines.append(f"shared / roofline at B>={TARGET['min_batch']}, P>={TARGET['min_prefix']}: min "
                     f"{worst['roofline_fraction']:.2f} (B={worst['batch']}, P={worst['prefix']}) over {len(big)} "
                     f"points (target {TARGET['roofline_fraction']}) -> {'MET' if met else 'NOT MET'}")
    else:
        lines.append("shared / roofline: no measured point at the target's batches and prefixes")
    by = {(p["model"], p["layers"], p["batch"], p["prefix"], p["moe_lowering"], p["backend"]): p for p in pts}
    ratios = {}
    for key, p in by.items():
        flat = by.get(key[:-1] + ("flat",))
        if key[-1] == "shared" and flat and p.get("tokens_per_s") and flat.get("tokens_per_s"):
            ratios[f"B{key[2]}_P{key[3]}_{key[4]}"] = p["tokens_per_s"] / flat["tokens_per_s"]
    res["shared_over_flat"] = ratios
    if ratios:
        lines.append("shared / flat throughput: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, ())
    ap.add_argument("--model", default="deepseek-v2-lite", choices=sorted(MODELS), help="model shapes")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default all 27)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="k, generated tokens per sequence (default 128)")
    ap.add_argument("--reps", type=int, default=2, help="timed k-token calls per point")
    ap.add_argument("--flat-reps", type=int, default=1, help="timed k-token calls per flat point")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="override the batch sizes")
    ap.add_argument("--prefixes", type=int, nargs="+", default=None, help="override the prefix lengths")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new point after this many seconds")
    ap.add_argument("--resume", action="store_true", help="add to an existing --out (kept points are not redone)")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args(argv)
    ec.finish_args(args, dict(layers=PRESETS[MODELS[args.model]].num_hidden_layers, gen_tokens=128),
                   smoke=dict(layers=2, gen_tokens=4))
    if args.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2 (decode-only time is t(k) - t(1))")
    if args.budget_s is not None and args.budget_min is not None:
        ap.error("pass --budget-s or --budget-min, not both")
    args.moe_lowering = "buckets"
    args.out = args.out or ec.default_out_path(NAME, args.smoke)
    args.commit_measured = args.commit or ec.commit_of_checkout()
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if os.path.exists(args.out) and not (args.resume or args.list):
        raise SystemExit(f"{args.out} exists: pass --resume to add this run's points to it, or another --out")
    cfg = model_config(args.model, args.layers, smoke=args.smoke)
    fixed = {"gen_tokens": args.gen_tokens, "smoke": args.smoke, "dtype": "float32" if args.smoke else "bfloat16",
             "model": {args.model: {k: v for k, v in dataclasses.asdict(cfg).items() if k != "num_hidden_layers"}},
             "definition": "tokens_per_s = batch * (k - 1) / (t(k) - t(1)); t(n) = one call of n greedy decode "
                           "steps (Hydragen D.1); prefill excluded",
             "roofline": "per step max(bytes / copy rate, flops / matmul rate) (bench/roofline.py mla_moe_roofline); "
                         "roofline_fraction = roofline_step_ms / step_ms"}

    def after(store, bench, counts):
        store.note("commit", args.commit_measured)
        store.note("xla_flags", os.environ.get("XLA_FLAGS", ""))
        compare_layouts(store.data["points"])
        store.save()
        ec.report_targets(store, targets)

    budget = ec.Budget(None if args.budget_s is None else args.budget_s / 60) if args.budget_min is None else None
    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, budget=budget, after=after)


if __name__ == "__main__":
    main()
