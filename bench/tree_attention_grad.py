"""Gradients through tree attention (GPU): forward + backward time and XLA's temporary memory of
``jax.grad`` of ``sum(w * tree_attention(...))`` with respect to ``q``, the KV pool and the
suffixes, on multi-level trees (the flatten schedule; single-level forests go through the
shared-prefix path and ``bench/shared_prefix_grad.py``), for

* ``kernels``: ``impl="flatten"``, backward through the tree backward kernels
  (``backward="kernels"``, the default: ``pallas_kernels.tree_attention_bwd`` for the tree
  part, the suffix part's backward kernel, both with the merged statistics);
* ``auto``: ``impl="auto"`` (what a user gets by default: on the GPU the hybrid schedule when
  decoding these trees, the level-wise or flatten one otherwise), backward as ``kernels``
  (off the GPU, ``auto`` is the pure-JAX mirror and its autodiff);
* ``mirror``: the same forward as ``kernels``, backward by autodiff of the pure-JAX mirror of the flatten
  schedule (``backward="mirror"``; it materialises the scores of every work item);
* ``concat_flash``: our flash attention (``pallas_kernels.flash_attention``) over explicitly
  gathered per-sequence contexts ``[B, L_max, Hkv, D]`` (path tokens then suffix; the gather's
  transpose scatters the pool gradient): what one would do without tree support;
* ``floor``: ``max(bytes / copy bandwidth, flops / matmul rate)`` (both measured in the run):
  7 matrix products over the visible (row, key) pairs (FlashAttention-2's count), bytes of
  reading ``q``, ``dO``, the pool once and every suffix and writing their gradients.

Every point checks the ``kernels``, ``auto`` and ``concat_flash`` gradients against ``mirror``'s (relative
error per input, float32).  Usage: ``python bench/tree_attention_grad.py --out
bench/results/tree_attention_grad_<gpu>.json``; ``--smoke``: tiny shapes in interpret mode (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.grad_common import compare_grads, kernel_ratios, measure_columns, print_row  # noqa: E402
from bench.timing import device_info, gpu_slug, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from jax_prefix_attn import PrefixTree, tree_attention  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402


def _workloads():
    rng = np.random.default_rng(0)
    apps = [[2400] + [int(x) for x in rng.integers(300, 801, 8)]]
    tot = [[1500] + [[int(x)] + [int(y) for y in rng.integers(100, 301, 6)] for x in rng.integers(100, 301, 6)]]
    doc = [[4096, [512] * 1 + [256] * 3, [1024, 128, 128]]]
    return [
        # name, forest, seqs per leaf, Tq, suffix capacity, Hq, Hkv, D
        ("apps8x32_decode", apps, 32, 1, 256, 32, 8, 128),       # RL scoring of 256 samples
        ("tot_decode", tot, 4, 1, 64, 32, 8, 128),              # tree of thought, 3 levels
        ("doc_tq64", doc, 4, 64, 128, 32, 8, 128),              # training on continuations
        ("apps8x32_hq8", apps, 32, 1, 256, 8, 1, 128),
    ]


SMOKE = [("smoke_a", [[40, 7, [9, 3, 5]]], 2, 1, 12, 4, 2, 16),
         ("smoke_b", [[33, [10, 4], 6], 20], 2, 3, 9, 4, 1, 16)]
COLS = ("kernels", "auto", "mirror", "concat_flash")


def make_inputs(wl, seed=0, dtype=jnp.bfloat16):
    _, forest, per_leaf, tq, smax, hq, hkv, d = wl
    tree = PrefixTree.from_nested(forest, seqs_per_leaf=per_leaf)
    rng = np.random.default_rng(seed)
    b, n = tree.num_seqs, tree.pool_extent

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q = rnd(b, tq, hq, d)
    kp, vp = rnd(n, hkv, d), rnd(n, hkv, d)
    sk, sv = rnd(b, smax, hkv, d), rnd(b, smax, hkv, d)
    sl = jnp.asarray(rng.integers(max(tq, smax // 2), smax + 1, size=b), jnp.int32)
    w = rnd(b, tq, hq, d).astype(jnp.float32)
    return tree, (q, kp, vp, sk, sv), dict(sl=sl, w=w)


def grad_fn(col, tree, meta, args, interpret: bool = False):
    """The compiled ``jit(grad)`` of the loss for one column (``interpret``: kernels in interpret
    mode)."""
    sl, w = meta["sl"], meta["w"]
    impl = "auto" if col == "auto" else "flatten"
    backward = "mirror" if col == "mirror" else "kernels"
    if col in ("kernels", "auto", "mirror"):
        def loss(q, kp, vp, sk, sv):
            out = tree_attention(q, tree, kp, vp, sk, sv, suffix_lengths=sl, impl=impl,
                                 interpret=interpret and impl != "auto", backward=backward)
            return jnp.sum(out.astype(jnp.float32) * w)
    else:
        b = tree.num_seqs
        paths = [np.asarray(tree.path_token_indices(i), np.int32) for i in range(b)]
        plen = np.array([p.shape[0] for p in paths], np.int32)
        lmax = int(plen.max())
        idx = np.stack([np.pad(p, (0, lmax - p.shape[0])) for p in paths])      # [B, Lp]
        smax = args[3].shape[1]
        # context position j < plen: pool token idx[j]; then the suffix (gathered from a
        # [B, Lp + S] layout: the path padded, then the suffix shifted to start at plen)
        j = np.arange(lmax + smax)[None, :]
        from_suffix = j >= plen[:, None]
        s_idx = np.clip(j - plen[:, None], 0, max(smax - 1, 0))
        p_idx = np.take_along_axis(idx, np.clip(j, 0, lmax - 1), axis=1)

        def loss(q, kp, vp, sk, sv):
            def ctx(pool, suf):
                from_pool = pool[jnp.asarray(p_idx)]                                  # [B, L, Hkv, D]
                if smax == 0:
                    return from_pool
                from_suf = jnp.take_along_axis(suf, jnp.asarray(s_idx)[..., None, None], axis=1)
                return jnp.where(jnp.asarray(from_suffix)[..., None, None], from_suf, from_pool)
            out, _ = flash_attention(q, ctx(kp, sk), ctx(vp, sv), causal=True,
                                     kv_lengths=jnp.asarray(plen) + sl, interpret=interpret)
            return jnp.sum(out.astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()


def floor_s(tree, tq, hq, hkv, d, sl, bw, mma, itemsize=2):
    b = tree.num_seqs
    ctx = np.array([len(tree.path_token_indices(i)) for i in range(b)]) + np.asarray(sl)
    # visible pairs: query t of Tq sees ctx - Tq + 1 + t keys
    pairs = hq * float(np.sum([np.sum(np.maximum(c - tq + 1 + np.arange(tq), 0)) for c in ctx]))
    flops = 7 * 2 * pairs * d
    kv_bytes = (tree.pool_extent + float(np.sum(sl))) * hkv * d * 2 * itemsize
    q_bytes = b * tq * hq * d * itemsize
    nbytes = 2 * kv_bytes + 3 * q_bytes
    return max(nbytes / bw, flops / mma), nbytes, flops


def run_point(wl, bw, mma, cols, iters, interpret: bool = False):
    name, _, per_leaf, tq, smax, hq, hkv, d = wl
    tree, args, meta = make_inputs(wl)
    rec = dict(name=name, batch=tree.num_seqs, tq=tq, suffix=smax, heads_q=hq, heads_kv=hkv, head_dim=d,
               nodes=tree.num_nodes, pool_tokens=tree.pool_extent, depth=int(tree.info['depth'].max()) + 1)
    fl, rec["bytes"], rec["flops"] = floor_s(tree, tq, hq, hkv, d, meta["sl"], bw, mma)
    rec["floor_ms"] = fl * 1e3
    grads = measure_columns(rec, cols, lambda col: grad_fn(col, tree, meta, args, interpret), args, iters)
    compare_grads(rec, grads, "mirror", ("dq", "dk_pool", "dv_pool", "dsuffix_k", "dsuffix_v"))
    kernel_ratios(rec, cols)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--cols", default=",".join(COLS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated workload names")
    args = ap.parse_args()
    points = SMOKE if args.smoke else _workloads()
    if args.only:
        points = [p for p in points if p[0] in args.only.split(",")]
    out = args.out or f"bench/results/tree_attention_grad_{gpu_slug()}.json"
    bw = measure_copy_bandwidth(1 << 24 if args.smoke else 2 << 30)
    mma = measure_matmul_rate(256 if args.smoke else 8192)
    print(f"device {device_info()['device']}: copy {bw / 1e12:.2f} TB/s, matmul "
          f"{mma / 1e12:.0f} TFLOP/s", flush=True)
    cols = args.cols.split(",")
    doc = dict(info=device_info(), copy_bw_Bps=bw, matmul_flops=mma, columns=cols, notes=__doc__,
               results=[])
    for wl in points:
        t0 = time.time()
        rec = run_point(wl, bw, mma, cols, 2 if args.smoke else args.iters, interpret=args.smoke)
        rec["wall_s"] = time.time() - t0
        doc["results"].append(rec)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print_row(f"{wl[0]:18s} B={rec['batch']:4d} Tq={wl[3]:3d} nodes={rec['nodes']:3d}", rec, cols, "mirror")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
