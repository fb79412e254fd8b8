"""One GRPO training step through the Llama: each prompt computed once (``shared``) against every
completion carrying its own copy of its prompt (``flat``); time and peak device memory.

The step is ``jax.jit(jax.value_and_grad(loss))`` with ``loss`` = :func:`models.training.rl.grpo_objective`
(log-probabilities of ``G x N`` completions through :func:`models.training.logprobs.completion_logprobs`,
the clipped GRPO loss against old log-probabilities, token-level mean) -- the optimizer update,
the same for both, is left out.  Columns (``impl``): ``shared`` and ``flat`` with per-layer
rematerialisation (the default), optionally ``shared_noremat`` / ``flat_noremat`` and
``shared_mgpu`` (the shared path with the Mosaic GPU attention backward,
``GRPOConfig(attention_backward="mgpu")``).

Models: Llama-3.2-1B shapes (16 layers, tied 128K vocabulary) and Llama-3.1-8B shapes with
``--layers-8b`` of its 32 layers (default 4, so the flat baseline can fit at all), random bf16
weights, stacked layers (``lax.scan``).  Grid: ``G x N`` in {8 x 16, 4 x 64} x prompt {1K, 4K, 16K}
x completion {256, 1K}, plus the target point 8 x 16, prompt 4K, completion 512.  Every prompt and
completion has its full length.

Per point: compile, XLA's memory analysis of the compiled step (``step_bytes`` = arguments +
outputs + temporaries - aliased: the device memory the step needs; ``peak_bytes`` = the
allocator's peak after the step, which includes earlier points), then the median of ``--iters``
timed steps.  A point whose analysis exceeds the memory limit is recorded ``"oom"`` ("X") with
its ``step_bytes`` and not run; points whose activations alone cannot fit are predicted "X"
without compiling.  Roofline of a point: ``6 x (matmul parameters of the layers) x tokens
processed + 6 x H x V x completion tokens (LM head) + 3.5 x the forward attention flops of the
shared computation`` (prompts causal, completions over their prompt and causally over
themselves; 3.5 = forward + a flash backward), divided by the bf16 matmul rate measured in the
same run; ``tokens processed`` are the shared path's ``G P + G N C`` -- the roofline of the work
itself, so a flat point's ``over_roofline`` includes its repeated prompts.  Rematerialisation
recomputes each layer's forward (not in the roofline).

Targets (printed and noted in the JSON): at prompt 4K, N=16, completion 512, flat / shared time
and step memory (>= 3x each); shared over its roofline at prompt >= 4K (<= 1.5x); the points
where flat does not fit and shared runs.

Usage::

    python bench/train_step.py               # the grid -> bench/results/train_step_<gpu>.json + PNG
    python bench/train_step.py --quick       # Llama-3.2-1B with 8 layers: the target point and
                                             # 4 x 64 x 16K x 256 (~4 min on an H100)
    python bench/train_step.py --smoke       # tiny model and shapes on CPU
    python bench/train_step.py --plot-only   # redraw bench/plots/train_step_<gpu>.png from the JSON

Rerunning a command resumes: finished points are skipped.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run: cheaper XLA:CPU compiles (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench import roofline  # noqa: E402
from bench.timing import gpu_slug, time_fn  # noqa: E402
from models.config import Llama3RopeScaling, LlamaConfig  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.training.rl import GRPOBatch, GRPOConfig, group_advantages, grpo_objective  # noqa: E402
from models.weights import init_params, stack_layers  # noqa: E402

NAME = "train_step"
KEY_FIELDS = ("model", "layers", "groups", "samples", "prompt", "completion", "impl")
IMPLS = ("shared", "flat", "shared_noremat", "flat_noremat", "shared_mgpu")

#: Llama-3.2-1B (values of its config.json).
LLAMA32_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling=Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192),
                         bos_token_id=128000, eos_token_ids=(128001,))
MODELS = {"llama3.2-1b": ("Llama-3.2-1B (tied embeddings, 8 KV heads of 64)", LLAMA32_1B),
          "llama3.1-8b": ("Llama-3.1-8B (8 KV heads of 128)", LlamaConfig.preset("Llama-3.1-8B"))}
GRID_GN = ((8, 16), (4, 64))
GRID_PROMPT = (1024, 4096, 16384)
GRID_COMPLETION = (256, 1024)
TARGET = {"groups": 8, "samples": 16, "prompt": 4096, "completion": 512}
TARGET_SPEEDUP, TARGET_MEMORY, TARGET_ROOFLINE = 3.0, 3.0, 1.5


def model_config(name: str, layers: int, smoke: bool) -> LlamaConfig:
    if smoke:
        return ec.smoke_config(mha=False, layers=layers)
    return MODELS[name][1].replace(num_hidden_layers=layers)


def step_flops(cfg: LlamaConfig, g: int, n: int, p: int, c: int) -> dict:
    """The roofline's flops of one step (module docstring)."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layer_params = h * d * (2 * hq + 2 * hkv) + 3 * h * cfg.intermediate_size
    tokens = g * p + g * n * c
    linear = 6.0 * cfg.num_hidden_layers * layer_params * tokens
    head = 6.0 * h * cfg.vocab_size * g * n * c
    attn_fwd = cfg.num_hidden_layers * (2.0 * g * hq * d * p * p + 4.0 * g * n * hq * d * c * (p + c / 2))
    return {"tokens": tokens, "flops_linear": linear, "flops_head": head, "flops_attention": 3.5 * attn_fwd,
            "flops": linear + head + 3.5 * attn_fwd}


