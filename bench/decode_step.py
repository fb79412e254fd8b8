"""Decode-step time of a Llama-3.1-8B-shaped decoder (random bf16 weights) for the attention
backends "shared", "flat" and "none".

Setting: ``B`` sequences share one prefix of ``P`` tokens and each has ``S`` suffix tokens in its
cache; one decode step feeds one token per sequence (all layers + LM head).

* "shared": the prefix is stored once; attention = shared_prefix_attention (prefix + suffix);
* "flat":   every sequence holds its own copy of the prefix (FlashAttention baseline);
* "none":   no attention product (projections kept): the throughput upper bound.

Timing: ``--steps`` dependent decode steps run inside one jitted ``fori_loop`` (the cache is
carried and donated; lengths are reset at each call so every call does the same work); the
median over ``--iters`` calls is divided by ``--steps``.  Correctness in the same run: the logits
of "shared" and "flat" after the same steps from identical cache contents are compared (bf16).

Memory: 32 layers of 8B weights plus a flat cache of B=256 x 2176 tokens do not fit in 80 GB,
so every backend is measured with the same reduced layer counts (``--layers``, default 8 and 16;
per-layer time = difference / difference of layers, which removes embedding + LM head), plus the
full 32 layers when memory (flat: H200 only) and the time budget allow.  Two layer layouts:
``list`` (unrolled layers, each KV buffer its own array) and ``stacked`` (``lax.scan``).

Roofline (``bench/roofline.py``): every run records ``attn_floor_ms_per_layer`` (the shared path's
bytes and flops at the calls' mean suffix ``S + (steps + 1) / 2``, with the copy bandwidth and
matmul rate measured in the same run) and ``roofline`` / ``roofline_flat``: ``roofline_ms = none
step_ms + layers x floor``, ``measured_over_roofline``, ``roofline_fraction`` (beside
``shared_throughput_vs_none``); ``per_layer`` adds ``per_layer_roofline_ms = none per layer +
floor`` and the shared path's fraction of it.

Usage: ``python bench/decode_step.py --out bench/results/decode_step_h100.json``
(``--small`` for a CPU smoke run with tiny shapes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax_prefix_attn  # noqa: E402
from bench import roofline  # noqa: E402
from bench.e2e_common import commit_of_checkout  # noqa: E402
from bench.timing import device_info, is_oom  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.kv_cache import KVCache, PrefixCache, empty_prefix_cache  # noqa: E402
from models.llama import Llama  # noqa: E402

T0 = time.perf_counter()


def _normal(key, shape, dtype, std=1.0):
    return (jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)


def make_params(cfg: LlamaConfig, key, dtype, stacked: bool) -> dict:
    """Random parameters built layer by layer (no big stacked temporaries)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"wq": (h, hq), "wk": (h, hkv), "wv": (h, hkv), "wo": (hq, h),
              "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)}
    layers = []
    for i in range(cfg.num_hidden_layers):
        ks = jax.random.split(jax.random.fold_in(key, i), len(shapes) + 2)
        lp = {n: _normal(k, s, dtype, 0.02) for k, (n, s) in zip(ks, shapes.items())}
        lp["attn_norm"] = 1 + _normal(ks[-2], (h,), dtype, 0.1)
        lp["mlp_norm"] = 1 + _normal(ks[-1], (h,), dtype, 0.1)
        layers.append(lp)
    if stacked:
        layers = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 10_000), 3)
    params = {"embed": _normal(k1, (cfg.vocab_size, h), dtype), "layers": layers,
              "final_norm": 1 + _normal(k2, (h,), dtype, 0.1)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _normal(k3, (h, cfg.vocab_size), dtype, 0.02)
    return jax.block_until_ready(params)


def make_caches(cfg, key, b, p, s, cap, dtype, stacked, want_flat):
    """Shared cache (prefix once + suffix buffers) and, optionally, the equivalent flat layers."""
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    shared_layers, prefix_layers, flat_layers = [], [], []
    for i in range(cfg.num_hidden_layers):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, i), 4)
        pk, pv = _normal(k1, (1, p, hkv, d), dtype), _normal(k2, (1, p, hkv, d), dtype)
        sk, sv = _normal(k3, (b, cap, hkv, d), dtype), _normal(k4, (b, cap, hkv, d), dtype)
        prefix_layers.append({"k": (pk,), "v": (pv,)})
        shared_layers.append({"k": sk, "v": sv})
        if want_flat:
            cat = lambda pre, suf: jnp.concatenate(  # noqa: E731
                [jnp.broadcast_to(pre, (b, p, hkv, d)), suf], axis=1)
            flat_layers.append({"k": cat(pk, sk), "v": cat(pv, sv)})
    if stacked:
        stack = lambda ls: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *ls)  # noqa: E731
        shared_layers, prefix_layers = stack(shared_layers), stack(prefix_layers)
        flat_layers = stack(flat_layers) if want_flat else None
    prefix = PrefixCache(layers=prefix_layers, lengths=(jnp.full((1,), p, jnp.int32),),
                         last_logits=jnp.zeros((1, cfg.vocab_size), jnp.float32))
    return jax.block_until_ready((prefix, shared_layers, flat_layers if want_flat else None))


