"""Decode throughput on 1 and N GPUs: tensor parallel and data parallel against one device.

Each point decodes ``B`` sequences hanging from one shared prefix of ``P`` tokens (the
``"shared"`` cache layout: the prefix stored once per device) and measures decode-only
throughput as ``bench/e2e_decode.py`` does (Hydragen D.1): ``tokens/s = B * (k - 1) / (t(k) -
t(1))``, ``t(n)`` one jitted call of ``n`` dependent greedy decode steps (all layers, LM head,
argmax feeding the next step); prefill excluded, prefix keys/values random.

Modes (``mode``, ``gpus``):

* ``single``, 1 -- :class:`models.llama.Llama` on device 0 (the baseline, measured in the same
  run on the same machine);
* ``tp``, N -- :class:`models.sharded_llama.ShardedLlama` on a ``(1, N)`` mesh: heads, FFN and
  vocabulary split over the N devices, two all-reduces of ``[B, H]`` per layer, greedy argmax
  over vocabulary shards;
* ``dp``, N -- a ``(N, 1)`` mesh: every device holds the whole model and ``B / N`` sequences
  (the prefix once per device), no collective per layer.

Collectives: every ``tp`` point records the arithmetic (``allreduce_bytes_per_step``: the
``2 L + 1`` all-reduces of ``B x H`` activations per step; ``ring_bytes_per_gpu_per_step``: what
a ring all-reduce sends per GPU, ``2 (N - 1) / N`` of that) and a measurement: the time of one
``[B, H]`` all-reduce on this mesh (``allreduce_ms``, timed in a loop of dependent ``psum``s),
``collective_ms_per_step_est = (2 L + 1) x allreduce_ms`` and its share of the step.

Models (random bf16 weights, list layout): part ``8b`` -- Llama-3.1-8B shapes at ``--layers``
(default 32) layers, ``B in {64, 256, 1024}``, ``P in {1024, 16256}`` ("16K" as in
``e2e_decode``: 16384 with the generated tokens), all three modes; part ``70b`` -- Llama-3.1-70B
shapes at ``--layers-70b`` (default 48 of 80: ~86 GB of weights, more than one 80 GB GPU) in
``tp`` mode only.  ``--quick``: the two target points of the 8B part (B=256 P=1K, B=1024 P=16K).

Usage::

    python bench/tensor_parallel.py --quick          # -> bench/results/tensor_parallel_2xh100.json
    python bench/tensor_parallel.py --part 8b --budget-min 9
    python bench/tensor_parallel.py --part 70b
    python bench/tensor_parallel.py --smoke          # tiny model on 2 CPU devices
    python bench/tensor_parallel.py --plot-only      # bench/results/tensor_parallel_<gpus>.png
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run on 2 host devices (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                                       "--xla_force_host_platform_device_count=2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench import e2e_common as ec  # noqa: E402
from bench.timing import gpu_slug, loop_time  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.kv_cache import KVCache, PrefixCache  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.sampling import GREEDY  # noqa: E402
from models.sharded_llama import ShardedLlama  # noqa: E402
from models.sharding import DATA, MODEL, make_mesh, param_specs, shard_params  # noqa: E402
from models.weights import init_params, unstack_layers  # noqa: E402

NAME = "tensor_parallel"
KEY_FIELDS = ("part", "model", "layers", "batch", "prefix", "mode", "gpus")
LLAMA_70B = LlamaConfig.preset("Llama-3.1-8B").replace(hidden_size=8192, intermediate_size=28672,
                                                       num_hidden_layers=80, num_attention_heads=64,
                                                       num_key_value_heads=8, head_dim=128)
MODELS = {"llama3.1-8b": LlamaConfig.preset("Llama-3.1-8B"), "llama3.1-70b": LLAMA_70B}
PART_MODELS = {"8b": "llama3.1-8b", "70b": "llama3.1-70b"}


def plan_points(args) -> list[dict]:
    """Points in run order: per part and mode (parameters are built once per mode), batch, prefix."""
    n = args.gpus
    if args.smoke:
        grids = {"8b": ([(4, 16), (8, 32)], args.layers), "70b": ([(4, 16)], args.layers_70b)}
    elif args.quick:
        grids = {"8b": ([(256, 1024), (1024, 16256)], args.layers), "70b": ([(256, 1024)], args.layers_70b)}
    else:
        grids = {"8b": ([(b, p) for b in (64, 256, 1024) for p in (1024, 16256)], args.layers),
                 "70b": ([(64, 1024), (256, 1024)], args.layers_70b)}
    plan = []
    for part, (shapes, layers) in grids.items():
        if args.part not in ("all", part):
            continue
        modes = (("single", 1), ("tp", n), ("dp", n)) if part == "8b" else (("tp", n),)
        for mode, gpus in modes:
            if mode in args.modes:
                plan += [{"part": part, "model": PART_MODELS[part], "layers": layers, "batch": b, "prefix": p,
                          "mode": mode, "gpus": gpus} for b, p in shapes]
    return plan


def smoke_config(layers: int) -> LlamaConfig:
    """Tiny GQA model for CPU runs (3 kv heads: padded to 4 on 2 devices)."""
    return LlamaConfig(vocab_size=254, hidden_size=96, intermediate_size=190, num_hidden_layers=layers,
                       num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=4096)


def _on(mesh, spec):
    return None if mesh is None else NamedSharding(mesh, spec)


class Bench:
    """The current mode's model, parameters and jitted decode runner."""

    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.k = args.gen_tokens
        self.loaded = None
        self.params = None

    def cfg(self, point) -> LlamaConfig:
        if self.args.smoke:
            return smoke_config(point["layers"])
        return MODELS[point["model"]].replace(num_hidden_layers=point["layers"])

    def mesh(self, point):
        if point["mode"] == "single":
            return None
        return make_mesh(point["gpus"], 1) if point["mode"] == "tp" else make_mesh(1, point["gpus"])

    def setup(self, point):
        key = (point["model"], point["layers"], point["mode"], point["gpus"])
        if self.loaded == key:
            return
        self.params = self.runner = None
        ec.free_memory()
        cfg, mesh = self.cfg(point), self.mesh(point)
        t0 = time.perf_counter()
        model = Llama(cfg)
        if mesh is None:
            self.params = ec.random_params(cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
        else:
            model = ShardedLlama(model, mesh)
            self.params = sharded_random_params(model, self.dtype, host=self.args.smoke)
        self.model, self.mesh_obj, self.runner = model, mesh, make_runner(model)
        self.loaded = key
        print(f"{key}: {cfg.num_params() / 1e9:.2f}B params, placed in {time.perf_counter() - t0:.1f}s", flush=True)

    # -- memory -----------------------------------------------------------------------------
    def predicted_bytes(self, point) -> int:
        """Bytes per device: weights, the prefix (once per device), suffix buffers, logits."""
        cfg, b, p, k = self.cfg(point), point["batch"], point["prefix"], self.k
        item = jnp.dtype(self.dtype).itemsize
        tp = point["gpus"] if point["mode"] == "tp" else 1
        b_loc = b // point["gpus"] if point["mode"] == "dp" else b
        kv = ec.kv_bytes_per_token(cfg, item) // tp
        act = b_loc * (cfg.vocab_size // tp) * 4 * 3
        act += b_loc * (cfg.hidden_size * 8 + cfg.intermediate_size * 6 // tp) * 4
        return ec.param_bytes(cfg, item) // tp + (p + b_loc * k) * kv + act + (512 << 20)

    def predict_oom(self, point) -> str | None:
        return ec.oom_reason(self.predicted_bytes(point), self.args.mem_limit, "weights + KV cache + logits")

    # -- inputs -----------------------------------------------------------------------------
    def caches(self, point):
        """Random prefix keys/values (one node, stored once per data shard), empty suffix buffers."""
        model, mesh = self.model, self.mesh_obj
        b, p, k = point["batch"], point["prefix"], self.k
        local = model.local.config if mesh is not None else model.config
        tp = point["gpus"] if point["mode"] == "tp" else 1
        g = point["gpus"] if point["mode"] == "dp" else 1          # prefix nodes: one per data shard
        hkv, d, nl = local.num_key_value_heads * tp, local.head_dim, local.num_hidden_layers
        kv_spec = P(DATA, None, MODEL, None)
        if self.args.smoke:
            rng = np.random.default_rng(b * 7 + p)
            rand = lambda i: jax.device_put(rng.standard_normal((g, p, hkv, d)).astype(np.float32),  # noqa: E731
                                            _on(mesh, kv_spec))
        else:
            fn = jax.jit(lambda key: jax.random.normal(key, (g, p, hkv, d), self.dtype),
                         out_shardings=_on(mesh, kv_spec))
            rand = lambda i: fn(jax.random.fold_in(jax.random.PRNGKey(1), i))  # noqa: E731
        zeros = jax.jit(lambda: jnp.zeros((b, k, hkv, d), self.dtype), out_shardings=_on(mesh, kv_spec))
        pre, layers = [], []
        for i in range(nl):
            pre.append({"k": (rand(2 * i),), "v": (rand(2 * i + 1),)})
            layers.append({"k": zeros(), "v": zeros()})
        prefix = PrefixCache(layers=pre, lengths=(jnp.full((g,), p, jnp.int32),), last_logits=None)
        lengths0, pos0 = jnp.zeros((b,), jnp.int32), jnp.full((b,), p, jnp.int32)
        tokens0 = jnp.asarray(np.random.default_rng(b + p).integers(0, self.model.config.vocab_size, b), jnp.int32)
        return jax.block_until_ready((prefix, layers, lengths0, pos0, tokens0))

    # -- one point --------------------------------------------------------------------------
    def measure(self, point) -> dict:
        self.setup(point)
        args, k, b = self.args, self.k, point["batch"]
        prefix, layers, lengths0, pos0, tokens0 = self.caches(point)

        def call(n):
            nonlocal layers
            t0 = time.perf_counter()
            layers, tok = self.runner(self.params, prefix, layers, lengths0, pos0, tokens0, jnp.int32(n))
            jax.block_until_ready((layers, tok))
            return time.perf_counter() - t0

        compile_s = call(1)
        call(min(k, 16))
        t1 = [call(1) for _ in range(3)]
        tk = [call(k) for _ in range(args.reps)]
        del layers, prefix
        m1, mk = statistics.median(t1), statistics.median(tk)
        decode_s = mk - m1
        valid = decode_s > 0
        step_ms = 1e3 * decode_s / (k - 1) if valid else None
        rec = {"gen_tokens": k, "t1_s": t1, "tk_s": tk, "decode_s": decode_s, "timing_valid": valid,
               "step_ms": step_ms, "tokens_per_s": b * (k - 1) / decode_s if valid else None,
               "compile_and_first_call_s": compile_s, "predicted_bytes_per_device": int(self.predicted_bytes(point))}
        if point["mode"] == "tp":
            rec.update(self.collectives(point, step_ms))
        return rec

    def collectives(self, point, step_ms) -> dict:
        """Arithmetic and measured cost of the per-layer all-reduces of a ``tp`` point."""
        cfg, n, b = self.cfg(point), point["gpus"], point["batch"]
        item = jnp.dtype(self.dtype).itemsize
        count = 2 * cfg.num_hidden_layers + 1
        nbytes = count * b * cfg.hidden_size * item
        x = jax.device_put(jnp.ones((b, cfg.hidden_size), self.dtype), NamedSharding(self.mesh_obj, P(DATA, None)))
        psum = jax.shard_map(lambda v: jax.lax.psum(v, MODEL), mesh=self.mesh_obj, in_specs=P(DATA, None),
                             out_specs=P(DATA, None), check_vma=False)
        one_ms = 1e3 * loop_time(psum, x, (), target_s=0.01 if self.args.smoke else 0.03)
        est = count * one_ms
        return {"allreduces_per_step": count, "allreduce_bytes_per_step": nbytes,
                "ring_bytes_per_gpu_per_step": nbytes * 2 * (n - 1) / n, "allreduce_ms": one_ms,
                "collective_ms_per_step_est": est, "collective_share_est": est / step_ms if step_ms else None}


def sharded_random_params(model: ShardedLlama, dtype, *, host: bool) -> dict:
    """Random parameters (list layout) created in their shards: every device draws its own block
    of each parameter inside ``shard_map`` (its key folded with its model-axis index where the
    parameter is split; copies along an unsplit axis draw the same block), so no device ever holds
    the whole model and XLA partitions no random-number program (partitioning ``init_params``
    over a mesh compiles for many minutes at 8B shapes).  Norms are ``1 + normal(0.1)``, matrices
    ``normal(0.02)``; ``host``: drawn with numpy and placed block by block (CPU smoke runs)."""
    cfg = model.config
    if host:
        return shard_params(cfg, ec.random_params(cfg, seed=0, dtype=dtype, host=True), model.mesh)
    shapes = model.shapes
    if (shapes.heads_kv, shapes.intermediate, shapes.vocab) != (cfg.num_key_value_heads, cfg.intermediate_size,
                                                                cfg.vocab_size):
        raise ValueError("sharded_random_params draws unpadded shapes; this config needs padding on this mesh")

    def init(key):
        return unstack_layers(init_params(cfg, key, dtype))

    avals = jax.eval_shape(init, jax.random.PRNGKey(0))
    specs = param_specs(avals)
    leaves, tree = jax.tree_util.tree_flatten(avals)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(avals)[0]]
    sizes = dict(zip(model.mesh.axis_names, model.mesh.devices.shape))
    out, fns = [], {}   # (one compiled draw per distinct block shape, split and kind: 9 at 8B)
    for i, (aval, spec, path) in enumerate(zip(leaves, spec_leaves, paths)):
        axes = [a for a in spec if a is not None]
        local = tuple(n // sizes[a] if a is not None else n
                      for n, a in zip(aval.shape, tuple(spec) + (None,) * (len(aval.shape) - len(spec))))
        norm = "norm" in path

        def draw(key, local=local, split=MODEL in axes, norm=norm):
            if split:
                key = jax.random.fold_in(key, jax.lax.axis_index(MODEL))
            x = jax.random.normal(key, local, jnp.float32)
            return ((1 + 0.1 * x) if norm else 0.02 * x).astype(dtype)

        sig = (local, MODEL in axes, norm, spec)
        if sig not in fns:
            fns[sig] = jax.jit(jax.shard_map(draw, mesh=model.mesh, in_specs=P(), out_specs=spec,
                                             check_vma=False))
        out.append(fns[sig](jax.random.fold_in(jax.random.PRNGKey(0), i)))
    return jax.block_until_ready(jax.tree_util.tree_unflatten(tree, out))


def make_runner(model):
    """``run(params, prefix, layers, lengths0, pos0, tokens0, n) -> (layers, tokens)``: ``n``
    greedy decode steps (vocabulary-parallel argmax on a mesh)."""
    sharded = isinstance(model, ShardedLlama)

    def run(params, prefix, layers, lengths0, pos0, tokens0, n):
        cache = KVCache(prefix=prefix, layers=layers, lengths=lengths0, pos_offset=pos0, backend="shared")
        keys = jnp.zeros((tokens0.shape[0], 2), jnp.uint32)   # unused by greedy sampling

        def body(_, carry):
            cache, tok = carry
            logits, cache = model.decode_step(params, cache, tok)
            new = (model.sample_tokens(logits, keys, 0, GREEDY) if sharded
                   else jnp.argmax(logits, axis=-1).astype(jnp.int32))
            return cache, new

        cache, tok = jax.lax.fori_loop(0, n, body, (cache, tokens0))
        return cache.layers, tok

    return jax.jit(run, donate_argnames=("layers",))


def targets(data: dict) -> dict:
    """Speedups of ``tp`` and ``dp`` over ``single`` per (part, batch, prefix)."""
    ok = [p for p in data["points"] if p.get("status") == "ok" and p.get("tokens_per_s")]
    base = {(p["part"], p["batch"], p["prefix"]): p["tokens_per_s"] for p in ok if p["mode"] == "single"}
    rows, lines = [], []
    for p in ok:
        if p["mode"] == "single":
            continue
        ref = base.get((p["part"], p["batch"], p["prefix"]))
        row = {k: p[k] for k in ("part", "mode", "gpus", "batch", "prefix")}
        row.update(tokens_per_s=p["tokens_per_s"], speedup=p["tokens_per_s"] / ref if ref else None,
                   collective_share_est=p.get("collective_share_est"))
        rows.append(row)
        sp = f"{row['speedup']:.2f}x" if ref else "(no 1-GPU baseline)"
        lines.append(f"{p['part']} {p['mode']}{p['gpus']} B={p['batch']} P={p['prefix']}: "
                     f"{p['tokens_per_s']:.0f} tok/s, {sp}")
    return {"speedups": rows, "lines": lines}


def plot(path: str) -> str:
    """Bar chart of tokens/s per (batch, prefix) and mode next to the result JSON."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    with open(path) as f:
        data = json.load(f)
    ok = [p for p in data["points"] if p.get("status") == "ok" and p.get("tokens_per_s") and p["part"] == "8b"]
    shapes = sorted({(p["batch"], p["prefix"]) for p in ok})
    modes = sorted({(p["mode"], p["gpus"]) for p in ok}, key=lambda m: (m[1], m[0]))
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(shapes), 3.6))
    width = 0.8 / max(len(modes), 1)
    for j, (mode, gpus) in enumerate(modes):
        vals = [next((p["tokens_per_s"] for p in ok if (p["batch"], p["prefix"], p["mode"], p["gpus"]) ==
                      (b, pre, mode, gpus)), 0) for b, pre in shapes]
        ax.bar(np.arange(len(shapes)) + j * width, vals, width, label=f"{mode} x{gpus}")
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [f"B={b}\nP={p}" for b, p in shapes])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3.1-8B shapes, {data['device_info']['device']}")
    ax.legend()
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, PART_MODELS)
    ap.add_argument("--gpus", type=int, default=2, help="devices of the tp and dp modes (default 2)")
    ap.add_argument("--modes", nargs="*", default=["single", "tp", "dp"], choices=("single", "tp", "dp"))
    ap.add_argument("--layers", type=int, default=None, help="layers of the 8B shapes (default 32)")
    ap.add_argument("--layers-70b", type=int, default=None, help="layers of the 70B shapes (default 48)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="k, generated tokens per sequence (default 128)")
    ap.add_argument("--reps", type=int, default=2, help="timed k-token calls per point")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    ap.add_argument("--plot-only", action="store_true", help="only draw the plot of the result file")
    args = ap.parse_args(argv)
    ec.finish_args(args, dict(layers=32, layers_70b=48, gen_tokens=128),
                   smoke=dict(layers=2, layers_70b=1, gen_tokens=8))
    if args.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2 (decode-only time is t(k) - t(1))")
    if args.gpus < 2:
        ap.error("--gpus must be >= 2")
    if args.out is None:
        name = f"{NAME}_{args.gpus}x{gpu_slug()}.json"
        args.out = (os.path.join(os.path.dirname(ec.default_out_path(NAME, True)), name) if args.smoke else
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot_only:
        return {"plot": plot(args.out)}
    if len(jax.devices()) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus} needs {args.gpus} devices, {len(jax.devices())} exist")
    fixed = {"gen_tokens": args.gen_tokens, "smoke": args.smoke, "dtype": "float32" if args.smoke else "bfloat16",
             "cache_layout": "shared (one prefix node, stored once per device)",
             "definition": "tokens_per_s = batch * (k - 1) / (t(k) - t(1)); t(n) = one call of n greedy decode "
                           "steps (Hydragen D.1); prefill excluded"}

    def after(store, bench, counts):
        store.note("commit", args.commit or ec.commit_of_checkout())
        store.note("devices", [str(d) for d in jax.devices()[:args.gpus]])
        ec.report_targets(store, targets)
        try:
            print("plot:", plot(store.path))
        except ImportError as e:
            print(f"no plot: {e}")

    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, after=after)


if __name__ == "__main__":
    main()