class Bench:
    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.loaded: tuple | None = None
        self.rates: dict | None = None

    def layers(self, model: str) -> int:
        return self.args.layers_8b if model == "llama3.1-8b" else self.args.layers_1b

    def params(self, model: str):
        if self.loaded is None or self.loaded[0] != model:
            self.loaded = None
            ec.free_memory()
            cfg = model_config(model, self.layers(model), self.args.smoke)
            if self.args.smoke:
                params = stack_layers(ec.random_params(cfg, seed=0, dtype=self.dtype, host=True))
            else:
                params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.PRNGKey(0), self.dtype)
            self.loaded = (model, cfg, jax.block_until_ready(params))
        return self.loaded[1], self.loaded[2]

    def activation_bytes(self, point: dict) -> int:
        """A lower bound of the step's memory: parameters and gradients, one saved ``[tokens, H]``
        layer input per layer and one ``[tokens, F]`` MLP activation."""
        cfg = model_config(point["model"], point["layers"], self.args.smoke)
        g, n, p, c = (point[k] for k in ("groups", "samples", "prompt", "completion"))
        tokens = g * p + g * n * c if point["impl"].startswith("shared") else g * n * (p + c)
        isz = jnp.dtype(self.dtype).itemsize
        per_token = cfg.hidden_size * cfg.num_hidden_layers + cfg.intermediate_size
        return 2 * ec.param_bytes(cfg, isz) + tokens * per_token * isz

    def predict_oom(self, point: dict) -> str | None:
        return ec.oom_reason(self.activation_bytes(point), self.args.mem_limit, "activations lower bound")

    def batch(self, cfg: LlamaConfig, point: dict) -> GRPOBatch:
        g, n, p, c = (point[k] for k in ("groups", "samples", "prompt", "completion"))
        rng = np.random.default_rng(0)
        return GRPOBatch(prompt_tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (g, p)), jnp.int32),
                         prompt_lengths=jnp.full((g,), p, jnp.int32),
                         completion_tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (g, n, c)), jnp.int32),
                         completion_lengths=jnp.full((g, n), c, jnp.int32),
                         advantages=group_advantages(rng.standard_normal((g, n))),
                         old_logprobs=jnp.asarray(-np.log(cfg.vocab_size) + rng.uniform(-0.1, 0.1, (g, n, c)),
                                                  jnp.float32))   # near a random model's: ratios near 1

    def measure(self, point: dict) -> dict:
        a = self.args
        if self.rates is None:
            self.rates = roofline.measure_rates(a.smoke)
        cfg, params = self.params(point["model"])
        impl = point["impl"]
        config = GRPOConfig(impl=impl.split("_")[0], remat=not impl.endswith("noremat"),
                            attention_backward="mgpu" if impl.endswith("mgpu") else "kernels")
        model = Llama(cfg)
        batch = self.batch(cfg, point)
        step = jax.jit(jax.value_and_grad(lambda q, b: grpo_objective(model, q, b, config)[0]))
        t0 = time.perf_counter()
        compiled = step.lower(params, batch).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        parts = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
        step_bytes = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
        out = {"compile_s": round(compile_s, 2), "step_bytes": step_bytes, "memory_analysis": parts}
        if a.mem_limit is not None and step_bytes > a.mem_limit:
            raise MemoryError(f"XLA memory analysis: the step needs {step_bytes / 2**30:.1f} GiB, limit "
                              f"{a.mem_limit / 2**30:.1f} GiB {json.dumps(out)}")
        loss, grads = jax.block_until_ready(compiled(params, batch))
        leaves = jax.tree_util.tree_leaves(grads)
        finite = bool(np.isfinite(float(loss))) and all(bool(jnp.isfinite(x).all()) for x in leaves)
        del leaves, grads
        t = time_fn(compiled, [(params, batch)], warmup=a.warmup, iters=a.iters)
        fl = step_flops(cfg, point["groups"], point["samples"], point["prompt"], point["completion"])
        roof_ms = 1e3 * fl["flops"] / self.rates["matmul_flops"]
        stats = jax.devices()[0].memory_stats() or {}
        return {**out, **fl, **self.rates, "step_ms": 1e3 * t, "loss": float(loss), "finite": finite,
                "roofline_ms": roof_ms, "over_roofline": 1e3 * t / roof_ms,
                "achieved_tflops": fl["flops"] / t / 1e12, "peak_bytes": stats.get("peak_bytes_in_use")}


