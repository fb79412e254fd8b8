"""Shared pieces of the end-to-end benchmarks (``e2e_decode``, ``long_document``, ``two_level``).

* :class:`ResultStore` -- the result JSON of one benchmark on one device: header (device, jax
  version, settings of every invocation) and a list of points; each finished point is appended
  and the file rewritten atomically, so a run cut off keeps what it finished and a rerun skips
  the points already present (resumable).
* :func:`is_oom` -- whether an exception is XLA's out-of-memory error (points recorded as "X").
* :func:`free_memory` -- drop garbage so the next point starts from a clean allocator.
* :func:`smoke_config` / :func:`model_config` -- the model shapes the benchmarks use (random
  bf16 weights; ``--layers`` keeps the first ``N`` layers of the preset's shape).
* :func:`random_params` -- random bf16 parameters in the unrolled (list) layer layout, the
  decoder's fast GPU path (see ``bench/decode_step.py``).
* :func:`deepseek_smoke_config`, :func:`deepseek_param_shapes`, :func:`deepseek_random_params`,
  :func:`deepseek_param_bytes` -- the same for DeepSeek (MLA + MoE) shapes
  (``e2e_decode_mla``): random weights drawn on the device leaf by leaf.
* :func:`measure_plan` -- one script's run: open its store, measure its planned points (or
  list them with ``--list``).
* :func:`finish_args` -- smoke and full defaults of unset arguments, the memory limit.
* :func:`add_common_args` -- ``--out``, ``--smoke``, ``--quick``, ``--part``, ``--budget-min``,
  ``--mem-limit-gb``, ``--force``.
* :func:`commit_of_checkout` -- the measured commit (``+dirty`` with uncommitted changes).
"""
from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import device_info, gpu_slug, is_oom  # noqa: F401 (is_oom re-exported)
from models.config import LlamaConfig
from models.deepseek import DeepseekConfig
from models.deepseek.config import PRESETS as DEEPSEEK_PRESETS
from models.deepseek.weights import hf_param_shapes
from models.weights import init_params, unstack_layers

__all__ = ["ResultStore", "add_common_args", "default_out_path", "finish_args", "free_memory", "is_oom", "measure_plan",
           "memory_limit_bytes", "oom_reason", "model_config", "random_params", "smoke_config", "Budget",
           "deepseek_param_bytes", "deepseek_param_shapes", "deepseek_random_params", "deepseek_smoke_config"]

SCHEMA_VERSION = 1

#: Yi-6B-200K (Hydragen 4.3's long-document model) -- a Llama architecture with 4 KV heads.
YI_6B_200K = LlamaConfig(vocab_size=64000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=5e6,
                         max_position_embeddings=200000, bos_token_id=1, eos_token_ids=(2,))

#: Model shapes by short name: name -> (preset description, config).
MODELS: dict[str, tuple[str, LlamaConfig]] = {
    "codellama-7b": ("CodeLlama-7B (multi-head, 32 KV heads)", LlamaConfig.preset("CodeLlama-7B")),
    "llama3.1-8b": ("Llama-3.1-8B (grouped-query, 8 KV heads)", LlamaConfig.preset("Llama-3.1-8B")),
    "yi-6b-200k": ("Yi-6B-200K (grouped-query, 4 KV heads)", YI_6B_200K),
}


