"""Our columns of ``bench/peers.py``: ``shared_prefix_attention`` / ``tree_attention`` timed with
:func:`bench.timing.loop_time` (dependent calls in one jitted loop whose body is one CUDA graph,
``GRAPH_ALWAYS``), the loop's own cost with an identity body, and our output for the parity of
the other columns.

Columns (``<col>_ms``):

* ``ours_auto``: ``impl="auto"`` as a user calls it (``ours_auto_impl`` / ``ours_auto_path``:
  the planner's family and leaf; for trees ``auto_path``'s schedule);
* ``ours_shared`` / ``ours_flat``: the planner's leaf of each family (a leaf already timed is
  not compiled again: ``<col>_source`` names the column whose time it is);
* with ``paths``: ``ours_path_<leaf>`` for every leaf of ``jax_prefix_attn.planner`` (a leaf
  that cannot run the shapes records ``"n/a"`` and why), for trees ``ours_<schedule>`` for
  ``hybrid``, ``levelwise``, ``flatten``, ``nodes``;
* ``ours_auto_u<k>`` (small points): ``ours_auto`` with ``k`` dependent calls per loop
  iteration, so one CUDA graph holds ``k`` calls and the loop's per-iteration cost is shared by
  them: the same shape of harness as a CUDA graph of many calls;
* ``jax_loop_identity`` / ``jax_loop_identity_u<k>`` (small points): the same loops with an
  identity body (the per-call cost of the harness itself: loop iteration + the perturbation of
  the next query); :func:`harness_ms` measures them once per run at one shape.
"""
from __future__ import annotations

import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import GRAPH_ALWAYS, LOOP_COUNTS, is_oom, loop_time
from jax_prefix_attn import (auto_path, build_tree_metadata, device_info, plan_shared_prefix,
                             shared_prefix_attention, tree_attention)
from jax_prefix_attn.device import H100_SXM
from jax_prefix_attn.planner import FLAT_PATHS, SHARED_PATHS

__all__ = ["OursConfig", "measure", "retime_auto", "loop_calls", "harness_ms", "identity", "TREE_SCHEDULES"]

TREE_SCHEDULES = ("hybrid", "levelwise", "flatten", "nodes")


@dataclasses.dataclass(frozen=True)
class OursConfig:
    """``interpret``: Pallas interpret mode, plans made for an H100 SXM (CPU); ``impl``:
    ``"planned"`` (the library's kernels) or ``"reference"`` (its pure-JAX path: cheap CPU smoke
    runs); ``paths``: also every forced leaf / schedule; ``unroll``: calls per iteration of the
    unrolled loop; ``n``: a fixed trip count (else from the floor); ``reps``: timed calls;
    ``reference_below``: check ours against the reference where ``B * Hq * context`` is below."""
    interpret: bool = False
    impl: str = "planned"
    paths: bool = False
    unroll: int = 8
    n: int | None = None
    reps: int = 3
    reference_below: int = 1 << 27


def loop_calls(pred_s: float, target_s: float = 0.03) -> int:
    """The trip count of :data:`LOOP_COUNTS` (at least 16) for calls of about ``pred_s``."""
    want = target_s / max(pred_s, 1e-6)
    return max([c for c in LOOP_COUNTS if 16 <= c <= want], default=16)


def _err(e) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def _single_fn(plan, interpret):
    def f(q, pk, pv, sk, sv, sl):
        return shared_prefix_attention(q[:, None], pk, pv, sk, sv, suffix_lengths=sl, plan=plan,
                                       interpret=interpret)[:, 0]
    return f


def _tree_fn(impl, interpret):
    def f(q, meta, kp, vp, sk, sv, sl):
        return tree_attention(q[:, None], meta, kp, vp, sk, sv, suffix_lengths=sl, impl=impl,
                              interpret=interpret)[:, 0]
    return f


