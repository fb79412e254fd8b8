"""The decode step's roofline for the model benchmarks (``e2e_decode``, ``long_document``,
``decode_step``): ``roofline = none + layers x attention floor``.

``none`` (the attention product skipped, projections, MLP, LM head kept) is measured; the
attention floor of one layer is ``max(bytes / copy bandwidth, flops / matmul rate)`` of the
shared path at the point's mean suffix length: bytes = the prefix's keys and values once + every
sequence's suffix + q and out, flops = ``4 B Tq Hq (P + S) D`` (the floor of
``bench/shared_prefix.py`` with ``Tq`` queries per sequence).  Both rates are measured in the
same run.  A point then records ``roofline_ms``, ``measured_over_roofline`` (>= 1; 1 = on the
roofline) and ``roofline_fraction`` (its inverse: the share of the roofline reached), beside the
``shared / none`` ratio.

DeepSeek (MLA + MoE, ``e2e_decode_mla``) has no ``none`` point: its roofline is the whole step's,
:func:`mla_moe_step_cost` and :func:`mla_moe_roofline`.  Bytes per step: every weight read once
(the mixture-of-experts layers: the router, the shared experts and the routed experts that
``B`` tokens can touch, ``min(E, B x K)``; the embedding: the ``B`` rows gathered; the LM head
whole), the latent cache (``shared``: the prefix once + every sequence's suffix; ``flat``: the
prefix per sequence + its suffix), the new latents written and the absorbed queries and outputs;
flops: ``2 B`` per matrix parameter a token uses (absorbed MLA: ``W_UK`` on the query and
``W_UV`` on the output; ``K`` routed + the shared experts) + attention
``2 B Hn (P + S) (2 R + Dr)`` per layer.  A step's floor is ``max(bytes / copy bandwidth,
flops / matmul rate)``, at each step's own suffix length.
"""
from __future__ import annotations

__all__ = ["attention_floor", "roofline_fields", "annotate", "measure_rates", "mla_moe_step_cost",
           "mla_moe_roofline"]


def attention_floor(*, batch: int, tq: int, prefix: float, suffix: float, heads_q: int, heads_kv: int,
                    head_dim: int, bw: float, mma: float, itemsize: int = 2) -> dict:
    """``{"ms", "bytes", "flops"}`` of one layer's shared-prefix attention (see the module doc)."""
    nbytes = (prefix + batch * suffix) * 2 * heads_kv * head_dim * itemsize + 2 * batch * tq * heads_q * head_dim * itemsize
    flops = 4.0 * batch * tq * heads_q * (prefix + suffix) * head_dim
    return {"ms": max(nbytes / bw, flops / mma) * 1e3, "bytes": float(nbytes), "flops": flops}


def measure_rates(small: bool) -> dict:
    """``{"copy_bw_Bps", "matmul_flops"}`` of this device (tiny sizes with ``small``: CPU runs)."""
    from bench.timing import measure_copy_bandwidth, measure_matmul_rate  # noqa: PLC0415
    return {"copy_bw_Bps": measure_copy_bandwidth(1 << 22 if small else 1 << 30),
            "matmul_flops": measure_matmul_rate(128 if small else 8192)}


def roofline_fields(measured_ms: float | None, none_ms: float | None, layers: int,
                    floor_ms_per_layer: float | None) -> dict:
    """``roofline_ms``, ``measured_over_roofline``, ``roofline_fraction`` (empty when an input is
    missing)."""
    if measured_ms is None or none_ms is None or floor_ms_per_layer is None or measured_ms <= 0:
        return {}
    roof = none_ms + layers * floor_ms_per_layer
    return {"roofline_ms": roof, "measured_over_roofline": measured_ms / roof,
            "roofline_fraction": roof / measured_ms}


def annotate(points: list[dict], *, time_key: str, group: tuple[str, ...], scale: float = 1.0) -> int:
    """Adds :func:`roofline_fields` to every finished ``shared`` / ``flat`` point with an
    ``attn_floor_ms_per_layer``, against the finished ``none`` point of the same ``group`` fields
    (``time_key`` in seconds times ``scale`` gives milliseconds); ``shared`` points also get
    ``shared_over_none_time``.  Returns the number of points annotated."""
    nones = {tuple(p.get(k) for k in group): p for p in points
             if p.get("backend") == "none" and p.get("status") == "ok" and p.get(time_key) is not None}
    n = 0
    for p in points:
        if p.get("backend") not in ("shared", "flat") or p.get("status") != "ok" or p.get(time_key) is None:
            continue
        none = nones.get(tuple(p.get(k) for k in group))
        if none is None:
            continue
        f = roofline_fields(p[time_key] * scale, none[time_key] * scale, p["layers"], p.get("attn_floor_ms_per_layer"))
        if f:
            p.update(f)
            n += 1
        if p["backend"] == "shared":
            p["shared_over_none_time"] = p[time_key] / none[time_key]
    return n