def model_config(name: str, layers: int | None, *, smoke: bool = False) -> LlamaConfig:
    """Config of model ``name`` with ``layers`` layers (None: the preset's depth).

    ``smoke``: a tiny model with the same attention kind (MHA stays MHA, GQA stays GQA) for CPU runs.
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    cfg = MODELS[name][1]
    if smoke:
        return smoke_config(mha=cfg.num_key_value_heads == cfg.num_attention_heads, layers=layers or 2)
    return cfg.replace(num_hidden_layers=layers or cfg.num_hidden_layers)


def smoke_config(*, mha: bool, layers: int = 2) -> LlamaConfig:
    """Tiny random model for CPU smoke runs (vocab 256, hidden 64, 4 query heads of 16)."""
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=4 if mha else 2, head_dim=16,
                       max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,))


def random_params(cfg: LlamaConfig, seed: int, dtype=jnp.bfloat16, *, host: bool = False) -> dict:
    """Random parameters with the layout of ``models.weights.init_params``, as a layer list.

    ``host``: draw the values with numpy (for CPU smoke runs: compiling the random-number program
    takes XLA:CPU ~10 s); otherwise one jitted ``init_params`` (dozens of eager ops would each
    compile on their own).
    """
    if host:
        shapes = jax.eval_shape(lambda k: init_params(cfg, k, dtype), jax.random.PRNGKey(seed))
        rng = np.random.default_rng(seed)

        def fill(path, leaf):
            name = str(getattr(path[-1], "key", path[-1]))
            x = rng.standard_normal(leaf.shape, np.float32)
            x = 1 + 0.1 * x if name.endswith("norm") else x if name == "embed" else 0.02 * x
            return jnp.asarray(x, leaf.dtype)

        stacked = jax.tree_util.tree_map_with_path(fill, shapes)
    else:
        stacked = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.PRNGKey(seed), dtype)
    params = jax.jit(unstack_layers)(stacked)
    del stacked
    return jax.block_until_ready(params)


def param_bytes(cfg: LlamaConfig, itemsize: int = 2) -> int:
    return cfg.num_params() * itemsize


def kv_bytes_per_token(cfg: LlamaConfig, itemsize: int = 2) -> int:
    """Bytes of keys + values of one token over all layers."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def deepseek_smoke_config(layers: int) -> DeepseekConfig:
    """A tiny DeepSeek-V2-shaped model for CPU runs: 2 heads, R=32, Dr=8, 8 experts (2 per token,
    1 shared), layer 0 dense."""
    return DEEPSEEK_PRESETS["DeepSeek-V2-Lite"].replace(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=2,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=4096)


def deepseek_param_shapes(cfg: DeepseekConfig) -> dict:
    """The parameter pytree's shapes (layout of ``models/deepseek/weights.py``: matrices
    ``[in, out]``, one dict per layer)."""
    h, hn, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_out = hn * cfg.qk_head_dim
    layers = []
    for i in range(cfg.num_hidden_layers):
        lp = {"attn_norm": (h,), "mlp_norm": (h,), "wkv_a": (h, r + dr), "kv_a_norm": (r,),
              "wkv_b": (r, hn * (cfg.qk_nope_head_dim + cfg.v_head_dim)), "wo": (hn * cfg.v_head_dim, h)}
        if cfg.q_lora_rank is None:
            lp["wq"] = (h, q_out)
        else:
            lp.update(wq_a=(h, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,), wq_b=(cfg.q_lora_rank, q_out))
        if cfg.is_moe_layer(i):
            e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
            lp.update(router=(h, e), experts_gate=(e, h, f), experts_up=(e, h, f), experts_down=(e, f, h))
            if cfg.topk_method == "noaux_tc":
                lp["e_score_correction_bias"] = (e,)
            if cfg.n_shared_experts:
                fs = f * cfg.n_shared_experts
                lp.update(shared_gate=(h, fs), shared_up=(h, fs), shared_down=(fs, h))
        else:
            f = cfg.intermediate_size
            lp.update(w_gate=(h, f), w_up=(h, f), w_down=(f, h))
        layers.append(lp)
    out = {"embed": (cfg.vocab_size, h), "final_norm": (h,), "layers": layers}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (h, cfg.vocab_size)
    return out


