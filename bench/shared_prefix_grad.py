"""Gradients through shared-prefix attention (GPU): forward + backward time and XLA's temporary
memory of ``jax.grad`` of ``sum(w * shared_prefix_attention(...))`` with respect to ``q`` and all
four K/V arrays, for

* ``kernels``: the shared path's forward, backward through the flash backward kernels (the
  plan's ``backward="kernels"``, the default: ``pallas_kernels.prefix_attention_bwd`` for the
  prefix part with the rows of all sequences batched, ``pallas_kernels.suffix_attention_bwd``
  for the suffix part, both with the merged statistics);
* ``mgpu``: the same forward, backward through the Mosaic GPU flash backward kernels (the plan's
  ``backward="mgpu"``, :mod:`jax_prefix_attn.mgpu_grads`; the prefix groups are contiguous runs
  of sequences here, so the prefix part runs folded per group);
* ``refbwd``: the same forward, backward by autodiff of the pure-JAX reference decomposition
  (the plan's ``backward="reference"``; it materialises ``[B, Tq, Hq, P]`` probabilities);
* ``concat_flash``: our flash attention (``jax_prefix_attn.attention``'s kernel,
  ``pallas_kernels.flash_attention``) over the explicitly concatenated per-sequence KV
  (``[B, P + S, Hkv, D]``: the prefixes are full here, so a broadcast or gather of the prefix
  and a concatenation, whose transposes sum the prefix gradient): what one would do without
  shared-prefix support;
* ``floor``: ``max(bytes / copy bandwidth, flops / matmul rate)`` (both measured in the run):
  flops of 7 matrix products over the visible (row, key) pairs (2 forward, 5 backward:
  FlashAttention-2's count), bytes of reading ``q``, ``dO``, the prefix once and every suffix,
  and writing their gradients.

Every point checks the ``kernels`` and ``mgpu`` gradients against ``refbwd`` (relative error per
input, in float32).  ``--smoke`` leaves ``mgpu`` out unless ``--cols`` names it (Mosaic GPU's
interpreter is slow).  Usage: ``python bench/shared_prefix_grad.py --out bench/results/shared_prefix_grad_<gpu>.json``;
``--smoke``: tiny shapes in interpret mode (CPU).
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
from bench.timing import device_info, git_commit, gpu_slug, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from jax_prefix_attn import plan_shared_prefix, shared_prefix_attention  # noqa: E402
from pallas_kernels.flash_attention import flash_attention  # noqa: E402

# (B, Tq, P, S, Hq, Hkv, D, G)
POINTS = [
    (64, 1, 4096, 256, 32, 8, 128, 1),     # gradients at a decode step (RL / probing)
    (16, 64, 4096, 128, 32, 8, 128, 1),    # suffix prefill / draft verification
    (32, 16, 8192, 256, 32, 8, 128, 1),    # long shared document
    (64, 16, 4096, 256, 8, 1, 128, 1),     # Hq=8 / Hkv=1
    (64, 4, 2048, 256, 32, 8, 128, 4),     # four prefix groups
    (16, 256, 2048, 256, 32, 8, 128, 2),   # GRPO-like: 2 prompts x 8 completions of 256 tokens
    (16, 128, 2048, 128, 32, 8, 128, 2),   # completions of 128: below backward="auto"'s threshold
    (8, 512, 4096, 512, 32, 8, 128, 1),    # one prompt x 8 completions of 512
]
SMOKE_POINTS = [(3, 2, 40, 24, 4, 2, 16, 1), (4, 2, 32, 16, 4, 1, 16, 2)]
COLS = ("kernels", "mgpu", "refbwd", "concat_flash")
INTERPRET = False


def make_inputs(b, tq, p, s, hq, hkv, d, g, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q = rnd(b, tq, hq, d)
    pk, pv = rnd(g, p, hkv, d), rnd(g, p, hkv, d)
    sk, sv = rnd(b, s, hkv, d), rnd(b, s, hkv, d)
    sl = jnp.asarray(rng.integers(max(tq, s // 2), s + 1, size=b), jnp.int32)
    s2p = jnp.asarray(np.arange(b) * g // b, jnp.int32)          # contiguous groups
    plen = jnp.full((g,), p, jnp.int32)
    w = rnd(b, tq, hq, d).astype(jnp.float32)
    return (q, pk, pv, sk, sv), dict(sl=sl, s2p=s2p, plen=plen, w=w)


def grad_fn(col, meta, args):
    """The compiled ``jit(grad)`` of the loss for one column (``kernels`` / ``mgpu`` /
    ``refbwd``: the shared family's plan with that backward)."""
    sl, s2p, plen, w = meta["sl"], meta["s2p"], meta["plen"], meta["w"]

    if col in ("kernels", "mgpu", "refbwd"):
        q, pk = args[0], args[1]
        b, tq, hq, d = q.shape
        g, p, hkv, _ = pk.shape
        plan = plan_shared_prefix(batch=b, tq=tq, heads_q=hq, heads_kv=hkv, head_dim=d, groups=g,
                                  prefix_len=p, suffix_len=args[3].shape[1], dtype=q.dtype,
                                  impl="shared", interpret=INTERPRET,
                                  backward={"refbwd": "reference"}.get(col, col))

        def loss(q, pk, pv, sk, sv):
            out = shared_prefix_attention(q, pk, pv, sk, sv, suffix_lengths=sl,
                                          prefix_lengths=plen, seq_to_prefix=s2p, plan=plan,
                                          interpret=INTERPRET)
            return jnp.sum(out.astype(jnp.float32) * w)
    else:
        def loss(q, pk, pv, sk, sv):
            b, p = q.shape[0], pk.shape[1]

            def concat(pre, suf):  # (every prefix is full here: a plain concatenation)
                pre_b = (jnp.broadcast_to(pre, (b,) + pre.shape[1:]) if pre.shape[0] == 1
                         else pre[s2p])
                return jnp.concatenate([pre_b, suf], axis=1)
            out, _ = flash_attention(q, concat(pk, sk), concat(pv, sv), causal=True,
                                     kv_lengths=p + sl, interpret=INTERPRET)
            return jnp.sum(out.astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()


def floor_s(b, tq, p, s, hq, hkv, d, sl_mean, bw, mma, itemsize=2, g=1):
    pairs = b * tq * hq * (p + sl_mean)
    flops = 7 * 2 * pairs * d
    kv_bytes = (g * p + b * s) * hkv * d * 2 * itemsize
    q_bytes = b * tq * hq * d * itemsize
    nbytes = 2 * kv_bytes + 3 * q_bytes  # read + write K/V and their grads; q, dO, dq
    return max(nbytes / bw, flops / mma), nbytes, flops


def run_point(pt, bw, mma, cols, iters):
    b, tq, p, s, hq, hkv, d, g = pt
    rec = dict(batch=b, tq=tq, prefix=p, suffix=s, heads_q=hq, heads_kv=hkv, head_dim=d,
               groups=g)
    args, meta = make_inputs(b, tq, p, s, hq, hkv, d, g)
    rec["floor_ms"], rec["bytes"], rec["flops"] = (
        x * 1e3 if i == 0 else x for i, x in enumerate(
            floor_s(b, tq, p, s, hq, hkv, d, float(np.mean(np.asarray(meta["sl"]))), bw, mma,
                    g=g)))
    grads = measure_columns(rec, cols, lambda col: grad_fn(col, meta, args), args, iters)
    compare_grads(rec, grads, "refbwd", ("dq", "dprefix_k", "dprefix_v", "dsuffix_k", "dsuffix_v"))
    kernel_ratios(rec, cols)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--cols", default=None, help=f"comma-separated columns (default {','.join(COLS)})")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--points", default=None,
                    help="comma-separated indices into the grid (default: every point)")
    ap.add_argument("--commit", default=None, help="commit measured (default: git rev-parse HEAD of this checkout)")
    args = ap.parse_args()
    global INTERPRET
    points = POINTS
    if args.smoke:
        INTERPRET = True
        points = SMOKE_POINTS
    if args.points:
        points = [points[int(i)] for i in args.points.split(",")]
    out = args.out or f"bench/results/shared_prefix_grad_{gpu_slug()}.json"
    bw = measure_copy_bandwidth(1 << 24 if args.smoke else 2 << 30)
    mma = measure_matmul_rate(256 if args.smoke else 8192)
    print(f"device {device_info()['device']}: copy {bw / 1e12:.2f} TB/s, matmul "
          f"{mma / 1e12:.0f} TFLOP/s", flush=True)
    cols = (args.cols.split(",") if args.cols else
            [c for c in COLS if not (args.smoke and c == "mgpu")])
    doc = dict(info=device_info(), jax=jax.__version__, commit=git_commit(args.commit)[0],
               copy_bw_Bps=bw, matmul_flops=mma, columns=cols, notes=__doc__,
               results=[])
    for pt in points:
        t0 = time.time()
        rec = run_point(pt, bw, mma, cols, 2 if args.smoke else args.iters)
        rec["wall_s"] = time.time() - t0
        doc["results"].append(rec)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)
        print_row(f"B={pt[0]:4d} Tq={pt[1]:3d} P={pt[2]:5d} S={pt[3]:4d} Hq={pt[4]:2d}/{pt[5]} G={pt[7]}", rec,
                  cols, "refbwd")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
