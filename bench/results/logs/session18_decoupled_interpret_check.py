"""Session 18: the draft decoupled kernel in Mosaic GPU's CPU interpreter against float64 NumPy.
Run from the repository root: PYTHONPATH=. python <this> B Hq Hkv D P S p_len splits [nan]."""
# The draft this script reads was superseded by pallas_kernels/decoupled_decode_mgpu.py (session 19)
# and removed; recover it with: git show 8fdfd45:bench/results/logs/session18_decoupled_decode_mgpu_draft.py
import sys, time
import numpy as np
import jax, jax.numpy as jnp
import importlib.util
_spec = importlib.util.spec_from_file_location("dd", "bench/results/logs/session18_decoupled_decode_mgpu_draft.py")
dd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dd)
from pallas_kernels.decode_attention import merge_partials

def ref_np(q, pk, pv, pl_, sk, sv, sl, scale):
    # q [B, Hq, D]; pk [P, Hkv, D]; sk [B, S, Hkv, D]
    q = np.asarray(q, np.float64); B, Hq, D = q.shape; Hkv = pk.shape[1]; G = Hq // Hkv
    out = np.zeros((B, Hq, D)); lse = np.zeros((B, Hq))
    for b in range(B):
        k = np.concatenate([np.asarray(pk[:pl_], np.float64), np.asarray(sk[b, :sl[b]], np.float64)])
        v = np.concatenate([np.asarray(pv[:pl_], np.float64), np.asarray(sv[b, :sl[b]], np.float64)])
        for hq in range(Hq):
            h = hq // G
            s = k[:, h] @ q[b, hq] * scale
            if len(s) == 0:
                lse[b, hq] = -np.inf; continue
            mx = s.max(); p = np.exp(s - mx)
            out[b, hq] = p @ v[:, h] / p.sum(); lse[b, hq] = mx + np.log(p.sum())
    return out, lse

def run(B, Hq, Hkv, D, P, S, p_len, splits, seed=0, nan=False):
    G = Hq // Hkv
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    q, pk, pv, sk, sv = f(B, Hq, D), f(P, Hkv, D), f(P, Hkv, D), f(B, S, Hkv, D), f(B, S, Hkv, D)
    sl = rng.integers(0, S + 1, B); sl[0] = S; sl[-1] = 0 if B > 1 else sl[-1]
    if nan:
        skn = np.array(sk, np.float32); svn = np.array(sv, np.float32)
        for b in range(B):
            skn[b, sl[b]:] = np.nan; svn[b, sl[b]:] = np.nan
        sk, sv = jnp.asarray(skn, jnp.bfloat16), jnp.asarray(svn, jnp.bfloat16)
    from pallas_kernels.prefix_attention import _rows_128
    qm, m = _rows_128(q[:, None], Hkv, G)
    scale = D ** -0.5
    t0 = time.time()
    o_pre, l_pre, o_suf, l_suf = dd.decoupled_decode_mgpu(qm, pk, pv, p_len, sk, sv, jnp.asarray(sl, jnp.int32),
        scale=scale, group=G, num_splits=splits, interpret=True, _cpu_check=True)
    os_, ls_ = dd.suffix_rows(o_suf, l_suf, batch=B, group=G)
    o_all = jnp.concatenate([o_pre[:, :, :m].astype(jnp.float32), os_.astype(jnp.float32)], 0)
    l_all = jnp.concatenate([l_pre[:, :, :m], ls_], 0)
    o, l = merge_partials(o_all, l_all)  # [Hkv, B*G, D]
    o = np.asarray(o).reshape(Hkv, B, G, D).transpose(1, 0, 2, 3).reshape(B, Hq, D)
    l = np.asarray(l).reshape(Hkv, B, G).transpose(1, 0, 2).reshape(B, Hq)
    ro, rl = ref_np(q, pk, pv, p_len, sk, sv, sl, scale)
    rel = np.linalg.norm(o - ro) / np.linalg.norm(ro)
    fin = np.isfinite(rl)
    print(f"B{B} Hq{Hq}/{Hkv} D{D} P{P} S{S} pl{p_len} sp{splits} nan{nan}: rel {rel:.2e} lse {np.max(np.abs(l[fin]-rl[fin])):.2e} "
          f"inf-match {np.array_equal(np.isneginf(l), np.isneginf(rl))} finite {np.isfinite(o).all()} ({time.time()-t0:.0f}s)", flush=True)

args = [int(x) for x in sys.argv[1:9]]
run(*args, nan=len(sys.argv) > 9)