def deepseek_random_params(cfg: DeepseekConfig, seed: int, dtype, *, host: bool) -> dict:
    """Random parameters of :func:`deepseek_param_shapes`: norms ``1 + normal(0.1)``, correction bias 0
    (float32), other matrices ``normal(0.02)``.  ``host``: numpy (CPU smoke runs), else drawn on
    the device leaf by leaf (15.7B values never pass through the host)."""
    rng = np.random.default_rng(seed)
    draw = jax.jit(lambda key, shape, scale, shift: (jax.random.normal(key, shape, jnp.float32) * scale
                                                      + shift).astype(dtype), static_argnums=(1,))
    counter = iter(range(1 << 30))

    def leaf(path, shape):
        name = str(getattr(path[-1], "key", path[-1]))
        if name.endswith("e_score_correction_bias"):
            return jnp.zeros(shape, jnp.float32)
        scale, shift = (0.1, 1.0) if name.endswith("norm") else (0.02, 0.0)
        if host:
            return jnp.asarray(shift + scale * rng.standard_normal(shape, np.float32), dtype)
        return draw(jax.random.fold_in(jax.random.PRNGKey(seed), next(counter)), shape, scale, shift)

    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    return jax.block_until_ready(jax.tree_util.tree_map_with_path(leaf, deepseek_param_shapes(cfg), is_leaf=is_shape))


def deepseek_param_bytes(cfg: DeepseekConfig, itemsize: int) -> int:
    return sum(math.prod(s) for s in hf_param_shapes(cfg).values()) * itemsize


def memory_limit_bytes(override_gb: float | None = None) -> int | None:
    """Allocator limit of device 0 (``--mem-limit-gb`` overrides; None when unknown, e.g. CPU)."""
    if override_gb is not None:
        return int(override_gb * 2 ** 30)
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may not implement it
        stats = {}
    return stats.get("bytes_limit")


def oom_reason(need: int, limit: int | None, what: str = "") -> str | None:
    """Why a point is predicted not to fit: ``need`` bytes (of ``what``) over ``limit`` (None:
    no limit known); None when it fits."""
    if limit is None or need <= limit:
        return None
    return f"needs ~{need / 2**30:.1f} GiB{f' ({what})' if what else ''}, limit {limit / 2**30:.1f} GiB"


def free_memory() -> None:
    """Collect garbage so device buffers of a failed point are released before the next one
    (XLA's allocator keeps working after a RESOURCE_EXHAUSTED error once they are dropped)."""
    gc.collect()


def default_out_path(name: str, smoke: bool) -> str:
    """``bench/results/<name>_<gpu>.json`` (smoke runs go to a temporary directory instead)."""
    if smoke:
        import tempfile  # noqa: PLC0415
        return os.path.join(tempfile.gettempdir(), "jpa_bench_smoke", f"{name}_{gpu_slug()}.json")
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "results", f"{name}_{gpu_slug()}.json")


def list_predicted_oom(plan: list[dict], predict_oom: Callable[[dict], str | None]) -> dict:
    """``--list``: print each planned point with its predicted out-of-memory reason (if any)."""
    reasons = [predict_oom(p) for p in plan]
    for p, r in zip(plan, reasons):
        print(p, r or "")
    return {"planned": len(plan), "predicted_oom": sum(bool(r) for r in reasons)}


