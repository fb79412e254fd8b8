"""Arithmetic floors of the Prompt Cache benchmark (``bench/prompt_cache.py``) and the device
rates they use, measured in the same run.

* ``prefill``: ``max(FLOPs / matmul rate, weight bytes / copy bandwidth)`` of the ``cached +
  new`` tokens of every prompt;
* ``cached_device``: the same for the ``new`` tokens attending to the ``cached`` ones, the
  module K/V bytes (read once for the batch) added to the weight bytes;
* ``cached_host``: ``max(cached_device floor, K/V bytes / host-to-device bandwidth)`` (the
  transfer can overlap the compute of earlier layers, so the larger of the two bounds it).

FLOPs count the seven projections of every layer (2 per weight per token), the attention
scores and weighted sums (``4 Hq D`` per query-key pair per layer, causal among the new tokens)
and the LM head of each prompt's last token.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import measure_copy_bandwidth, time_fn
from models.config import LlamaConfig
from models.prompt_cache.store import kv_bytes_per_token

__all__ = ["floors", "forward_flops", "host_to_device_bandwidth", "layer_matmul_params", "matmul_rate",
           "measure_rates", "weight_bytes"]


def layer_matmul_params(cfg: LlamaConfig) -> int:
    """Weights of one layer's seven projections."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size


def forward_flops(cfg: LlamaConfig, new: int, context: int, batch: int) -> float:
    """FLOPs of ``new`` tokens per prompt attending to ``context`` earlier tokens and causally to
    each other, over ``batch`` prompts, with the LM head of the last token."""
    per_token = 2 * cfg.num_hidden_layers * layer_matmul_params(cfg)
    scores = new * context + new * (new + 1) / 2           # query-key pairs per head and layer
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * scores
    return batch * (new * per_token + attn + 2 * cfg.hidden_size * cfg.vocab_size)


def weight_bytes(params: dict) -> int:
    """Bytes a forward pass reads of the weights (the embedding table only as the LM head when tied)."""
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return total - (params["embed"].nbytes if params.get("lm_head") is not None else 0)


def floors(cfg: LlamaConfig, params: dict, point: dict, rates: dict) -> dict:
    """Floors (seconds) of the three paths (module docstring)."""
    c, n, b = point["cached"], point["new"], point["batch"]
    itemsize = np.dtype(params["embed"].dtype).itemsize
    kv = c * kv_bytes_per_token(cfg, params["embed"].dtype)
    w = weight_bytes(params)
    pre = max(forward_flops(cfg, c + n, 0, b) / rates["matmul_flops"], w / rates["copy_bw_Bps"])
    dev = max(forward_flops(cfg, n, c, b) / rates["matmul_flops"], (w + kv) / rates["copy_bw_Bps"])
    h2d = rates.get("h2d_bw_Bps")
    return {"prefill": pre, "cached_device": dev, "cached_host": max(dev, kv / h2d) if h2d else None,
            "kv_bytes": kv, "weight_bytes": w, "dtype_itemsize": itemsize}


def matmul_rate(dtype, n: int, iters: int) -> float:
    """FLOP/s of an XLA ``n^3`` matmul in ``dtype`` (best of ``iters``)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    return 2 * n ** 3 / time_fn(jax.jit(jnp.matmul), [(a, a)], warmup=2, iters=iters, stat="min")


def host_to_device_bandwidth(nbytes: int, iters: int = 5) -> float:
    """Bytes/s of ``jax.device_put`` of a NumPy array (pageable host memory, as the host tier's)."""
    x = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(x))
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def measure_rates(dtype, *, gpu: bool, smoke: bool) -> dict:
    """Matmul rate, copy bandwidth and host-to-device bandwidth of this device."""
    size = 1 << 30 if gpu else 1 << 26
    return {"matmul_flops": matmul_rate(dtype, 8192 if gpu else 256 if smoke else 1024, 20 if gpu else 3),
            "copy_bw_Bps": measure_copy_bandwidth(size if gpu else 1 << 24),
            "h2d_bw_Bps": host_to_device_bandwidth(size)}