def plan_points(args) -> list[dict]:
    models = ["llama3.2-1b"] if args.smoke else list(args.models)
    shapes = [dict(TARGET)] + [{"groups": g, "samples": n, "prompt": p, "completion": c}
                               for g, n in GRID_GN for p in args.prompts for c in args.completions]
    if args.quick:
        shapes = [dict(TARGET), {"groups": 4, "samples": 64, "prompt": 16384, "completion": 256}]
    if args.smoke:
        shapes = [{"groups": 2, "samples": 3, "prompt": p, "completion": 8} for p in (16, 32)]
    seen, plan = set(), []
    for m in models:
        layers = args.layers_8b if m == "llama3.1-8b" else args.layers_1b
        for s in shapes:
            for impl in args.impls:
                pt = {"model": m, "layers": layers, **s, "impl": impl}
                key = json.dumps(pt, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    plan.append(pt)
    return plan


def _ok(p: dict) -> bool:
    return p.get("status") == "ok" and isinstance(p.get("step_ms"), float)


def add_oom_analysis(points: list[dict]) -> None:
    """Out-of-memory points stopped by the memory analysis carry it in their message (the JSON
    after the limit): copy ``step_bytes`` and ``memory_analysis`` into the point."""
    for p in points:
        msg = p.get("oom") or ""
        if p.get("status") == "oom" and "step_bytes" not in p and "{" in msg:
            try:
                p.update({k: v for k, v in json.loads(msg[msg.index("{"):]).items()
                          if k in ("step_bytes", "memory_analysis", "compile_s")})
            except ValueError:
                pass


def targets(data: dict) -> dict:
    """The three targets from the stored points (module docstring)."""
    pts = data["points"]
    index = {tuple(p.get(k) for k in KEY_FIELDS): p for p in pts}
    lines, out = [], {"target_point": [], "roofline": [], "flat_oom_shared_ok": []}
    for p in pts:
        if p["impl"] != "shared":
            continue
        flat = index.get(tuple(p.get(k) for k in KEY_FIELDS[:-1]) + ("flat",))
        label = f"{p['model']} L={p['layers']} G={p['groups']} N={p['samples']} P={p['prompt']} C={p['completion']}"
        if all(p[k] == v for k, v in TARGET.items()) and _ok(p) and flat is not None:
            rec = {"point": label, "shared_ms": p["step_ms"], "flat_ms": flat.get("step_ms", "X"),
                   "speedup": flat["step_ms"] / p["step_ms"] if _ok(flat) else None,
                   "memory_ratio": flat["step_bytes"] / p["step_bytes"] if flat.get("step_bytes") else None}
            out["target_point"].append(rec)
            sp = "X (flat out of memory)" if rec["speedup"] is None else f"{rec['speedup']:.2f}x"
            mr = "n/a" if rec["memory_ratio"] is None else f"{rec['memory_ratio']:.2f}x"
            lines.append(f"target {label}: flat/shared time {sp} (>= {TARGET_SPEEDUP}), step memory {mr} "
                         f"(>= {TARGET_MEMORY})")
        if _ok(p) and p["prompt"] >= 4096:
            out["roofline"].append({"point": label, "over_roofline": p["over_roofline"]})
        if _ok(p) and flat is not None and flat.get("status") == "oom":
            out["flat_oom_shared_ok"].append(label)
    if out["roofline"]:
        worst = max(r["over_roofline"] for r in out["roofline"])
        lines.append(f"shared over roofline at prompt >= 4K: worst {worst:.2f}x, best "
                     f"{min(r['over_roofline'] for r in out['roofline']):.2f}x (target <= {TARGET_ROOFLINE})")
    lines.append(f"flat out of memory, shared ran: {len(out['flat_oom_shared_ok'])} points")
    out["lines"] = lines
    return out


def plot(data: dict, path: str) -> str | None:
    """Bars of step time and step memory per point, shared vs flat ("X" where flat does not fit)."""
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    pts = [p for p in data["points"] if p["impl"] in ("shared", "flat")]
    labels = sorted({(p["model"], p["groups"], p["samples"], p["prompt"], p["completion"]) for p in pts})
    if not labels:
        return None
    index = {(p["model"], p["groups"], p["samples"], p["prompt"], p["completion"], p["impl"]): p for p in pts}
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(labels)), 8), sharex=True)
    x = np.arange(len(labels))
    for ax, field, scale, unit in ((axes[0], "step_ms", 1.0, "step time (ms)"),
                                   (axes[1], "step_bytes", 2.0 ** -30, "step memory (GiB)")):
        for off, impl, color in ((-0.2, "shared", "tab:blue"), (0.2, "flat", "tab:red")):
            vals = []
            for i, lab in enumerate(labels):
                p = index.get(lab + (impl,), {})
                v = p.get(field) if (field == "step_bytes" or _ok(p)) else None
                vals.append(v * scale if isinstance(v, (int, float)) else 0.0)
                if p.get("status") == "oom" and field == "step_ms":
                    ax.text(i + off, 0.02, "X", ha="center", va="bottom", color=color, fontweight="bold",
                            transform=ax.get_xaxis_transform())
            ax.bar(x + off, vals, 0.4, color=color, label=impl)
        ax.set_ylabel(unit)
        ax.set_yscale("log")
        ax.legend()
    size = lambda t: f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)  # noqa: E731
    axes[1].set_xticks(x, [f"{m.split('-')[-1]}\n{g}x{n}\nP{size(p)} C{size(c)}" for m, g, n, p, c in labels],
                       fontsize=7)
    axes[0].set_title(f"GRPO train step (value_and_grad), {data['device_info']['device']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, ())
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layers-1b", type=int, default=None, help="Llama-3.2-1B layers (default all 16; quick 8)")
    ap.add_argument("--layers-8b", type=int, default=None, help="Llama-3.1-8B layers (default 4 of 32)")
    ap.add_argument("--prompts", type=int, nargs="*", default=list(GRID_PROMPT))
    ap.add_argument("--completions", type=int, nargs="*", default=list(GRID_COMPLETION))
    ap.add_argument("--impls", nargs="*", default=["shared", "flat"], choices=IMPLS)
    ap.add_argument("--iters", type=int, default=None, help="timed steps per point (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 1)")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot of --out and print the targets")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models = ["llama3.2-1b"]
    ec.finish_args(args, dict(layers_1b=8 if args.quick else 16, layers_8b=4, iters=3 if args.quick else 5, warmup=1),
                   smoke=dict(layers_1b=2, layers_8b=1, iters=2, warmup=1))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = args.out or ec.default_out_path(NAME, args.smoke)
    png = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(out))) if not args.smoke
                       else os.path.dirname(out), "plots", f"{NAME}_{gpu_slug()}.png")
    if args.plot_only:
        with open(out) as f:
            data = json.load(f)
        add_oom_analysis(data["points"])
        for line in targets(data)["lines"]:
            print(line)
        return {"out": out, "plot": plot(data, png)}
    fixed = {"smoke": args.smoke, "dtype": "float32" if args.smoke else "bfloat16", "layout": "stacked",
             "models": {m: MODELS[m][0] for m in MODELS},
             "definition": "step = jit(value_and_grad(GRPO loss)) over G x N completions; step_bytes from XLA's "
                           "memory analysis; roofline = 6 x layer params x (G P + G N C) + 6 H V G N C + 3.5 x "
                           "attention forward flops, at the measured bf16 matmul rate"}

    def after(store, bench, counts):
        store.note("commit", args.commit or ec.commit_of_checkout())
        add_oom_analysis(store.data["points"])
        store.save()
        ec.report_targets(store, targets)
        path = plot(store.data, png)
        if path:
            print("plot:", path)
    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, after=after)


if __name__ == "__main__":
    main()