def add_common_args(ap, parts: Iterable[str]) -> None:
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/<name>_<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and shapes (CPU, < 1 minute)")
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--part", default="all", choices=("all",) + tuple(parts), help="run only this subset")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="start no new point after this many minutes (rerun the same command to resume)")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="memory limit used to predict out-of-memory points (default: the allocator's)")
    ap.add_argument("--force", action="store_true",
                    help="append to a result file written on another device / with other fixed settings")
    ap.add_argument("--list", action="store_true", help="print the planned points and exit")


def finish_args(args, defaults: dict, smoke: dict) -> None:
    """Complete a script's parsed ``args``: with ``--smoke`` every unset (falsy) argument named in
    ``smoke`` takes that value, then every one still unset in ``defaults``; ``args.mem_limit``
    is the memory limit in bytes (:func:`memory_limit_bytes` of ``--mem-limit-gb``)."""
    for table in ((smoke, defaults) if args.smoke else (defaults,)):
        for name, value in table.items():
            setattr(args, name, getattr(args, name) or value)
    args.mem_limit = memory_limit_bytes(args.mem_limit_gb)


class Budget:
    """Wall-clock budget of one invocation (``--budget-min``)."""

    def __init__(self, minutes: float | None):
        self.t0 = time.perf_counter()
        self.limit = None if minutes is None else 60.0 * minutes

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> bool:
        return self.limit is not None and self.elapsed() > self.limit


class ResultStore:
    """Result JSON of one benchmark: ``{"benchmark", "schema", "device_info", "fixed", "runs", "points"}``.

    ``fixed`` holds the settings every point of the file must share (model shapes, generated
    tokens...); reopening a file whose ``fixed`` or device differs raises unless ``force``.
    ``key_fields`` name the fields that identify a point (used to skip finished points).
    """

    def __init__(self, path: str, benchmark: str, key_fields: tuple[str, ...], fixed: dict, settings: dict,
                 *, force: bool = False):
        self.path = os.path.abspath(path)
        self.key_fields = key_fields
        info = device_info()
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.data = json.load(f)
            if self.data.get("benchmark") != benchmark:
                raise ValueError(f"{self.path} holds benchmark {self.data.get('benchmark')!r}, not {benchmark!r}")
            old_dev = self.data.get("device_info", {}).get("device")
            if not force and old_dev != info["device"]:
                raise ValueError(f"{self.path} was written on {old_dev!r}, this is {info['device']!r} "
                                 f"(use another --out, or --force)")
            old_fixed = self.data.get("fixed", {})
            if not force and json.loads(json.dumps(fixed)) != old_fixed:
                raise ValueError(f"{self.path} has fixed settings {old_fixed} but this run has {fixed} "
                                 f"(use another --out, or --force)")
        else:
            self.data = {"benchmark": benchmark, "schema": SCHEMA_VERSION, "device_info": info,
                         "fixed": fixed, "runs": [], "points": []}
        self.data["runs"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "argv": sys.argv[1:], "settings": settings, "jax": jax.__version__,
                                  "device": info["device"], "nvidia_smi": info.get("nvidia_smi")})
        self.save()

    def key(self, point: dict) -> tuple:
        return tuple(json.dumps(point.get(k)) for k in self.key_fields)

    def done(self, point: dict) -> dict | None:
        """The stored point with ``point``'s key (finished or out of memory), else None."""
        k = self.key(point)
        for p in self.data["points"]:
            if self.key(p) == k and p.get("status") in ("ok", "oom"):
                return p
        return None

    def add(self, point: dict) -> None:
        """Append (replacing a stored point of the same key, e.g. an earlier error) and save."""
        k = self.key(point)
        self.data["points"] = [p for p in self.data["points"] if self.key(p) != k] + [point]
        self.save()

    def note(self, key: str, value: Any) -> None:
        self.data["runs"][-1][key] = value
        self.save()

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def open_store(args, name: str, key_fields: tuple[str, ...], fixed: dict) -> tuple[str, "ResultStore"]:
    """``(out path, ResultStore)`` for a script's parsed ``args``: ``--out`` or the default path,
    every other argument recorded as the run's settings, and the memory limit noted."""
    out = args.out or default_out_path(name, args.smoke)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    store = ResultStore(out, name, key_fields, fixed, settings, force=args.force)
    store.note("memory_limit_bytes", args.mem_limit)
    return out, store


