"""Decode throughput on 1 and N GPUs: tensor parallel, data parallel and the mesh the planner
picks, against one device.

Each point decodes ``B`` sequences over a prefix of ``P`` tokens and measures decode-only
throughput as ``bench/e2e_decode.py`` does (Hydragen D.1): ``tokens/s = B * (k - 1) / (t(k) -
t(1))``, ``t(n)`` one jitted call of ``n`` dependent greedy decode steps (all layers, LM head,
argmax feeding the next step); prefill excluded, prefix keys/values random.  ``layout``:
``shared`` (one prefix node, stored once per data shard) or ``flat`` (every sequence's buffer
holds its own copy of the prefix).

Modes (``mode``, ``gpus``; every point records its split as ``tp`` x ``dp``):

* ``single``, 1 -- :class:`models.llama.Llama` on device 0 (the baseline, measured in the same
  run on the same machine);
* ``tp``, N -- :class:`models.sharded_llama.ShardedLlama` on a ``(1, N)`` mesh: heads, FFN and
  vocabulary split over the N devices, two all-reduces of ``[B, H]`` per layer, greedy argmax
  over vocabulary shards; ``overlap_chunks`` (``--overlap-chunks``, a key field) > 1 runs the
  collective matmul of :mod:`models.collective_matmul` (row chunks whose all-reduces overlap
  the other chunks' matmuls);
* ``dp``, N -- a ``(N, 1)`` mesh: every device holds the whole model and ``B / N`` sequences
  (the prefix once per device), no collective per layer;
* ``auto``, N -- the split ``LLM.load(devices=N)`` takes
  (:func:`models.mesh_plan.plan_mesh_for_devices` for ``DecodeWorkload(B, P, k)``), recorded as
  ``plan_tp`` / ``plan_dp`` / ``plan_reason`` / ``plan_step_ms``; when that split was measured
  as an explicit point (same shapes, ``overlap_chunks`` 1) its numbers are copied
  (``measured_as``), otherwise it is measured.

Collectives: every point on a mesh with ``tp > 1`` records the arithmetic
(``allreduce_bytes_per_step``: the ``2 L + 1`` all-reduces of ``B_loc x H`` per step;
``ring_bytes_per_gpu_per_step``) and a measurement: one ``[B, H]`` all-reduce on this mesh
(``allreduce_ms``, a loop of dependent ``psum``s; ``allreduce_chunk_ms`` for one row chunk of an
overlapped point), ``collective_ms_per_step_est = (2 L + 1) x allreduce_ms`` and its share.

Roofline (every point): ``roofline_ms = max(bytes / (gpus x copy rate), flops / (gpus x matmul
rate)) + allreduce_floor_ms``.  ``bytes``: the weights once per model replica, keys and values
read (``shared``: the prefix once per data shard and every suffix at its mean length ``k / 2``;
``flat``: every sequence's prefix copy and suffix); ``flops``: ``2 B`` per matmul parameter
plus attention ``4 B Hq (P + k / 2) D L``; both rates measured on device 0 in the same run
(``bench/roofline.py``); ``allreduce_floor_ms``: ``collective_ms_per_step_est`` (0 without
tensor parallel).

Models (random bf16 weights, list layout): part ``8b`` -- Llama-3.1-8B shapes at ``--layers``
(default 32), ``B in {64, 256, 1024}``, ``P in {1024, 16256}`` ("16K" as in ``e2e_decode``:
16384 with the generated tokens), modes single, tp, dp, auto, layout shared; part ``70b`` --
Llama-3.1-70B shapes at ``--layers-70b`` (default all 80: 141 GB of weights, 70.6 GB per GPU
on tp 2), the same ``B`` and ``P``, modes tp and auto, layouts shared and flat.  ``--quick``:
``B=256 P=1K`` and ``B=1024 P=16K`` of each part.  ``--batches`` / ``--prefixes`` /
``--layouts`` / ``--modes`` keep a subset.  Points predicted not to fit (``--mem-limit-gb``,
else the allocator's limit) are recorded as out of memory without running; ``--list`` prints
each planned point with that prediction.  Per GPU on tp 2 at 80 layers and k = 128 the
prediction is weights 70.6 GB + keys and values (320 KiB per token over both GPUs) + logits and
activations: ``shared`` fits every point of the grid (B=1024 P=16K: about 97 GB); ``flat`` fits
B=64 P=1K (about 83 GB) and B=256 P=1K (about 120 GB), not B=1024 P=1K (266 GB) nor any P=16K
point (243 GB at B=64), against an H200's ~129 GiB allocator limit at the 0.92 memory fraction
this script sets.

Result file: ``--out`` (default ``bench/results/tensor_parallel_<N>x<gpu>.json``), rewritten
atomically after every point.  An existing file is refused unless ``--resume``, which keeps its
points and measures the missing ones.  ``--budget-s`` (or ``--budget-min``) starts no point
after that many seconds.  ``--commit`` names the measured commit (default ``git rev-parse HEAD``
of this checkout; a copied checkout's git may be stale), recorded per point and per run.

Usage::

    python bench/tensor_parallel.py --quick --out bench/results/tp.json --commit SHA
    python bench/tensor_parallel.py --quick --part 8b --modes tp --overlap-chunks 1 2 4 --out ...
    python bench/tensor_parallel.py --part 70b --budget-s 420 --resume --out ...
    python bench/tensor_parallel.py --smoke --gpus 4      # tiny model on 4 CPU devices
    python bench/tensor_parallel.py --plot-only --out ... # the PNG next to the JSON
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
if "--smoke" in sys.argv[1:]:   # tiny CPU run on 4 host devices (timings are not measurements)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                                       "--xla_force_host_platform_device_count=4")
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
from bench.roofline import measure_rates  # noqa: E402
from bench.timing import gpu_slug, loop_time  # noqa: E402
from models import kv_cache as kvc  # noqa: E402
from models.collective_matmul import CollectiveMatmul, row_chunks  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.kv_cache import KVCache, PrefixCache  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.mesh_plan import DecodeWorkload, plan_mesh_for_devices  # noqa: E402
from models.sampling import GREEDY  # noqa: E402
from models.sharded_llama import ShardedLlama  # noqa: E402
from models.sharding import DATA, MODEL, make_mesh, param_specs, shard_params  # noqa: E402
from models.weights import init_params, unstack_layers  # noqa: E402

NAME = "tensor_parallel"
KEY_FIELDS = ("part", "model", "layers", "batch", "prefix", "layout", "mode", "gpus", "overlap_chunks")
LLAMA_70B = LlamaConfig.preset("Llama-3.1-8B").replace(hidden_size=8192, intermediate_size=28672,
                                                       num_hidden_layers=80, num_attention_heads=64,
                                                       num_key_value_heads=8, head_dim=128)
MODELS = {"llama3.1-8b": LlamaConfig.preset("Llama-3.1-8B"), "llama3.1-70b": LLAMA_70B}
PART_MODELS = {"8b": "llama3.1-8b", "70b": "llama3.1-70b"}
PART_MODES = {"8b": ("single", "tp", "dp", "auto"), "70b": ("tp", "auto")}
PART_LAYOUTS = {"8b": ("shared",), "70b": ("shared", "flat")}
TWIN_FIELDS = ("part", "layers", "batch", "prefix", "layout", "tp", "dp", "overlap_chunks")


def grid(args) -> list[tuple[int, int]]:
    """``(batch, prefix)`` of every part, kept to ``--batches`` / ``--prefixes``."""
    if args.smoke:
        shapes = [(4, 16), (8, 32)]
    elif args.quick:
        shapes = [(256, 1024), (1024, 16256)]
    else:
        shapes = [(b, p) for b in (64, 256, 1024) for p in (1024, 16256)]
    return [(b, p) for b, p in shapes if (not args.batches or b in args.batches)
            and (not args.prefixes or p in args.prefixes)]


def plan_points(args) -> list[dict]:
    """Points in run order: per part and mode (parameters are built once per mesh), overlap,
    layout, batch, prefix; ``auto`` after the explicit modes whose numbers it may reuse."""
    n, plan = args.gpus, []
    for part, layers in (("8b", args.layers), ("70b", args.layers_70b)):
        if args.part not in ("all", part):
            continue
        for mode in (m for m in PART_MODES[part] if m in args.modes):
            gpus = 1 if mode == "single" else n
            for chunks in (args.overlap_chunks if mode == "tp" else (1,)):
                for layout in (args.layouts or PART_LAYOUTS[part]):
                    plan += [{"part": part, "model": PART_MODELS[part], "layers": layers, "batch": b, "prefix": p,
                              "layout": layout, "mode": mode, "gpus": gpus, "overlap_chunks": chunks}
                             for b, p in grid(args)]
    return plan


def smoke_config(layers: int) -> LlamaConfig:
    """Tiny GQA model for CPU runs (3 kv heads: padded to 4 on 2 or 4 devices)."""
    return LlamaConfig(vocab_size=254, hidden_size=96, intermediate_size=190, num_hidden_layers=layers,
                       num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=4096)


def _on(mesh, spec):
    return None if mesh is None else NamedSharding(mesh, spec)


def _twin(point: dict, split: tuple[int, int]) -> tuple:
    return tuple(json.dumps(v) for v in (point["part"], point["layers"], point["batch"], point["prefix"],
                                          point.get("layout", "shared"), *split, point["overlap_chunks"]))


class Bench:
    """The current mesh's model, parameters and jitted decode runner."""

    def __init__(self, args):
        self.args = args
        self.dtype = jnp.float32 if args.smoke else jnp.bfloat16
        self.k = args.gen_tokens
        self.loaded = self.params = self.runner = self.rates = None
        self.plans = {}
        self.measured = {}   # explicit points by _twin key (this run's and, with --resume, the file's)
        if args.resume and os.path.exists(args.out):
            with open(args.out) as f:
                for p in json.load(f).get("points", []):
                    if p.get("status") == "ok" and p.get("mode") != "auto" and "tp" in p:
                        self.measured[_twin(p, (p["tp"], p["dp"]))] = p

    def cfg(self, point) -> LlamaConfig:
        if self.args.smoke:
            return smoke_config(point["layers"])
        return MODELS[point["model"]].replace(num_hidden_layers=point["layers"])

    def plan(self, point):
        """The :class:`~models.mesh_plan.MeshPlan` of an ``auto`` point (``LLM.load(devices=N)``'s)."""
        key = (point["part"], point["layers"], point["batch"], point["prefix"])
        if key not in self.plans:
            work = DecodeWorkload(batch=point["batch"], prefix_len=point["prefix"], suffix_len=self.k)
            self.plans[key] = plan_mesh_for_devices(self.cfg(point), point["gpus"], work)
        return self.plans[key]

    def split(self, point) -> tuple[int, int]:
        """``(tensor_parallel, data_parallel)`` of a point."""
        mode, n = point["mode"], point["gpus"]
        if mode == "auto":
            plan = self.plan(point)
            return plan.tensor_parallel, plan.data_parallel
        return {"single": (1, 1), "tp": (n, 1), "dp": (1, n)}[mode]

    def setup(self, point):
        tp, dp = self.split(point)
        key = (point["model"], point["layers"], tp, dp)
        if self.loaded != key:
            self.params = self.runner = None
            ec.free_memory()
            cfg = self.cfg(point)
            t0 = time.perf_counter()
            self.mesh_obj = None if tp * dp == 1 else make_mesh(tp, dp)
            if self.mesh_obj is None:
                self.params = ec.random_params(cfg, seed=0, dtype=self.dtype, host=self.args.smoke)
            else:
                self.params = sharded_random_params(ShardedLlama(Llama(cfg), self.mesh_obj), self.dtype,
                                                    host=self.args.smoke)
            self.loaded, self.runner_key = key, None
            print(f"{key}: {cfg.num_params() / 1e9:.2f}B params, placed in {time.perf_counter() - t0:.1f}s", flush=True)
        runner_key = (point["overlap_chunks"], point["layout"])
        if self.runner_key != runner_key:
            model = Llama(self.cfg(point))
            if self.mesh_obj is not None:
                model = ShardedLlama(model, self.mesh_obj,
                                     collective_matmul=CollectiveMatmul(overlap_chunks=point["overlap_chunks"]))
            self.model, self.runner, self.runner_key = model, make_runner(model, point["layout"]), runner_key

    # -- memory -----------------------------------------------------------------------------
    def predicted_bytes(self, point) -> int:
        """Bytes per device: weights, keys and values (prefix once per data shard, or a copy per
        sequence with the flat layout), suffix buffers, logits and activations."""
        cfg, b, p, k = self.cfg(point), point["batch"], point["prefix"], self.k
        item = jnp.dtype(self.dtype).itemsize
        tp, dp = self.split(point)
        b_loc = b // dp
        kv = ec.kv_bytes_per_token(cfg, item) // tp
        tokens = b_loc * (p + k) if point["layout"] == "flat" else p + b_loc * k
        act = b_loc * (cfg.vocab_size // tp) * 4 * 3
        act += b_loc * (cfg.hidden_size * 8 + cfg.intermediate_size * 6 // tp) * 4
        return ec.param_bytes(cfg, item) // tp + tokens * kv + act + (512 << 20)

    def predict_oom(self, point) -> str | None:
        try:
            self.split(point)
        except ValueError:   # no split fits: measure() records the planner's error
            return None
        return ec.oom_reason(self.predicted_bytes(point), self.args.mem_limit, "weights + KV cache + logits")

    # -- inputs -----------------------------------------------------------------------------
    def caches(self, point):
        """``shared``: random prefix keys/values (one node per data shard) and empty suffix
        buffers; ``flat``: buffers of ``P + k`` rows per sequence, the first ``P`` random."""
        mesh, dp = self.mesh_obj, self.split(point)[1]
        b, p, k, flat = point["batch"], point["prefix"], self.k, point["layout"] == "flat"
        cfg = self.model.config
        hkv = self.model.shapes.heads_kv if mesh is not None else cfg.num_key_value_heads
        d, nl = cfg.head_dim, cfg.num_hidden_layers
        kv_spec = _on(mesh, P(DATA, None, MODEL, None))
        shape = (b, p + k, hkv, d) if flat else (dp, p, hkv, d)
        if self.args.smoke:
            rng = np.random.default_rng(b * 7 + p)
            rand = lambda i: jax.device_put(rng.standard_normal(shape).astype(np.float32), kv_spec)  # noqa: E731
        else:
            fn = jax.jit(lambda key: jax.random.normal(key, shape, self.dtype), out_shardings=kv_spec)
            rand = lambda i: fn(jax.random.fold_in(jax.random.PRNGKey(1), i))  # noqa: E731
        zeros = jax.jit(lambda: jnp.zeros((b, k, hkv, d), self.dtype), out_shardings=kv_spec)
        if flat:
            prefix = kvc.empty_prefix_cache(cfg, self.dtype, stacked=False)
            layers = [{"k": rand(2 * i), "v": rand(2 * i + 1)} for i in range(nl)]
            lengths0, pos0 = jnp.full((b,), p, jnp.int32), jnp.zeros((b,), jnp.int32)
        else:
            pre = [{"k": (rand(2 * i),), "v": (rand(2 * i + 1),)} for i in range(nl)]
            prefix = PrefixCache(layers=pre, lengths=(jnp.full((dp,), p, jnp.int32),), last_logits=None)
            layers = [{"k": zeros(), "v": zeros()} for _ in range(nl)]
            lengths0, pos0 = jnp.zeros((b,), jnp.int32), jnp.full((b,), p, jnp.int32)
        tokens0 = jnp.asarray(np.random.default_rng(b + p).integers(0, cfg.vocab_size, b), jnp.int32)
        return jax.block_until_ready((prefix, layers, lengths0, pos0, tokens0))

    # -- one point --------------------------------------------------------------------------
    def measure(self, point) -> dict:
        split = self.split(point)
        rec = {"tp": split[0], "dp": split[1], "commit": self.args.commit_measured,
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
        if point["mode"] == "auto":
            plan = self.plan(point)
            rec.update(plan_tp=plan.tensor_parallel, plan_dp=plan.data_parallel, plan_step_ms=plan.seconds * 1e3,
                       plan_reason=plan.reason)
            twin = self.measured.get(_twin(point, split))
            if twin is not None:
                skip = set(KEY_FIELDS) | {"status", "wall_s", "commit"}
                return {**{k: v for k, v in twin.items() if k not in skip}, **rec, "measured_as": twin["mode"]}
        rec.update(self.timed(point, split))
        if point["mode"] != "auto":
            self.measured[_twin(point, split)] = {**point, **rec}
        return rec

    def timed(self, point, split) -> dict:
        if self.rates is None:   # before any parameters are placed: the copy test takes 2 GB
            self.rates = measure_rates(small=self.args.smoke)
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
        if split[0] > 1:
            rec.update(self.collectives(point, split, step_ms))
        rec.update(self.roofline(point, split, step_ms, rec.get("collective_ms_per_step_est", 0.0)))
        return rec

    def collectives(self, point, split, step_ms) -> dict:
        """Arithmetic and measured cost of the per-layer all-reduces of a point with ``tp > 1``."""
        cfg, (tp, dp), b = self.cfg(point), split, point["batch"]
        item = jnp.dtype(self.dtype).itemsize
        count = 2 * cfg.num_hidden_layers + 1
        nbytes = count * (b // dp) * cfg.hidden_size * item
        psum = jax.shard_map(lambda v: jax.lax.psum(v, MODEL), mesh=self.mesh_obj, in_specs=P(DATA, None),
                             out_specs=P(DATA, None), check_vma=False)

        def one_ms(rows):
            x = jax.device_put(jnp.ones((rows * dp, cfg.hidden_size), self.dtype),
                               NamedSharding(self.mesh_obj, P(DATA, None)))
            return 1e3 * loop_time(psum, x, (), target_s=0.01 if self.args.smoke else 0.03)

        ms = one_ms(b // dp)
        est = count * ms
        out = {"allreduces_per_step": count, "allreduce_bytes_per_step": nbytes,
               "ring_bytes_per_gpu_per_step": nbytes * 2 * (tp - 1) / tp, "allreduce_ms": ms,
               "collective_ms_per_step_est": est, "collective_share_est": est / step_ms if step_ms else None}
        if point["overlap_chunks"] > 1:
            a, z = row_chunks(b // dp, point["overlap_chunks"])[0]
            out["allreduce_chunk_ms"] = one_ms(z - a)
        return out

    def roofline(self, point, split, step_ms, allreduce_floor_ms) -> dict:
        """The step's floor over all the point's GPUs (module docstring), with measured rates."""
        cfg, (tp, dp), b, p = self.cfg(point), split, point["batch"], point["prefix"]
        gpus, item, s_mean = tp * dp, jnp.dtype(self.dtype).itemsize, self.k / 2
        kv_tok = ec.kv_bytes_per_token(cfg, item)
        tokens = b * (p + s_mean) if point["layout"] == "flat" else dp * p + b * s_mean
        nbytes = dp * ec.param_bytes(cfg, item) + tokens * kv_tok
        matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
        flops = 2.0 * b * matmul_params + 4.0 * b * cfg.num_attention_heads * (p + s_mean) * cfg.head_dim \
            * cfg.num_hidden_layers
        copy_ms = 1e3 * nbytes / (gpus * self.rates["copy_bw_Bps"])
        matmul_ms = 1e3 * flops / (gpus * self.rates["matmul_flops"])
        roof = max(copy_ms, matmul_ms) + allreduce_floor_ms
        return {"roofline_bytes_per_step": nbytes, "roofline_flops_per_step": flops, "roofline_copy_ms": copy_ms,
                "roofline_matmul_ms": matmul_ms, "allreduce_floor_ms": allreduce_floor_ms, "roofline_ms": roof,
                "measured_over_roofline": step_ms / roof if step_ms else None, **self.rates}


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


def make_runner(model, layout: str = "shared"):
    """``run(params, prefix, layers, lengths0, pos0, tokens0, n) -> (layers, tokens)``: ``n``
    greedy decode steps over a ``layout`` cache (vocabulary-parallel argmax on a mesh)."""
    sharded = isinstance(model, ShardedLlama)

    def run(params, prefix, layers, lengths0, pos0, tokens0, n):
        cache = KVCache(prefix=prefix, layers=layers, lengths=lengths0, pos_offset=pos0, backend=layout)
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
    """Speedups over ``single`` per (part, batch, prefix, layout); overlapped ``tp`` over plain
    ``tp``; each ``auto`` choice against the fastest explicit split measured at its shapes."""
    ok = [p for p in data["points"] if p.get("status") == "ok" and p.get("tokens_per_s")]
    shape = lambda p: (p["part"], p["layers"], p["batch"], p["prefix"], p.get("layout", "shared"))  # noqa: E731
    base = {shape(p): p["tokens_per_s"] for p in ok if p["mode"] == "single"}
    plain = {shape(p): p for p in ok if p["mode"] == "tp" and p.get("overlap_chunks", 1) == 1}
    rows, lines = [], []
    for p in ok:
        if p["mode"] == "single":
            continue
        ref, chunks = base.get(shape(p)), p.get("overlap_chunks", 1)
        row = {k: p.get(k) for k in ("part", "mode", "gpus", "tp", "dp", "batch", "prefix", "layout", "overlap_chunks")}
        row.update(tokens_per_s=p["tokens_per_s"], speedup=p["tokens_per_s"] / ref if ref else None,
                   collective_share_est=p.get("collective_share_est"),
                   measured_over_roofline=p.get("measured_over_roofline"))
        line = (f"{p['part']} {p['mode']}{p['gpus']} ({p.get('tp')}x{p.get('dp')}) B={p['batch']} P={p['prefix']} "
                f"{p.get('layout', 'shared')}: {p['tokens_per_s']:.0f} tok/s, "
                + (f"{row['speedup']:.2f}x" if ref else "(no 1-GPU baseline)"))
        if p["mode"] == "tp" and chunks > 1 and shape(p) in plain:
            row["over_plain_tp"] = plain[shape(p)]["step_ms"] / p["step_ms"]
            line += f", overlap {chunks}: {row['over_plain_tp']:.3f}x plain tp"
        if p["mode"] == "auto":
            explicit = [q for q in ok if shape(q) == shape(p) and q["mode"] != "auto"
                        and q.get("overlap_chunks", 1) == 1]
            if explicit:
                best = min(explicit, key=lambda q: q["step_ms"])
                row.update(fastest_mode=best["mode"], auto_over_fastest=p["step_ms"] / best["step_ms"])
                line += f", fastest explicit {best['mode']} (auto at {row['auto_over_fastest']:.3f}x its step)"
        if p.get("roofline_ms"):
            line += f", {p['measured_over_roofline']:.2f}x roofline {p['roofline_ms']:.2f} ms"
        rows.append(row)
        lines.append(line)
    return {"speedups": rows, "lines": lines}


def plot(path: str) -> str:
    """Bar chart of tokens/s per (batch, prefix) and mode of the 8B part (else the 70B part), shared
    layout, next to the result JSON."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    with open(path) as f:
        data = json.load(f)
    ok = [p for p in data["points"] if p.get("status") == "ok" and p.get("tokens_per_s") and p["mode"] != "auto"]
    part = "8b" if any(p["part"] == "8b" for p in ok) else "70b"
    ok = [p for p in ok if p["part"] == part and p.get("layout", "shared") == "shared"]
    if not ok:
        return "(no measured point to plot)"
    label = lambda p: (p["mode"], p["gpus"], p.get("overlap_chunks", 1))  # noqa: E731
    shapes = sorted({(p["batch"], p["prefix"]) for p in ok})
    modes = sorted({label(p) for p in ok}, key=lambda m: (m[1], m[0], m[2]))
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(shapes), 3.6))
    width = 0.8 / max(len(modes), 1)
    for j, m in enumerate(modes):
        vals = [next((p["tokens_per_s"] for p in ok if (p["batch"], p["prefix"]) == s and label(p) == m), 0)
                for s in shapes]
        ax.bar(np.arange(len(shapes)) + j * width, vals, width,
               label=f"{m[0]} x{m[1]}" + (f" overlap {m[2]}" if m[2] > 1 else ""))
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, [f"B={b}\nP={p}" for b, p in shapes])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3.1-{part.upper()} shapes, {data['device_info']['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ec.add_common_args(ap, PART_MODELS)
    ap.add_argument("--gpus", type=int, default=2, help="devices of the tp, dp and auto modes (default 2)")
    ap.add_argument("--modes", nargs="+", default=["single", "tp", "dp", "auto"],
                    choices=("single", "tp", "dp", "auto"))
    ap.add_argument("--overlap-chunks", type=int, nargs="+", default=[1],
                    help="row chunks of the tp points' collective matmul, one point per value (1: plain)")
    ap.add_argument("--layouts", nargs="+", default=None, choices=("shared", "flat"),
                    help="cache layouts (default: shared for 8b, shared and flat for 70b)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="keep these batches of the grid")
    ap.add_argument("--prefixes", type=int, nargs="+", default=None, help="keep these prefixes of the grid")
    ap.add_argument("--layers", type=int, default=None, help="layers of the 8B shapes (default 32)")
    ap.add_argument("--layers-70b", type=int, default=None, help="layers of the 70B shapes (default 80)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="k, generated tokens per sequence (default 128)")
    ap.add_argument("--reps", type=int, default=2, help="timed k-token calls per point")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new point after this many seconds")
    ap.add_argument("--resume", action="store_true", help="add to an existing --out (kept points are not redone)")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    ap.add_argument("--plot-only", action="store_true", help="only draw the plot of the result file")
    args = ap.parse_args(argv)
    ec.finish_args(args, dict(layers=32, layers_70b=80, gen_tokens=128),
                   smoke=dict(layers=2, layers_70b=1, gen_tokens=8))
    if args.gen_tokens < 2:
        ap.error("--gen-tokens must be >= 2 (decode-only time is t(k) - t(1))")
    if args.gpus < 2:
        ap.error("--gpus must be >= 2")
    for chunks in args.overlap_chunks:
        try:
            CollectiveMatmul(overlap_chunks=chunks)
        except ValueError as e:
            ap.error(f"--overlap-chunks: {e}")
    if args.budget_s is not None and args.budget_min is not None:
        ap.error("pass --budget-s or --budget-min, not both")
    if args.out is None:
        name = f"{NAME}_{args.gpus}x{gpu_slug()}.json"
        args.out = (os.path.join(os.path.dirname(ec.default_out_path(NAME, True)), name) if args.smoke else
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name))
    args.commit_measured = args.commit or ec.commit_of_checkout()
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot_only:
        return {"plot": plot(args.out)}
    if len(jax.devices()) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus} needs {args.gpus} devices, {len(jax.devices())} exist")
    if os.path.exists(args.out) and not (args.resume or args.list):
        raise SystemExit(f"{args.out} exists: pass --resume to add this run's points to it, or another --out")
    fixed = {"gen_tokens": args.gen_tokens, "smoke": args.smoke, "dtype": "float32" if args.smoke else "bfloat16",
             "definition": "tokens_per_s = batch * (k - 1) / (t(k) - t(1)); t(n) = one call of n greedy decode "
                           "steps (Hydragen D.1); prefill excluded"}

    def after(store, bench, counts):
        store.note("commit", args.commit_measured)
        store.note("devices", [str(d) for d in jax.devices()[:args.gpus]])
        ec.report_targets(store, targets)
        try:
            print("plot:", plot(store.path))
        except ImportError as e:
            print(f"no plot: {e}")

    budget = ec.Budget(None if args.budget_s is None else args.budget_s / 60) if args.budget_min is None else None
    return ec.measure_plan(args, NAME, KEY_FIELDS, fixed, plan_points(args), Bench, budget=budget, after=after)


if __name__ == "__main__":
    main()
