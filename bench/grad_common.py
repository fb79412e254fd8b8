"""Shared parts of the gradient benchmarks (``shared_prefix_grad.py``, ``tree_attention_grad.py``):
each column is a compiled ``jit(grad)``, timed, with XLA's temporary memory recorded, its
gradients compared with a base column's, and its time and memory put against the ``kernels``
column's."""
from __future__ import annotations

import jax
import numpy as np

from bench.timing import is_oom, time_fn


def measure_columns(rec: dict, cols, compile_col, args, iters: int) -> dict:
    """For each column: ``compile_col(col)`` -> compiled function of ``args``; records
    ``<col>_temp_bytes`` and ``<col>_ms`` (``"X"`` when out of memory, else the error) in ``rec``
    and returns the gradients of the columns that ran."""
    grads = {}
    for col in cols:
        try:
            compiled = compile_col(col)
            mem = compiled.memory_analysis()
            rec[f"{col}_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", -1)) if mem else None
            grads[col] = jax.block_until_ready(compiled(*args))
            rec[f"{col}_ms"] = 1e3 * time_fn(compiled, [args], warmup=2, iters=iters)
        except Exception as exc:  # noqa: BLE001
            rec[f"{col}_ms"] = "X" if is_oom(exc) else f"error: {type(exc).__name__}: {str(exc)[:300]}"
    return grads


def compare_grads(rec: dict, grads: dict, base: str, names) -> None:
    """``<col>_rel_err_vs_<base>`` (relative error per named input, float32) and ``<col>_finite``
    of every column against the ``base`` column's gradients, when the base ran."""
    if base not in grads:
        return
    ref = grads[base]
    for col, gr in grads.items():
        if col == base:
            continue
        rec[f"{col}_rel_err_vs_{base}"] = {
            n: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(r, np.float32))
                     / max(np.linalg.norm(np.asarray(r, np.float32)), 1e-30))
            for n, a, r in zip(names, gr, ref)}
        rec[f"{col}_finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in gr))


def kernel_ratios(rec: dict, cols) -> None:
    """``kernels_over_floor``, and ``<col>_over_kernels`` / ``<col>_temp_over_kernels`` of the other
    columns, when the ``kernels`` column ran."""
    t_k = rec.get("kernels_ms")
    if not isinstance(t_k, float):
        return
    rec["kernels_over_floor"] = t_k / rec["floor_ms"]
    for col in cols:
        if col == "kernels":
            continue
        t = rec.get(f"{col}_ms")
        if isinstance(t, float):
            rec[f"{col}_over_kernels"] = t / t_k
        tb = rec.get(f"{col}_temp_bytes")
        if tb and rec.get("kernels_temp_bytes"):
            rec[f"{col}_temp_over_kernels"] = tb / rec["kernels_temp_bytes"]


def print_row(label: str, rec: dict, cols, base: str) -> None:
    """One line per point: floor, each column's time and temporary memory, the kernels' error."""
    fmt = lambda v: f"{v:8.3f}" if isinstance(v, float) else f"{str(v)[:8]:>8}"  # noqa: E731
    errs = rec.get(f"kernels_rel_err_vs_{base}") or {0: 0}
    print(f"{label} | floor {rec['floor_ms']:.3f} ms | "
          + " ".join(f"{c} {fmt(rec.get(c + '_ms'))}" for c in cols)
          + " | temp MB " + " ".join(f"{(rec.get(c + '_temp_bytes') or 0) / 2**20:.0f}" for c in cols)
          + f" | err {max(errs.values()):.1e}", flush=True)
