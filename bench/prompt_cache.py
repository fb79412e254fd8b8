"""Time to first token (TTFT) of Prompt Cache inference against an ordinary prefill of the same prompt.

Each point is a schema of ``modules`` modules totalling ``cached`` tokens and ``batch`` prompts
that import all of them, each followed by ``new`` new tokens of its own (random token ids).

* ``prefill``: :func:`models.prompt_cache.prefill_generate` -- an ordinary causal prefill of the
  ``cached + new`` tokens of every prompt;
* ``cached_device``: :func:`models.prompt_cache.cached_generate` with the module K/V in device
  memory (the modules stored once for the whole batch, the ``new`` tokens prefilled against them);
* ``cached_host``: the same with the K/V as NumPy arrays in host memory: the rows the prompts
  import cross to the device (PCIe on a GPU) inside the timed call.

TTFT is the call's ``ttft_s`` (``max_new_tokens=1``): from the call to the first sampled token
on the host, planning, gathers, transfers and the prefill included.  Every path runs once
untimed (compilation) and then ``--reps`` (>= 3) times; median and min are recorded.

Each point also records the arithmetic floor of each path (``floor_ms``, see
``bench/prompt_cache_floors.py``: FLOPs / matmul rate, weight and K/V bytes / copy bandwidth,
K/V bytes / host-to-device bandwidth) from rates measured in the same run (``rates``).  Memory per
cached token: ``kv_bytes_per_token`` (``2 L Hkv D itemsize``), ``stored_bytes_per_token`` (the
:class:`~models.prompt_cache.EncodedSchema`: packed K/V plus position, id and keep arrays) and,
for small points, ``file_bytes_per_token`` (its safetensors file).

Parts (``--part``):

* ``llama8b`` (the default on a GPU): Llama-3.1-8B shapes (``--layers``, default 32) with random
  bf16 weights drawn on the device, module K/V drawn at random (``--kv random``: the values do
  not change the timed work; ``--kv encode`` encodes the modules with the model);
  ``cached`` in 1K..16K, ``new`` in 32..512, both tiers, batch 1 and one batched point;
* ``smollm2`` (the default elsewhere): the built-in SmolLM2-135M (float32 on the CPU), modules
  encoded with the model, ``cached`` in 512..4K, ``new`` 32 and 64, device tier;
* ``--smoke``: a tiny random model on the CPU (both tiers), for CI.

Targets (reported, not asserted): ``llama8b`` at 8K cached / 64 new / batch 1: prefill TTFT over
cached TTFT >= 10 (device tier) and >= 2 (host tier); ``smollm2`` at 2K cached: >= 20.

Usage::

    python bench/prompt_cache.py --quick            # the target point only
    python bench/prompt_cache.py                    # -> bench/results/prompt_cache_<gpu>.json + .png
                                                    #    (stops starting points after 3 minutes; rerun
                                                    #    to resume, or pass --budget-min)
    python bench/prompt_cache.py --part smollm2     # -> bench/results/prompt_cache_cpu.json on a CPU
    python bench/prompt_cache.py --smoke --out /tmp/pc.json
    python bench/prompt_cache.py --plot-only
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench.prompt_cache_floors import floors, measure_rates  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.prompt_cache import (CacheIdentity, EncodedSchema, cached_generate,  # noqa: E402
                                 encode_schema, layout_prompt, layout_schema, module, parse_prompt,
                                 prefill_generate, schema)
from models.prompt_cache.encode import schema_rows  # noqa: E402
from models.prompt_cache.store import encoded_nbytes, kv_bytes_per_token, save_encoded  # noqa: E402

NAME = "prompt_cache"
KEY_FIELDS = ("model", "layers", "cached", "new", "batch", "modules")
PATHS = ("prefill", "cached_device", "cached_host")
PART_MODELS = {"llama8b": "llama3.1-8b", "smollm2": "smollm2-135m"}
SMOKE_MODEL = "smoke"
# (cached, new, batch) in run order: the target point first, so a budget cut keeps it
GRIDS = {
    "llama8b": {"quick": [(8192, 64, 1)],
                "default": [(8192, 64, 1), (1024, 64, 1), (16384, 64, 1), (4096, 64, 1), (2048, 64, 1),
                            (8192, 512, 1), (8192, 32, 1), (8192, 128, 1), (4096, 64, 8)],
                "cached": (1024, 2048, 4096, 8192, 16384), "new": (32, 64, 128, 512), "batch": (1, 8)},
    "smollm2": {"quick": [(2048, 64, 1)],
                "default": [(2048, 64, 1), (512, 64, 1), (1024, 64, 1), (4096, 64, 1), (2048, 32, 1)],
                "cached": (512, 1024, 2048, 4096), "new": (32, 64), "batch": (1,)},
    SMOKE_MODEL: {"quick": [(48, 8, 1)], "default": [(48, 8, 1), (96, 8, 1), (48, 8, 2)],
                  "cached": (48, 96), "new": (8,), "batch": (1, 2)},
}
TARGETS = {"llama8b": {"cached": 8192, "new": 64, "batch": 1, "cached_device": 10.0, "cached_host": 2.0},
           "smollm2": {"cached": 2048, "new": 64, "batch": 1, "cached_device": 20.0}}
FILE_BYTES_MAX_TOKENS = 1024   # points up to this many cached tokens also write the safetensors file
# llama8b's --budget-min default: each point compiles two 32-layer programs (prefill, cached), so
# a run of about 4 minutes measures the first points of the grid; rerun the command to resume
LLAMA_BUDGET_MIN = 3.0


class IdTokenizer:
    """Text of space-separated integers -> those token ids (the benchmark's prompts are random ids)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) for w in text.split()]


def smoke_config() -> LlamaConfig:
    return ec.smoke_config(mha=False, layers=2)


def plan_points(args) -> list[dict]:
    """Points in run order: per part, the grid (``--quick``, default, ``--full`` or the
    ``--cached`` x ``--new`` x ``--batch`` product)."""
    plan = []
    for part in args.parts:
        grid = GRIDS[part]
        if args.cached or args.new or args.batch:
            shapes = [(c, n, b) for c in args.cached or grid["cached"] for n in args.new or (64,)
                      for b in args.batch or (1,)]
        elif args.full:
            shapes = [(c, n, 1) for c in grid["cached"] for n in grid["new"]]
            shapes += [(c, n, b) for c, n, b in grid["default"] if b > 1]
        else:
            shapes = grid["quick" if args.quick else "default"]
        layers = args.layers if part == "llama8b" else None
        plan += [{"part": part, "model": PART_MODELS.get(part, SMOKE_MODEL), "layers": layers, "cached": c,
                  "new": n, "batch": b, "modules": min(args.modules, c)} for c, n, b in shapes]
    return plan


def module_sizes(cached: int, modules: int) -> list[int]:
    """``modules`` sizes summing to ``cached`` (the first ones one token longer)."""
    q, r = divmod(cached, modules)
    return [q + (i < r) for i in range(modules)]


# ------------------------------------------------------------------ one point
def bench_schema(sizes: list[int], vocab: int, rng: np.random.Generator):
    """A schema of modules ``m0..`` of random ids (``sizes`` tokens each) and its layout."""
    text = lambda n: " ".join(map(str, rng.integers(3, vocab, n)))  # noqa: E731
    s = schema("bench", *(module(f"m{i}", text(n)) for i, n in enumerate(sizes)))
    return s, layout_schema(s, IdTokenizer(), placeholder_id=0)


def random_encoded(lay, cfg: LlamaConfig, dtype, seed: int) -> EncodedSchema:
    """An `EncodedSchema` of the layout's modules with random K/V drawn on the device."""
    rows = schema_rows(lay)
    n = sum(len(r.token_ids) for r in rows)
    shape = (cfg.num_hidden_layers, n, cfg.num_key_value_heads, cfg.head_dim)
    draw = jax.jit(lambda key: jax.random.normal(key, shape, dtype))
    cat = lambda a: np.concatenate([getattr(r, a) for r in rows])  # noqa: E731
    offsets = np.cumsum([0] + [len(r.token_ids) for r in rows]).astype(np.int64)
    return EncodedSchema(lay.name, tuple(r.name for r in rows), draw(jax.random.PRNGKey(seed)),
                         draw(jax.random.PRNGKey(seed + 1)), cat("positions").astype(np.int32),
                         cat("token_ids").astype(np.int32), cat("keep"), offsets)


def stats_ms(times_s: list[float]) -> dict:
    ms = [1e3 * t for t in times_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "reps_ms": ms}


class Bench:
    """The current model, its parameters and the device rates."""

    def __init__(self, args):
        self.args = args
        self.loaded = None
        self.rates = None
        self.gpu = jax.devices()[0].platform == "gpu"

    def setup(self, point):
        key = (point["model"], point["layers"])
        if self.loaded == key:
            return
        self.params = None
        ec.free_memory()
        t0 = time.perf_counter()
        if point["model"] == "smollm2-135m":
            from models.checkpoint import load_checkpoint  # noqa: PLC0415
            cfg, self.params, _, _ = load_checkpoint(None, "float32")
        elif point["model"] == SMOKE_MODEL:
            cfg = smoke_config()
            self.params = ec.random_params(cfg, seed=0, dtype=jnp.float32, host=True)
        else:
            cfg = LlamaConfig.preset("Llama-3.1-8B").replace(num_hidden_layers=point["layers"])
            self.params = ec.random_params(cfg, seed=0, dtype=jnp.bfloat16)
        self.model = Llama(cfg)
        self.loaded = key
        if self.rates is None:
            self.rates = measure_rates(self.params["embed"].dtype, gpu=self.gpu, smoke=self.args.smoke)
            print("rates:", json.dumps(self.rates), flush=True)
        print(f"model {key}: {cfg.num_params() / 1e9:.3f}B params, loaded in {time.perf_counter() - t0:.1f}s",
              flush=True)

    def predict_oom(self, point) -> str | None:
        return None

    def tiers(self, point) -> tuple[str, ...]:
        """Both tiers on a GPU and in smoke runs; the device tier alone on a CPU (host = device)."""
        return ("cached_device", "cached_host") if self.gpu or self.args.smoke else ("cached_device",)

    def encoded(self, point, lay) -> tuple[EncodedSchema, str, float | None]:
        """``(encoded, "random" | "encode", seconds the encoding took (compile included) or None)``."""
        cfg, dtype = self.model.config, self.params["embed"].dtype
        if self.args.kv == "random" and point["model"] == "llama3.1-8b":
            return random_encoded(lay, cfg, dtype, seed=point["cached"]), "random", None
        t0 = time.perf_counter()
        enc = encode_schema(self.model, self.params, lay, pad_multiple=128)
        jax.block_until_ready(enc.k)
        return enc, "encode", time.perf_counter() - t0

    def measure(self, point) -> dict:
        self.setup(point)
        cfg, params, model, args = self.model.config, self.params, self.model, self.args
        rng = np.random.default_rng(point["cached"] * 1009 + point["new"] * 31 + point["batch"])
        s, lay = bench_schema(module_sizes(point["cached"], point["modules"]), cfg.vocab_size, rng)
        enc, kv_source, encode_s = self.encoded(point, lay)
        imports = "".join(f"<m{i}/>" for i in range(point["modules"]))
        prompts = [layout_prompt(parse_prompt(f'<prompt schema="bench">{imports} '
                                              f'{" ".join(map(str, rng.integers(3, cfg.vocab_size, point["new"])))}'
                                              f'</prompt>', s), s, lay, IdTokenizer())
                   for _ in range(point["batch"])]
        inputs = {"prefill": enc, "cached_device": enc}
        if "cached_host" in self.tiers(point):
            inputs["cached_host"] = dataclasses.replace(enc, k=np.asarray(enc.k), v=np.asarray(enc.v))
        kw = dict(max_new_tokens=1, eos_token_ids=())

        def call(path):
            fn = prefill_generate if path == "prefill" else cached_generate
            return fn(model, params, inputs[path], prompts, **kw)

        first, compile_s = {}, {}
        for path in inputs:
            t0 = time.perf_counter()
            first[path] = call(path).tokens[:, 0]
            compile_s[path] = time.perf_counter() - t0
        ttft = {path: [] for path in inputs}
        for _ in range(args.reps):
            for path in inputs:
                ttft[path].append(call(path).ttft_s)
        rec = {path: stats_ms(ttft[path]) for path in inputs}
        rec["compile_and_first_call_s"] = compile_s
        for path in inputs:
            if path != "prefill":
                rec[f"speedup_{path}"] = rec["prefill"]["median_ms"] / rec[path]["median_ms"]
        fl = floors(cfg, params, point, self.rates)
        rec["floor_ms"] = {p: (1e3 * fl[p] if fl[p] is not None else None) for p in PATHS}
        rec["kv_bytes"], rec["weight_bytes"] = fl["kv_bytes"], fl["weight_bytes"]
        rec["rates"] = self.rates
        rec["kv_source"], rec["encode_s"] = kv_source, encode_s
        rec["cached_tokens"], rec["prefill_tokens_per_prompt"] = enc.tokens, point["cached"] + point["new"]
        rec["kv_bytes_per_token"] = kv_bytes_per_token(cfg, params["embed"].dtype)
        rec["stored_bytes_per_token"] = encoded_nbytes(enc) / enc.tokens
        if point["cached"] <= FILE_BYTES_MAX_TOKENS:
            with tempfile.TemporaryDirectory() as d:
                size = save_encoded(os.path.join(d, "bench.safetensors"), enc,
                                    CacheIdentity("bench", np.dtype(params["embed"].dtype).name, "ids"), "bench")
            rec["file_bytes_per_token"] = size / enc.tokens
        # the same first token on both paths (informative: modules encoded independently differ
        # from one prefill of their concatenation; random K/V are not the model's)
        rec["first_token_equal_fraction"] = {
            p: float(np.mean(first[p] == first["prefill"])) for p in inputs if p != "prefill"}
        rec["tiers"] = [p for p in inputs if p != "prefill"]
        del inputs, enc
        return rec


# ------------------------------------------------------------------ targets and plot
def targets(data: dict) -> dict:
    """Speedups of every point and the target checks (module docstring)."""
    ok = [p for p in data["points"] if p.get("status") == "ok"]
    lines, checks = [], []
    for p in ok:
        sp = ", ".join(f"{t.split('_')[1]} {p[f'speedup_{t}']:.1f}x" for t in p.get("tiers", ()))
        lines.append(f"{p['model']} cached={p['cached']} new={p['new']} B={p['batch']}: prefill "
                     f"{p['prefill']['median_ms']:.1f} ms, " +
                     ", ".join(f"{t} {p[t]['median_ms']:.2f} ms" for t in p.get("tiers", ())) + f" ({sp})")
    for part, want in TARGETS.items():
        at = [p for p in ok if p.get("part") == part and all(p[k] == want[k] for k in ("cached", "new", "batch"))]
        for p in at:
            for tier in ("cached_device", "cached_host"):
                if tier in want and f"speedup_{tier}" in p:
                    got = p[f"speedup_{tier}"]
                    checks.append({"part": part, "tier": tier, "cached": p["cached"], "new": p["new"],
                                   "speedup": got, "target": want[tier], "met": got >= want[tier]})
                    lines.append(f"target {part} {tier} at {p['cached']} cached / {p['new']} new: {got:.1f}x "
                                 f"(target {want[tier]:.0f}x) {'met' if got >= want[tier] else 'NOT met'}")
    return {"checks": checks, "lines": lines}


def plot(path: str) -> str:
    """TTFT vs cached tokens (batch 1, the most common new-token count) per model, both paths and
    tiers, floors dotted; next to the result JSON."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    with open(path) as f:
        data = json.load(f)
    ok = [p for p in data["points"] if p.get("status") == "ok" and p["batch"] == 1]
    models = sorted({p["model"] for p in ok})
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.2 * max(len(models), 1), 4.0), squeeze=False)
    for ax, name in zip(axes[0], models):
        pts = [p for p in ok if p["model"] == name]
        new = statistics.mode([p["new"] for p in pts])
        pts = sorted((p for p in pts if p["new"] == new), key=lambda p: p["cached"])
        x = [p["cached"] for p in pts]
        for kind, color in zip(PATHS, ("tab:red", "tab:blue", "tab:green")):
            have = [p for p in pts if kind in p]
            if not have:
                continue
            ax.plot([p["cached"] for p in have], [p[kind]["median_ms"] for p in have], "o-", color=color,
                    label=kind.replace("_", " "))
            fl = [(p["cached"], p["floor_ms"][kind]) for p in have if p["floor_ms"].get(kind)]
            if fl:
                ax.plot(*zip(*fl), ":", color=color, alpha=0.7, label=f"{kind.replace('_', ' ')} floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{c // 1024}K" if c >= 1024 else str(c) for c in x])
        ax.set_xlabel("cached tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"{name}, {new} new tokens, batch 1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Prompt Cache TTFT, {data['device_info']['device']}" +
                 (" (smoke run, not a measurement)" if data["fixed"].get("smoke") else ""))
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, tuple(PART_MODELS))
    ap.add_argument("--full", action="store_true", help="every cached x new length of the part (batch 1)")
    ap.add_argument("--cached", type=int, nargs="*", default=None, help="cached tokens (grid instead of the default)")
    ap.add_argument("--new", type=int, nargs="*", default=None, help="new tokens per prompt (default grid: 64)")
    ap.add_argument("--batch", type=int, nargs="*", default=None, help="prompts per call (default grid: 1)")
    ap.add_argument("--modules", type=int, default=None, help="modules the cached tokens are split into (4)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the Llama-3.1-8B shapes (32)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per path and point (>= 3)")
    ap.add_argument("--kv", choices=("random", "encode"), default="random",
                    help="llama8b module K/V: drawn at random (default) or encoded with the model")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    ap.add_argument("--plot-only", action="store_true", help="only draw the plot of the result file")
    args = ap.parse_args(argv)
    ec.finish_args(args, dict(layers=32, modules=4), smoke=dict(modules=2))
    if args.reps < 3:
        ap.error("--reps must be >= 3")
    if args.smoke:
        args.parts = [SMOKE_MODEL]
    elif args.part == "all":
        args.parts = ["llama8b" if jax.devices()[0].platform == "gpu" else "smollm2"]
    else:
        args.parts = [args.part]
    if args.budget_min is None and "llama8b" in args.parts:
        args.budget_min = LLAMA_BUDGET_MIN
    if args.out is None:
        args.out = ec.default_out_path(NAME, args.smoke)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot_only:
        return {"plot": plot(args.out)}
    fixed = {"smoke": args.smoke, "kv": args.kv, "max_new_tokens": 1,
             "definition": "TTFT = ttft_s of prefill_generate / cached_generate (max_new_tokens=1): call to first "
                           "sampled token on the host; median and min of --reps warm calls after one untimed call"}

    def after(store, bench, counts):
        store.note("commit", args.commit or ec.commit_of_checkout())
        store.note("rates", bench.rates)
        ec.report_targets(store, targets)
        store.note("plot", os.path.basename(plot(store.path)))
        print("plot:", os.path.splitext(store.path)[0] + ".png")

    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, after=after)


if __name__ == "__main__":
    main()
