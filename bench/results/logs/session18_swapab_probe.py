"""Session 18: the swapped suffix product (S^T = K Q^T, O^T = V^T P^T) alone, lowered for CUDA (argv: N) or run in the CPU interpreter (argv: N interp)."""
import functools, math, sys
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
INTERP = len(sys.argv) > 2 and sys.argv[2] == "interp"

def f(k, v, q):
    # k, v [64, 128]; q [N, 128] (pre-transposed [128, N] for the interpreter)
    def kernel(k_ref, v_ref, q_ref, o_ref, m_ref, k_smem, v_smem, q_smem, p_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(k_ref, k_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref, v_smem, bar.at[1])
        plgpu.copy_gmem_to_smem(q_ref, q_smem, bar.at[2])
        for i in range(3):
            plgpu.barrier_wait(bar.at[i])
        def sc(acc):
            plgpu.wgmma(acc, k_smem, q_smem if INTERP else q_smem.transpose((1, 0)))
            return acc[...]
        s = pl.run_scoped(sc, plgpu.ACC((64, N), jnp.float32))
        m = s.max(axis=0)
        p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [1]))
        l = p.sum(axis=0)
        p_smem[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()
        def pv(acc):
            plgpu.wgmma(acc, v_smem if INTERP else v_smem.transpose((1, 0)), p_smem)
            return acc[...]
        o = pl.run_scoped(pv, plgpu.ACC((128, N), jnp.float32))
        o = o / lax.broadcast_in_dim(l, o.shape, [1])
        o_smem[...] = o
        m_ref[...] = m
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref)
        plgpu.wait_smem_to_gmem(0)
    kw = {}
    if INTERP:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams()
    return plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((128, N), jnp.float32), jax.ShapeDtypeStruct((N,), jnp.float32)),
                        scratch_types=(plgpu.SMEM((64, 128), jnp.bfloat16), plgpu.SMEM(v.shape, jnp.bfloat16),
                                       plgpu.SMEM(q.shape, jnp.bfloat16), plgpu.SMEM((64, N), jnp.bfloat16),
                                       plgpu.SMEM((128, N), jnp.float32),
                                       plgpu.Barrier(num_barriers=3)),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **kw)(k, v, q)

S = jax.ShapeDtypeStruct
if INTERP:
    import numpy as np
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((N, 128)) * 0.1, jnp.bfloat16)
    o, m = f(k, v.T, q.T)
    s = (q.astype(jnp.float32) @ k.astype(jnp.float32).T)  # [N, 64]
    p = jnp.exp2(s - s.max(1, keepdims=True)); ref = (p @ v.astype(jnp.float32)) / p.sum(1, keepdims=True)
    print("m err", float(jnp.max(jnp.abs(m - s.max(1)))), "o rel", float(jnp.linalg.norm(o.T - ref) / jnp.linalg.norm(ref)))
else:
    try:
        txt = jax.jit(f).trace(S((64, 128), jnp.bfloat16), S((64, 128), jnp.bfloat16), S((N, 128), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        print("LOWERED", N, len(txt))
    except Exception as e:
        import traceback; traceback.print_exc(limit=2)
        print("FAIL", N, type(e).__name__, str(e)[:800])
