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
"""
from __future__ import annotations

__all__ = ["attention_floor", "roofline_fields", "annotate", "measure_rates"]


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