def measure_plan(args, name: str, key_fields: tuple[str, ...], fixed: dict, plan: list[dict],
                 make_bench: Callable, *, budget: Budget | None = None, title: str | None = None,
                 after: Callable | None = None) -> dict:
    """The run of an end-to-end benchmark script: open its result store (:func:`open_store`;
    ``fixed``: the settings every invocation must share), build its benchmark
    (``make_bench(args)``, an object with ``measure(point)`` and ``predict_oom(point)``), measure
    the points of ``plan`` not yet stored (:func:`run_points`) within ``budget`` (default
    ``--budget-min``), then ``after(store, bench, counts)`` (which may return more counts).
    With ``--list``: only print the planned points with their predicted out-of-memory reasons.
    Returns ``{"out": path, "counts": counts}`` (``--list``: :func:`list_predicted_oom`'s)."""
    if args.list:   # with --mem-limit-gb: which points are predicted not to fit
        return list_predicted_oom(plan, make_bench(args).predict_oom)
    out, store = open_store(args, name, key_fields, fixed)
    bench = make_bench(args)
    print(f"{name}: {title or f'{len(plan)} planned points'} -> {out}", flush=True)
    counts = run_points(store, plan, bench.measure, budget or Budget(args.budget_min),
                        predict_oom=bench.predict_oom)
    if after is not None:
        counts = after(store, bench, counts) or counts
    print(counts, flush=True)
    return {"out": out, "counts": counts}


def report_targets(store: "ResultStore", targets_fn: Callable[[dict], dict]) -> None:
    """Compute the target ratios from the stored points, note them in the file and print them
    (a failure is printed, not raised: the measurements are saved either way)."""
    try:
        targets = targets_fn(store.data)
        store.note("targets", targets)
        for line in targets.get("lines", []):
            print(line)
    except Exception as e:  # noqa: BLE001
        print(f"targets not computed: {e!r}")


def run_points(store: ResultStore, plan: list[dict], measure: Callable[[dict], dict], budget: Budget,
               *, predict_oom: Callable[[dict], str | None] | None = None, log=print) -> dict:
    """Measure every planned point not yet in ``store``; returns counts.

    ``measure(point)`` returns the fields to add (it may raise; out-of-memory errors become
    ``status: "oom"``, anything else ``status: "error"`` with the message, and the run goes on).
    ``predict_oom(point)`` may return a reason to record the point as "oom" without trying.
    """
    counts = {"measured": 0, "skipped_existing": 0, "oom": 0, "errors": 0, "not_started_budget": 0}
    for point in plan:
        if store.done(point) is not None:
            counts["skipped_existing"] += 1
            continue
        if budget.spent():
            counts["not_started_budget"] += 1
            continue
        reason = predict_oom(point) if predict_oom else None
        t0 = time.perf_counter()
        if reason:
            rec = dict(point, status="oom", oom="predicted: " + reason)
            counts["oom"] += 1
        else:
            try:
                rec = dict(point, status="ok", **measure(point))
                counts["measured"] += 1
            except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
                msg = f"{type(e).__name__}: {e}"[:1000]
                if is_oom(e):
                    rec = dict(point, status="oom", oom="measured: " + msg)
                    counts["oom"] += 1
                else:
                    import traceback  # noqa: PLC0415
                    traceback.print_exc()
                    rec = dict(point, status="error", error=msg)
                    counts["errors"] += 1
            free_memory()
        rec["wall_s"] = round(time.perf_counter() - t0, 3)
        store.add(rec)
        log(_brief(rec), f"[{budget.elapsed():.0f}s]", flush=True)
    store.note("counts", counts)
    store.note("elapsed_s", round(budget.elapsed(), 1))
    return counts


def _brief(rec: dict) -> str:
    keep = {k: v for k, v in rec.items() if not isinstance(v, (list, dict))}
    return json.dumps(keep)[:400]


def commit_of_checkout() -> str | None:
    """``git rev-parse HEAD`` of this checkout, ``+dirty`` with uncommitted changes to tracked
    files; None outside a git checkout."""
    git = ["git", "-C", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    try:
        sha = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")
