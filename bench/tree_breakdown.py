"""Where the time of the hybrid tree schedule goes (GPU only): each launch of
``tree_attention(impl="hybrid")`` timed alone, and the decode suffix launch's tiling swept.

For each workload of ``bench/tree_attention.py`` named on the command line (default: tot, apps8,
spec_t32), in-loop times (``bench.timing.loop_time``) of
* ``hybrid``: the whole call (one row per suffix-launch tiling ``block_k/num_warps/num_stages``);
* ``root``: the root's prefix partials alone (``decode_prefix_partials``, root gather included);
* ``mid``: the tree kernel over the other shared nodes plus the XLA merge of its partials;
* ``span_suffix``: the decode suffix kernel streaming each sequence's exclusive node and
  suffix, no incoming state; ``suffix``: the same without the spans, with the planning device's
  ``decode_suffix_tiling``;
and the bytes each streaming launch reads, as a rate.  ``--mid-sweep WORKLOAD ...`` first times the
whole hybrid call under several tilings of its tree-kernel launch (``MID_SETTINGS``: key tile,
row block, warps, stages, node or flatten mode).

    python bench/tree_breakdown.py --out bench/results/tree_breakdown_h200.json [--workloads tot apps8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import device_info, loop_time  # noqa: E402
from bench.tree_attention import HKV, HQ, D, make_case, workloads  # noqa: E402
from jax_prefix_attn import build_tree_metadata  # noqa: E402
from jax_prefix_attn.executor import decode_prefix_partials  # noqa: E402
from jax_prefix_attn.device import planning_device_info  # noqa: E402
from jax_prefix_attn.leaf_plans import decode_suffix_tiling  # noqa: E402
from jax_prefix_attn.tree_layout import gather_parts, merge_states, q_sorted, row_tables  # noqa: E402
from jax_prefix_attn.tree_paths import hybrid_attention, partials, root_spans  # noqa: E402
from pallas_kernels.suffix_attention import suffix_decode_merge  # noqa: E402

TILINGS = [(32, 2, 3), (64, 4, 3), (64, 2, 3), (32, 4, 3), (16, 2, 4), (128, 4, 2)]


def _touch(q, x):
    """A q-shaped result that depends on ``x`` (keeps the launch alive inside the timing loop)."""
    return q + (jnp.ravel(x)[0] * 0).astype(q.dtype)


def bench(name):
    wl = {w["name"]: w for w in workloads(False)}[name]
    tree, (q, kp, vp, sk, sv, sl) = make_case(wl)
    meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0])
    scale = D ** -0.5
    b = q.shape[0]
    rec = dict(workload=name, batch=b, excl_tokens=int(np.asarray(meta.excl_span)[:, 1].sum()),
               suffix_tokens=int(np.asarray(sl).sum()), hybrid_root=meta.hybrid_root,
               mid=None if meta.mid is None else dict(mode=meta.mid.mode, block_rows=meta.mid.block_rows),
               ms={})
    tok_bytes = HKV * D * 2 * 2
    for bk, nw, ns in TILINGS:
        tiling = dict(block_k=bk, num_warps=nw, num_stages=ns)
        f = lambda q, m, kp, vp, sk, sv, sl, tiling=tiling: hybrid_attention(  # noqa: E731
            q, m, kp, vp, sk, sv, sl, scale=scale, backend="pallas", suffix_tiling=tiling)[0]
        rec["ms"][f"hybrid_{bk}_{nw}_{ns}"] = loop_time(f, q, (meta, kp, vp, sk, sv, sl)) * 1e3
        span = (kp, vp, meta.excl_span[:, 0], meta.excl_span[:, 1])
        g = lambda q, kp, vp, sk, sv, sl, st, sn: suffix_decode_merge(  # noqa: E731
            q[:, 0], sk, sv, sl, None, span=(kp, vp, st, sn), scale=scale, block_k=bk, num_warps=nw,
            num_stages=ns)[0][:, None]
        if sk.shape[1]:
            rec["ms"][f"span_suffix_{bk}_{nw}_{ns}"] = loop_time(
                g, q, (kp, vp, sk, sv, sl, meta.excl_span[:, 0], meta.excl_span[:, 1])) * 1e3
        del span
    if sk.shape[1]:
        planned = dataclasses.asdict(decode_suffix_tiling(planning_device_info()))
        h = lambda q, sk, sv, sl: suffix_decode_merge(q[:, 0], sk, sv, sl, None, scale=scale,  # noqa: E731
                                                      **planned)[0][:, None]
        rec["ms"]["suffix"] = loop_time(h, q, (sk, sv, sl)) * 1e3
    if meta.hybrid_root:
        def root(q, m, kp, vp):
            pk, pv = root_spans(m, kp, vp)
            o, lse, _ = decode_prefix_partials(q[:, 0], pk[0], pv[0], m.root_span[0, 1], scale=scale)
            return _touch(q, o) + _touch(q, lse) * 0
        rec["ms"]["root"] = loop_time(root, q, (meta, kp, vp)) * 1e3
    if meta.mid is not None:
        def mid(q, m, kp, vp, sl):
            key, lim = row_tables(m, sl)
            g_ = HQ // HKV
            o, lse = partials(m.mid, q_sorted(q, m, HKV), kp, vp, jnp.repeat(key, g_), jnp.repeat(lim, g_),
                              group=g_, scale=scale, backend="pallas")
            og, lg = gather_parts(m.mid, o, lse, g_)
            om, lm = merge_states([og], [lg])
            return _touch(q, om) + _touch(q, lm) * 0
        rec["ms"]["mid"] = loop_time(mid, q, (meta, kp, vp, sl)) * 1e3
    streamed = (rec["excl_tokens"] + rec["suffix_tokens"]) * tok_bytes
    for k, v in list(rec["ms"].items()):
        if k.startswith("span_suffix"):
            rec.setdefault("span_suffix_TBps", {})[k] = streamed / (v * 1e-3) / 1e12
    return rec


MID_SETTINGS = [  # (block_kv, max_block_m, num_warps, num_stages, mid mode)
    (128, 128, None, 2, None), (128, 128, 4, 2, None), (128, 128, 8, 3, None), (128, 64, None, 2, None),
    (64, 128, None, 2, None), (64, 64, None, 2, None), (64, 64, 4, 3, None), (128, 128, None, 2, "flatten"),
    (64, 64, None, 2, "flatten")]


def mid_sweep(name):
    """The hybrid schedule's tree-kernel launch (``mid``) under several tilings / modes (passed as
    ``build_tree_metadata(mid_tiling=, mid_mode=)`` and the launch's kernel options)."""
    wl = {w["name"]: w for w in workloads(False)}[name]
    tree, (q, kp, vp, sk, sv, sl) = make_case(wl)
    scale = D ** -0.5
    out = []
    for bkv, mm, nw, ns, mode in MID_SETTINGS:
        meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0], block_kv=bkv,
                                   max_block_m=mm, mid_tiling=dict(block_kv=bkv, max_block_m=mm), mid_mode=mode)
        opts = {} if nw is None and ns == 2 else dict(num_stages=ns, **({} if nw is None else dict(num_warps=nw)))
        try:
            f = lambda q, m, kp, vp, sk, sv, sl: hybrid_attention(  # noqa: E731
                q, m, kp, vp, sk, sv, sl, scale=scale, backend="pallas", mid_kernel_options=opts)[0]
            t = loop_time(f, q, (meta, kp, vp, sk, sv, sl)) * 1e3
        except Exception as e:  # noqa: BLE001
            t = f"{type(e).__name__}: {e}"[:300]
        r = dict(workload=name, block_kv=bkv, max_block_m=mm, num_warps=nw, num_stages=ns,
                 mid_mode=None if meta.mid is None else meta.mid.mode, hybrid_ms=t)
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="*", default=["tot", "apps8", "spec_t32"])
    ap.add_argument("--mid-sweep", nargs="*", default=[], help="workloads for the mid-launch tiling sweep")
    a = ap.parse_args()
    res = dict(device=device_info(), notes=__doc__, results=[])
    for name in a.mid_sweep:
        res.setdefault("mid_sweep", []).extend(mid_sweep(name))
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for name in a.workloads:
        rec = bench(name)
        res["results"].append(rec)
        print(json.dumps(rec), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for r in res["results"]:
        print(r["workload"], " ".join(f"{k}={v:.3f}" for k, v in sorted(r["ms"].items())))


if __name__ == "__main__":
    main()