def _mla_moe_weights(c, batch: int) -> tuple[float, float, int]:
    """``(weight elements read, matrix elements a token multiplies, routed experts touched)`` of
    one decode step of ``batch`` tokens through DeepSeek config ``c``."""
    h, hn, r, dr = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    q_out = hn * (c.qk_nope_head_dim + dr)
    wq = h * q_out if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank * q_out
    attn_mats = wq + h * (r + dr) + r * hn * (c.qk_nope_head_dim + c.v_head_dim) + hn * c.v_head_dim * h
    attn_norms = 2 * h + r + (c.q_lora_rank or 0)
    read, used, touched = 0.0, 0.0, 0
    for i in range(c.num_hidden_layers):
        read += attn_mats + attn_norms
        used += attn_mats
        if not c.is_moe_layer(i):
            read += 3 * h * c.intermediate_size
            used += 3 * h * c.intermediate_size
            continue
        e, k, f = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
        touched = min(e, batch * k)
        shared = 3 * h * f * (c.n_shared_experts or 0)
        read += h * e + touched * 3 * h * f + shared + (e if c.topk_method == "noaux_tc" else 0)
        used += h * e + k * 3 * h * f + shared
    read += h + batch * h + h * c.vocab_size              # final norm, embedding rows, LM head
    used += h * c.vocab_size
    return read, used, touched


def mla_moe_step_cost(config, *, batch: int, prefix: int, suffix: float, shared: bool,
                      itemsize: int = 2) -> dict:
    """``{"bytes", "flops", "weight_bytes", "cache_bytes", "experts_touched"}`` of one decode
    step of a DeepSeek decoder (``config``: a :class:`models.deepseek.config.DeepseekConfig`)
    for ``batch`` sequences after a prompt of ``prefix`` tokens, ``suffix`` tokens each visible
    after it (the new one included); ``shared``: the prompt's latents stored once, else once per
    sequence (the module docstring)."""
    c = config
    r, w, hn, layers = c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim, c.num_attention_heads, c.num_hidden_layers
    read, used, touched = _mla_moe_weights(c, batch)
    tokens = (prefix + batch * suffix) if shared else batch * (prefix + suffix)
    cache = layers * (tokens + batch) * w * itemsize                      # read + the new latents written
    io = layers * batch * hn * (w + r) * itemsize                          # absorbed queries, outputs
    flops = 2.0 * batch * used + layers * 2.0 * batch * hn * (prefix + suffix) * (w + r)
    return {"bytes": read * itemsize + cache + io, "flops": flops, "weight_bytes": read * itemsize,
            "cache_bytes": float(cache), "experts_touched": touched}


def mla_moe_roofline(config, *, batch: int, prefix: int, steps: int, shared: bool, bw: float, mma: float,
                     itemsize: int = 2) -> dict:
    """The roofline of ``steps`` decode steps (step ``j`` sees ``j`` suffix tokens):
    ``roofline_ms`` (all ``steps``), ``roofline_step_ms`` (the mean of steps ``2..steps``, the
    ones a ``t(k) - t(1)`` measurement times), the bound of the last step and
    :func:`mla_moe_step_cost` at the mean suffix ``(steps + 2) / 2``."""
    def step_s(j):
        cost = mla_moe_step_cost(config, batch=batch, prefix=prefix, suffix=j, shared=shared, itemsize=itemsize)
        return max(cost["bytes"] / bw, cost["flops"] / mma), cost
    per = [step_s(j)[0] for j in range(1, steps + 1)]
    last = step_s(steps)[1]
    timed = per[1:] or per
    mean = mla_moe_step_cost(config, batch=batch, prefix=prefix, suffix=(steps + 2) / 2, shared=shared,
                             itemsize=itemsize)
    return {"roofline_ms": 1e3 * sum(per), "roofline_step_ms": 1e3 * sum(timed) / len(timed),
            "roofline_bound": "memory" if last["bytes"] / bw >= last["flops"] / mma else "compute",
            "roofline_bytes_per_step": mean["bytes"], "roofline_flops_per_step": mean["flops"],
            "roofline_weight_bytes_per_step": mean["weight_bytes"],
            "roofline_cache_bytes_per_step": mean["cache_bytes"], "experts_touched": mean["experts_touched"]}