def make_runner(model: Llama):
    def run(params, prefix, layers, lengths0, pos_offset, tokens, *, backend, n):
        cache = KVCache(prefix=prefix, layers=layers, lengths=lengths0, pos_offset=pos_offset, backend=backend)

        def body(_, carry):
            cache, _ = carry
            logits, cache = model.decode_step(params, cache, tokens)
            return cache, logits

        init = (cache, jnp.zeros((tokens.shape[0], model.config.vocab_size), jnp.float32))
        cache, logits = jax.lax.fori_loop(0, n, body, init)
        return cache.layers, logits

    return jax.jit(run, static_argnames=("backend", "n"), donate_argnames=("layers",))


def time_backend(run, params, prefix, layers, lengths0, pos_offset, tokens, backend, steps, iters):
    t = time.perf_counter()
    layers, logits = run(params, prefix, layers, lengths0, pos_offset, tokens, backend=backend, n=steps)
    logits = np.asarray(jax.device_get(logits))
    first_s = time.perf_counter() - t
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        layers, out = run(params, prefix, layers, lengths0, pos_offset, tokens, backend=backend, n=steps)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return statistics.median(times) / steps, logits, first_s, layers


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--layers", default="8,16", help="layer counts measured for all three backends")
    ap.add_argument("--full-layers", type=int, default=32, help="also measure this depth (0: off)")
    ap.add_argument("--layouts", default="list,stacked")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip further experiments after this")
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args()

    cfg0 = LlamaConfig.preset("Llama-3.1-8B")
    if args.small:
        cfg0 = cfg0.replace(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, bos_token_id=1, eos_token_ids=(2,))
        args.batch, args.prefix, args.suffix, args.full_layers = 8, 64, 16, 4
        args.layers, args.steps, args.iters = "1,2", 2, 2
    dtype = jnp.bfloat16
    b, p, s = args.batch, args.prefix, args.suffix
    cap = s + args.steps
    dev = jax.devices()[0]
    mem_limit = (dev.memory_stats() or {}).get("bytes_limit") if hasattr(dev, "memory_stats") else None

    result = {"benchmark": "decode_step", "model": "Llama-3.1-8B shapes (random bf16 weights)",
              "config": {k: getattr(cfg0, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim", "vocab_size")},
              "batch": b, "prefix_len": p, "suffix_len": s, "steps_per_call": args.steps, "iters": args.iters,
              "device_info": device_info(), "commit": args.commit or commit_of_checkout(),
              "memory_limit_bytes": mem_limit, "runs": [], "errors": [],
              "notes": ("'none' skips the attention product (functionally wrong, upper bound). Every backend is "
                        "measured at the same reduced layer counts (per_layer_ms = difference between two layer "
                        "counts: embedding + LM head cancel), and at the full depth where it fits (32 layers of 8B "
                        f"weights + a flat cache of {b}x{p + cap} tokens need more than 80 GB). Layout 'list' = "
                        "unrolled layers, one KV buffer per layer; 'stacked' = lax.scan over stacked arrays (XLA "
                        "copies the per-layer slices).")}
    try:
        result["shared_prefix_auto_path"] = jax_prefix_attn.plan_shared_prefix(
            batch=b, tq=1, heads_q=cfg0.num_attention_heads, heads_kv=cfg0.num_key_value_heads,
            head_dim=cfg0.head_dim, groups=1, prefix_len=p, suffix_len=cap, dtype=dtype).impl
    except Exception as e:  # noqa: BLE001 - informative only
        result["shared_prefix_auto_path"] = f"unavailable: {e!r}"

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    try:
        rates = roofline.measure_rates(args.small)
        result["copy_bandwidth_Bps"], result["matmul_flops"] = rates["copy_bw_Bps"], rates["matmul_flops"]
        mean_s = s + (args.steps + 1) / 2
        result["attn_floor_mean_suffix"] = mean_s
        result["attn_floor_ms_per_layer"] = roofline.attention_floor(
            batch=b, tq=1, prefix=p, suffix=mean_s, heads_q=cfg0.num_attention_heads,
            heads_kv=cfg0.num_key_value_heads, head_dim=cfg0.head_dim, bw=rates["copy_bw_Bps"],
            mma=rates["matmul_flops"], itemsize=jnp.dtype(dtype).itemsize)["ms"]
    except Exception as e:  # noqa: BLE001
        result["errors"].append(f"rate measurement: {e!r}")
    floor = result.get("attn_floor_ms_per_layer")
    save()

    # order: the first layout at every depth (incl. the full model), then the other layouts
    plan = []
    for i, layout in enumerate(args.layouts.split(",")):
        for nl in [int(x) for x in args.layers.split(",")]:
            plan.append((layout, nl, ("flat", "shared", "none")))
        if i == 0 and args.full_layers:
            plan.append((layout, args.full_layers, ("flat", "shared", "none")))  # flat only if it fits

    key = jax.random.PRNGKey(0)
    tokens = jax.random.randint(jax.random.fold_in(key, 7), (b,), 0, cfg0.vocab_size, jnp.int32)
    for layout, nl, backends in plan:
        if time.perf_counter() - T0 > args.budget_s:
            result["errors"].append(f"skipped {layout} L={nl}: time budget ({args.budget_s}s) spent")
            save()
            continue
        cfg = cfg0.replace(num_hidden_layers=nl)
        model = Llama(cfg)
        run = make_runner(model)
        stacked = layout == "stacked"
        entry = {"layout": layout, "layers": nl, "backends": {}}
        result["runs"].append(entry)
        params = prefix = shared_layers = flat_layers = None
        try:
            params = make_params(cfg, jax.random.fold_in(key, nl), dtype, stacked)
            flat_bytes = 2 * nl * b * (p + cap) * cfg.num_key_value_heads * cfg.head_dim * 2
            want_flat = "flat" in backends
            if want_flat and mem_limit and flat_bytes + 2 * cfg.num_params() > 0.85 * mem_limit:
                entry["backends"]["flat"] = {"skipped": f"flat cache {flat_bytes / 2**30:.1f} GiB does not fit"}
                want_flat = False
            prefix, shared_layers, flat_layers = make_caches(cfg, jax.random.fold_in(key, 100 + nl), b, p, s, cap,
                                                             dtype, stacked, want_flat)
            logits = {}
            for backend in backends:
                if backend == "flat" and not want_flat:
                    continue
                if time.perf_counter() - T0 > args.budget_s:
                    entry["backends"][backend] = {"skipped": "time budget spent"}
                    continue
                try:
                    if backend == "flat":
                        pre = empty_prefix_cache(cfg, dtype, stacked=stacked)
                        lengths0, pos0 = jnp.full((b,), p + s, jnp.int32), jnp.zeros((b,), jnp.int32)
                        layers_in = flat_layers
                        flat_layers = None
                    else:
                        pre = prefix
                        lengths0, pos0 = jnp.full((b,), s, jnp.int32), jnp.full((b,), p, jnp.int32)
                        layers_in, shared_layers = shared_layers, None
                    t_step, lg, first_s, layers_out = time_backend(run, params, pre, layers_in, lengths0, pos0,
                                                                   tokens, backend, args.steps, args.iters)
                    if backend != "flat":
                        shared_layers = layers_out  # reuse the buffers for the next backend
                    del layers_out
                    logits[backend] = lg
                    entry["backends"][backend] = {"step_ms": 1e3 * t_step, "tokens_per_s": b / t_step,
                                                  "compile_and_first_call_s": first_s,
                                                  "logits_finite": bool(np.isfinite(lg).all())}
                except Exception as e:  # noqa: BLE001
                    msg = repr(e)
                    entry["backends"][backend] = {"error": ("OOM: " if is_oom(e) else "") + msg[:800]}
                    traceback.print_exc()
                print(layout, nl, backend, entry["backends"][backend], f"t={time.perf_counter() - T0:.0f}s",
                      flush=True)
                save()
            if "shared" in logits and "flat" in logits:
                entry["rel_err_logits_shared_vs_flat"] = rel_err(logits["shared"], logits["flat"])
            bk = entry["backends"]
            if "step_ms" in bk.get("shared", {}) and "step_ms" in bk.get("none", {}):
                entry["shared_throughput_vs_none"] = bk["none"]["step_ms"] / bk["shared"]["step_ms"]
            none_ms = bk.get("none", {}).get("step_ms")
            for backend, name in (("shared", "roofline"), ("flat", "roofline_flat")):
                fields = roofline.roofline_fields(bk.get(backend, {}).get("step_ms"), none_ms, nl, floor)
                if fields:
                    entry[name] = fields
        except Exception as e:  # noqa: BLE001
            entry["error"] = repr(e)[:800]
            traceback.print_exc()
        finally:
            del params, prefix, shared_layers, flat_layers
        save()

    # per-layer times from pairs of depths (same layout): (t[L2] - t[L1]) / (L2 - L1)
    per_layer = {}
    depths = {int(x) for x in args.layers.split(",")}
    for layout in args.layouts.split(","):
        runs = sorted((r for r in result["runs"] if r["layout"] == layout and r["layers"] in depths),
                      key=lambda r: r["layers"])
        for backend in ("shared", "flat", "none"):
            pts = [(r["layers"], r["backends"][backend]["step_ms"]) for r in runs
                   if "step_ms" in r["backends"].get(backend, {})]
            if len(pts) >= 2:
                (l1, t1), (l2, t2) = pts[0], pts[-1]
                per_layer.setdefault(layout, {})[backend] = {"per_layer_ms": (t2 - t1) / (l2 - l1),
                                                             "from_layers": [l1, l2],
                                                             "est_32_layer_step_ms": t1 + (32 - l1) * (t2 - t1) / (l2 - l1)}
        pl = per_layer.get(layout, {})
        if "shared" in pl and "none" in pl:
            pl["shared_per_layer_throughput_vs_none"] = pl["none"]["per_layer_ms"] / pl["shared"]["per_layer_ms"]
        if "flat" in pl and "none" in pl:
            pl["flat_per_layer_throughput_vs_none"] = pl["none"]["per_layer_ms"] / pl["flat"]["per_layer_ms"]
        if "shared" in pl and "none" in pl and floor is not None:
            pl["per_layer_roofline_ms"] = pl["none"]["per_layer_ms"] + floor
            pl["shared_per_layer_roofline_fraction"] = pl["per_layer_roofline_ms"] / pl["shared"]["per_layer_ms"]
    result["per_layer"] = per_layer
    result["total_s"] = time.perf_counter() - T0
    save()
    print(json.dumps({"per_layer": per_layer, "errors": result["errors"]}, indent=1))


if __name__ == "__main__":
    main()
