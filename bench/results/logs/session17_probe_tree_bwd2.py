"""Session 17 probe (second version, after the affine-addressing commit): where the time of
tree_attention's kernel backward goes (GPU), and the kernels' tilings with 2 or 3 pipeline stages.

For each workload of bench/tree_attention_grad.py: the forward alone (impl="flatten"), the
whole jit(grad), and the backward's pieces alone with prepared inputs: tree_grads (both
kernels + XLA scatters), its dK/dV and dQ pallas_calls through different block_k, and the
suffix part (suffix_part_grads).  Prints one JSON line per measurement."""
import importlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import time_fn  # noqa: E402
from bench.tree_attention_grad import _workloads, make_inputs  # noqa: E402
from jax_prefix_attn import tree_attention  # noqa: E402
from jax_prefix_attn.tree import build_tree_metadata  # noqa: E402
from pallas_kernels.suffix_attention_bwd import suffix_part_grads  # noqa: E402
from pallas_kernels.tree_attention_bwd import tree_grads  # noqa: E402

ta = importlib.import_module("jax_prefix_attn.tree_attention")


def main():
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    for wl in _workloads():
        if only and wl[0] not in only:
            continue
        tree, (q, kp, vp, sk, sv), m = make_inputs(wl)
        sl, w = m["sl"], m["w"]
        b, tq, hq, d = q.shape
        hkv = kp.shape[1]
        g = hq // hkv
        meta = jax.tree_util.tree_map(jnp.asarray, build_tree_metadata(tree, tq=tq, group=g,
                                                                       pool_size=kp.shape[0], device=False))
        sched = meta.flatten
        rec = dict(name=wl[0], W=int(sched.items.shape[0]), NC=int(sched.tok.shape[0]),
                   block_rows=sched.block_rows, block_kv=sched.block_kv, R_pad=int(meta.sorted_rows.shape[0]),
                   items_real=int((sched.items[:, 1] > 0).sum()))
        fwd = jax.jit(lambda q, kp, vp, sk, sv: tree_attention(q, meta, kp, vp, sk, sv, suffix_lengths=sl,
                                                               impl="flatten", return_lse=True))
        out, lse = fwd(q, kp, vp, sk, sv)
        rec["fwd_ms"] = 1e3 * time_fn(fwd, [(q, kp, vp, sk, sv)], iters=20)

        def loss(q, kp, vp, sk, sv):
            return jnp.sum(tree_attention(q, meta, kp, vp, sk, sv, suffix_lengths=sl,
                                          impl="flatten").astype(jnp.float32) * w)
        gr = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        rec["grad_ms"] = 1e3 * time_fn(gr, [(q, kp, vp, sk, sv)], iters=20)
        do = w.astype(q.dtype)
        delta = jnp.sum(w * out.astype(jnp.float32), -1)
        key, lim = ta._row_tables(meta, sl)
        stat = lambda x: ta._q_sorted(x[..., None], meta, hkv)[..., 0]  # noqa: E731
        args = (ta._q_sorted(q, meta, hkv), ta._q_sorted(do, meta, hkv), stat(lse), stat(delta), kp, vp,
                sched.items, sched.tok, sched.chunk_start, jnp.repeat(key, g), jnp.repeat(lim, g))
        f = jax.jit(lambda *a: tree_grads(*a[:9], sched.parts, *a[9:], group=g, block_rows=sched.block_rows,
                                          block_kv=sched.block_kv, sm_scale=d ** -0.5))
        rec["tree_grads_ms"] = 1e3 * time_fn(f, [args], iters=20)
        import pallas_kernels.tree_attention_bwd as tb
        from jax.experimental.pallas import triton as plgpu
        first, count, _ = tb.chunk_item_ranges(sched.items, int(sched.tok.shape[0]))
        for bk, nw, ns in ((32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 8, 3), (64, 4, 2), (64, 8, 2), (64, 8, 3),
                           (128, 8, 2)):
            st = dict(group=g, block_m=sched.block_rows * g, bk=bk, block_kv=sched.block_kv, scale=d ** -0.5,
                      fp32=False, interpret=False, params=plgpu.CompilerParams(num_warps=nw, num_stages=ns))
            kk = args[:6]
            tabs = (sched.items, sched.tok, sched.chunk_start, args[9], args[10])
            f1 = jax.jit(lambda *a, st=st: tb._dkv_call(first, count, *a[6:], *a[:6], **st))
            f2 = jax.jit(lambda *a, st=st: tb._dq_call(*a[6:], *a[:6], **st))
            for nm, f in (("dkv", f1), ("dq", f2)):
                try:
                    rec[f"{nm}_ms[bk={bk},w={nw},s={ns}]"] = 1e3 * time_fn(f, [kk + tabs], iters=20)
                except Exception as exc:  # noqa: BLE001
                    rec[f"{nm}_ms[bk={bk},w={nw},s={ns}]"] = f"error {type(exc).__name__}: {str(exc)[:150]}"
        f = jax.jit(lambda *a: suffix_part_grads(*a, scale=d ** -0.5))
        rec["suffix_grads_ms"] = 1e3 * time_fn(f, [(q, do, lse, delta, sk, sv, sl)], iters=20)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
