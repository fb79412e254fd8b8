"""Where the time of the hybrid tree schedule goes (GPU only): each launch of
``tree_attention(impl="hybrid")`` timed alone, and the decode suffix launch's tiling swept.

For each workload of ``bench/tree_attention.py`` named on the command line (default: tot, apps8,
spec_t32), in-loop times (``bench.timing.loop_time``) of
* ``hybrid``: the whole call (one row per suffix-launch tiling ``block_k/num_warps/num_stages``);
* ``root``: the root's prefix partials alone (``decode_prefix_partials``, root gather included);
* ``mid``: the tree kernel over the other shared nodes plus the XLA merge of its partials;
* ``span_suffix``: the decode suffix kernel streaming each sequence's exclusive node and
  suffix, no incoming state; ``suffix``: the same without the spans;
and the bytes each streaming launch reads, as a rate.  ``--mid-sweep WORKLOAD ...`` first times the
whole hybrid call under several tilings of its tree-kernel launch (``MID_SETTINGS``: key tile,
row block, warps, stages, node or flatten mode).

    python bench/tree_breakdown.py --out bench/results/tree_breakdown_h200.json [--workloads tot apps8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import device_info, loop_time  # noqa: E402
from bench.tree_attention import HKV, HQ, D, make_case, workloads  # noqa: E402

TILINGS = [(32, 2, 3), (64, 4, 3), (64, 2, 3), (32, 4, 3), (16, 2, 4), (128, 4, 2)]


def _touch(q, x):
    """A q-shaped result that depends on ``x`` (keeps the launch alive inside the timing loop)."""
    return q + (jnp.ravel(x)[0] * 0).astype(q.dtype)


def bench(name):
    import importlib
    import pallas_kernels.prefix_attention as pa
    from jax_prefix_attn import tree_attention
    from jax_prefix_attn.tree import build_tree_metadata
    from pallas_kernels.suffix_attention import suffix_decode_merge
    ta = importlib.import_module("jax_prefix_attn.tree_attention")  # the module (the package exports the function)
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
    saved = dict(pa.DECODE_SUFFIX_TILING)
    for bk, nw, ns in TILINGS:
        pa.DECODE_SUFFIX_TILING.update(block_k=bk, num_warps=nw, num_stages=ns)
        f = lambda q, m, kp, vp, sk, sv, sl: tree_attention(q, m, kp, vp, sk, sv, suffix_lengths=sl,  # noqa: E731
                                                           impl="hybrid")
        rec["ms"][f"hybrid_{bk}_{nw}_{ns}"] = loop_time(f, q, (meta, kp, vp, sk, sv, sl)) * 1e3
        span = (kp, vp, meta.excl_span[:, 0], meta.excl_span[:, 1])
        g = lambda q, kp, vp, sk, sv, sl, st, sn: suffix_decode_merge(  # noqa: E731
            q[:, 0], sk, sv, sl, None, span=(kp, vp, st, sn), scale=scale, block_k=bk, num_warps=nw,
            num_stages=ns)[0][:, None]
        if sk.shape[1]:
            rec["ms"][f"span_suffix_{bk}_{nw}_{ns}"] = loop_time(
                g, q, (kp, vp, sk, sv, sl, meta.excl_span[:, 0], meta.excl_span[:, 1])) * 1e3
        del span
    pa.DECODE_SUFFIX_TILING.clear()
    pa.DECODE_SUFFIX_TILING.update(saved)
    if sk.shape[1]:
        h = lambda q, sk, sv, sl: suffix_decode_merge(q[:, 0], sk, sv, sl, None, scale=scale,  # noqa: E731
                                                      **saved)[0][:, None]
        rec["ms"]["suffix"] = loop_time(h, q, (sk, sv, sl)) * 1e3
    if meta.hybrid_root:
        def root(q, m, kp, vp):
            pk, pv = ta._root_spans(m, kp, vp)
            o, lse, _ = pa.decode_prefix_partials(q[:, 0], pk[0], pv[0], m.root_span[0, 1], scale=scale)
            return _touch(q, o) + _touch(q, lse) * 0
        rec["ms"]["root"] = loop_time(root, q, (meta, kp, vp)) * 1e3
    if meta.mid is not None:
        def mid(q, m, kp, vp, sl):
            key, lim = ta._row_tables(m, sl)
            g_ = HQ // HKV
            o, lse = ta._partials(m.mid, ta._q_sorted(q, m, HKV), kp, vp, jnp.repeat(key, g_), jnp.repeat(lim, g_),
                                  group=g_, scale=scale, backend="pallas")
            og, lg = ta._gather_parts(m.mid, o, lse, g_)
            om, lm = ta._merge([og], [lg])
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
    """The hybrid schedule's tree-kernel launch (``mid``) under several tilings / modes."""
    import dataclasses
    from jax_prefix_attn import tree_attention
    from jax_prefix_attn.tree import build_tree_metadata
    import jax_prefix_attn.tree as tree_mod
    import pallas_kernels.tree_attention as tk
    wl = {w["name"]: w for w in workloads(False)}[name]
    tree, (q, kp, vp, sk, sv, sl) = make_case(wl)
    orig = tk.tree_partials
    out = []
    for bkv, mm, nw, ns, mode in MID_SETTINGS:
        tree_mod._build_cached.cache_clear()
        meta = build_tree_metadata(tree, tq=1, group=HQ // HKV, pool_size=kp.shape[0], block_kv=bkv,
                                   max_block_m=mm, device=False)
        if mode is not None and meta.mid is not None and meta.mid.mode != mode:
            # rebuild the other mode over the same nodes: all but the exclusive ones and the root
            info = tree.info
            leaf = np.asarray(tree.leaf_of_seq)
            ex = np.asarray(meta.excl_span)[:, 1] > 0
            keep = np.asarray(tree.lengths) > 0
            keep[leaf[ex]] = False
            if meta.hybrid_root:
                keep[int(np.nonzero(np.asarray(tree.parents) < 0)[0][0])] = False
            keys = info["tin"][leaf]
            order = np.argsort(keys, kind="stable")
            sk_ = keys[order]
            rows = order.astype(np.int64)
            sched = tree_mod._flatten_schedule(tree, info, sk_, 1, HQ // HKV, bkv, mm, kp.shape[0], rows,
                                               tree.num_seqs, keep=keep)
            if sched.block_rows > meta.mid.block_rows:
                continue
            meta = dataclasses.replace(meta, mid=sched)
        meta = jax.device_put(meta)
        tk.tree_partials = (orig if nw is None and ns == 2 else
                            (lambda *a, nw=nw, ns=ns, **k: orig(*a, num_warps=nw, num_stages=ns, **k)))
        try:
            f = lambda q, m, kp, vp, sk, sv, sl: tree_attention(q, m, kp, vp, sk, sv, suffix_lengths=sl,  # noqa: E731
                                                               impl="hybrid")
            t = loop_time(f, q, (meta, kp, vp, sk, sv, sl)) * 1e3
        except Exception as e:  # noqa: BLE001
            t = f"{type(e).__name__}: {e}"[:300]
        finally:
            tk.tree_partials = orig
        r = dict(workload=name, block_kv=bkv, max_block_m=mm, num_warps=nw, num_stages=ns,
                 mid_mode=None if meta.mid is None else meta.mid.mode, hybrid_ms=t)
        print(json.dumps(r), flush=True)
        out.append(r)
    tree_mod._build_cached.cache_clear()
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