def _columns(point, inputs, cfg, rec):
    """``([(column, fn)], args, reference fn)`` of the point; fills the plan fields of ``rec``."""
    tree, _, q, kp, vp, sk, sv, sl = inputs
    hq, hkv, d = point["heads_q"], point["heads_kv"], point["head_dim"]
    if point["kind"] == "tree":
        meta = build_tree_metadata(tree, tq=1, group=hq // hkv, pool_size=kp.shape[0])
        interp = cfg.interpret and cfg.impl != "reference"
        args = (meta, kp, vp, sk, sv, sl)
        def ref(q, meta, kp, vp, sk, sv, sl):   # the reference gathers paths from the tree itself
            return tree_attention(q[:, None], tree, kp, vp, sk, sv, suffix_lengths=sl,
                                  impl="reference")[:, 0]
        if cfg.impl == "reference":
            return [("ours_auto", ref)], args, ref
        rec["ours_auto_path"] = auto_path(meta, q[:, None], sk)
        cols = [("ours_auto", _tree_fn("auto", interp))]
        cols += [(f"ours_{x}", _tree_fn(x, interp)) for x in (TREE_SCHEDULES if cfg.paths else ())]
        return cols, args, ref
    dev = H100_SXM if cfg.interpret else device_info()

    def plan(impl="auto", path=None):
        return plan_shared_prefix(batch=point["batch"], tq=1, heads_q=hq, heads_kv=hkv, head_dim=d,
                                  groups=1, prefix_len=point["prefix"], suffix_len=point["suffix"],
                                  dtype=jnp.bfloat16, impl=impl, path=path, device=dev,
                                  interpret=cfg.interpret)
    args = (kp, vp, sk, sv, sl)
    ref = _single_fn(plan("reference"), False)
    if cfg.impl == "reference":
        return [("ours_auto", ref)], args, ref
    auto = plan()
    rec["ours_auto_impl"], rec["ours_auto_path"] = auto.impl, auto.path
    cols, timed = [("ours_auto", _single_fn(auto, cfg.interpret))], {auto.path: "ours_auto"}
    wanted = [(f"ours_{impl}", impl, None) for impl in ("shared", "flat")]
    if cfg.paths:
        wanted += [(f"ours_path_{leaf}", "auto", leaf) for leaf in FLAT_PATHS + SHARED_PATHS]
    for name, impl, path in wanted:
        try:
            p = plan(impl, path)
        except ValueError as e:
            rec[f"{name}_ms"], rec[f"{name}_why"] = "n/a", str(e)[:300]
            continue
        rec[f"{name}_path"] = p.path
        if p.path in timed:
            rec[f"{name}_source"] = timed[p.path]
            continue
        timed[p.path] = name
        cols.append((name, _single_fn(p, cfg.interpret)))
    return cols, args, ref


def identity(q):
    """The empty body of the harness measurements."""
    return q


def harness_ms(q, cfg: OursConfig) -> dict:
    """The JAX loop's per-call cost with an identity body at ``q``'s shape, one call and
    ``cfg.unroll`` calls per iteration."""
    kw = dict(compiler_options=GRAPH_ALWAYS, n=cfg.n or 256, reps=cfg.reps)
    return {"shape": list(q.shape), "ms": loop_time(identity, q, (), **kw) * 1e3,
            f"u{cfg.unroll}_ms": loop_time(identity, q, (), unroll=cfg.unroll, **kw) * 1e3}


def retime_auto(point, inputs, cfg: OursConfig, n: int) -> float | str:
    """``ours_auto`` timed again (ms, or the error): for points first timed while another
    process loaded the CPU."""
    try:
        cols, args, _ = _columns(point, inputs, cfg, {})
        return loop_time(cols[0][1], inputs[2], args, compiler_options=GRAPH_ALWAYS, n=n, reps=cfg.reps) * 1e3
    except Exception as e:  # noqa: BLE001
        return _err(e)


def measure(point, inputs, cfg: OursConfig, floor_ms: float, *, log=print) -> tuple[dict, np.ndarray | None]:
    """Our columns of one point (see the module doc) and our ``impl="auto"`` output
    ``[B, Hq, D]`` as float32 on the host (None if it failed)."""
    rec: dict = {}
    q = inputs[2]
    try:
        cols, args, ref = _columns(point, inputs, cfg, rec)
    except Exception as e:  # noqa: BLE001
        rec["ours_auto_ms"], rec["ours_auto_error"] = "error", _err(e)
        traceback.print_exc(limit=3)
        return rec, None
    small = point["kind"] == "single" and (point["batch"] <= 32 or "small_gqa" in point["tags"])
    n = cfg.n or loop_calls(max(2 * floor_ms * 1e-3, 15e-6))
    kw = dict(compiler_options=GRAPH_ALWAYS, n=n, reps=cfg.reps)
    u = cfg.unroll
    timings = [(name, fn, args, 1) for name, fn in cols]
    if small:   # where the harness's own cost matters: measured at this point's shapes
        timings += [(f"ours_auto_u{u}", cols[0][1], args, u), ("jax_loop_identity", identity, (), 1),
                    (f"jax_loop_identity_u{u}", identity, (), u)]
    rec["loop_calls"] = n
    for name, fn, a, unroll in timings:
        try:
            rec[f"{name}_ms"] = loop_time(fn, q, a, unroll=unroll, **kw) * 1e3
        except Exception as e:  # noqa: BLE001 - recorded, the next column runs
            rec[f"{name}_ms"] = "X" if is_oom(e) else "error"
            rec[f"{name}_error"] = _err(e)
            log(f"{name}: {_err(e)}")
    for k in [k for k in rec if k.endswith("_source")]:
        rec[k[:-len("_source")] + "_ms"] = rec.get(rec[k] + "_ms")
    out = None
    try:
        out = np.asarray(jax.jit(cols[0][1])(q, *args), np.float32)
        ctx = int(np.sum(inputs[0].info["seq_path_len"])) + int(np.sum(inputs[1]))
        if ctx * point["heads_q"] <= cfg.reference_below and cols[0][1] is not ref:
            r = np.asarray(jax.jit(ref)(q, *args), np.float32)
            rec["ours_auto_maxabs_vs_reference"] = float(np.max(np.abs(out - r)))
    except Exception as e:  # noqa: BLE001
        rec["ours_output_error"] = _err(e)
        log(f"ours output: {_err(e)}")
    return rec, out
