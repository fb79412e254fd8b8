"""Session 18: lower the draft decoupled kernel for CUDA on the CPU with parts removed (argv: comma-separated variant names) to find what defeats Mosaic GPU's layout inference."""
# The draft this script reads was superseded by pallas_kernels/decoupled_decode_mgpu.py (session 19)
# and removed; recover it with: git show 8fdfd45:bench/results/logs/session18_decoupled_decode_mgpu_draft.py
import sys, re, importlib.util
import jax, jax.numpy as jnp
src = open('bench/results/logs/session18_decoupled_decode_mgpu_draft.py').read()
variants = sys.argv[1].split(",")
if "nolse" in variants:
    src = src.replace("""ls_ref.at[h, jnp.minimum(g_seq, b_out - 1)][...] = jnp.where(
                        has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)""", "pass")
if "noostore" in variants:
    src = src.replace("""so_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(dtype)""", "pass")
if "nofinal" in variants:
    src = src.replace("@pl.when(t == s_tiles - 1)     # the sequence's state", "@pl.when(t == -5)     # the sequence's state")
if "noattend" in variants:
    src = src.replace("acc, m_i, l_i = lax.cond(key0 < n, attend, lambda *c: c, acc, m_i, l_i)", "acc, m_i, l_i = attend(acc, m_i, l_i)")
if "nosuffix" in variants:
    src = src.replace("lax.fori_loop(0, n_suf, step, fresh())", "pass")
if "noreset" in variants:
    src = src.replace("return lax.cond(t == s_tiles - 1, fresh, lambda *c: c, acc, m_i, l_i)", "return acc, m_i, l_i")
if "nomask" in variants:
    src = src.replace("sv = jnp.where(keys < n, s, -jnp.inf)", "sv = s")
if "nozero" in variants:
    src = src.replace("_zero_rows_past(v_tile, key0, n, transposed=_cpu_check)", "pass")
if "nopv" in variants:
    src = src.replace("acc = pl.run_state(pv)(plgpu.ACC.init(acc))", "pass")
if "nopstore" in variants:
    src = src.replace("sp_smem[...] = prob.astype(dtype)", "pass")
if "nomuse" in variants:
    src = src.replace("m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)", "m_use = m_new")
if "noloadq" in variants:
    src = src.replace("""                @pl.when(has_next & (t == s_tiles - 1))   # the queries too, after a sequence
                def _():
                    load_q(i + 1)""", "")
if "noprefix" in variants:
    src = src.replace("@pl.when(wg < 2)\n        def _compute():", "@pl.when(wg < -2)\n        def _compute():")
    src = src.replace("""            pm.wg_compute_context(""", """            return
            pm.wg_compute_context(""")
if "noloads" in variants:
    src = src.replace("""                @pl.when(has_next)          # the K buffer is free: the next step's K
                def _():
                    load_k(u + 1)""", "")
    src = src.replace("""                @pl.when(has_next)          # V of step u - 1 is consumed: the next step's V
                def _():
                    load_v(u + 1)""", "")
if "noplog" in variants:
    src = src.replace("""            load_q(0)
            load_k(0)
            load_v(0)""", "")
if "nowaits" in variants:
    src = src.replace("plgpu.barrier_wait(sk_bar.at[0])", "pass").replace("plgpu.barrier_wait(sv_bars.at[slot])", "pass")
    src = src.replace("""                @pl.when(t == 0)
                def _():
                    plgpu.barrier_wait(sq_bar.at[0])""", "")
for nm, call in (("noplq", "load_q(0)"), ("noplk", "load_k(0)"), ("noplv", "load_v(0)")):
    if nm in variants:
        src = src.replace("            " + call + "\n", "")
if "qstatic" in variants:
    src = src.replace("else q_ref.at[h, pl.ds(row, COLS)])", "else q_ref.at[0, pl.ds(0, COLS)])")
if "qrowh" in variants:
    src = src.replace("else q_ref.at[h, pl.ds(row, COLS)])", "else q_ref.at[h, pl.ds(0, COLS)])")
if "qrow" in variants:
    src = src.replace("else q_ref.at[h, pl.ds(row, COLS)])", "else q_ref.at[0, pl.ds(row, COLS)])")
if "rownomin" in variants:
    src = src.replace("row = jnp.minimum(seq_index(i), b_out - 1) * g", "row = seq_index(i) * g")
if "rownomul" in variants:
    src = src.replace("row = jnp.minimum(seq_index(i), b_out - 1) * g", "row = jnp.minimum(seq_index(i), b_out - 1)")
if "rowlaxmin" in variants:
    src = src.replace("row = jnp.minimum(seq_index(i), b_out - 1) * g", "row = lax.min(seq_index(i), jnp.int32(b_out - 1)) * g")
if "zlnone" in variants:
    src = src.replace("keys = _iota(shape, 1 if transposed else 0)", "keys = lax.broadcasted_iota(jnp.int32, shape, 1 if transposed else 0)")
if "zltr" in variants:
    src = src.replace("keys = _iota(shape, 1 if transposed else 0)", "keys = plgpu.broadcasted_iota(jnp.int32, shape, 1 if transposed else 0, layout=plgpu.Layout.WGMMA_TRANSPOSED)")
if "noos" in variants:
    src = src.replace("""                    os_ref.at[h, g_seq][...] = (
                        acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(dtype)""", "")
open('/tmp/ddv.py','w').write(src)
spec = importlib.util.spec_from_file_location("ddv", "/tmp/ddv.py"); dd = importlib.util.module_from_spec(spec); spec.loader.exec_module(dd)
S = jax.ShapeDtypeStruct
B, Hq, Hkv, D, P, Sc = 256, 32, 8, 128, 4096, 128
G = Hq // Hkv; m = -(-B * G // 128) * 128
def f(q, pk, pv, pl_, sk, sv, sl):
    return dd.decoupled_decode_mgpu(q, pk, pv, pl_, sk, sv, sl, scale=D ** -0.5, group=G)
try:
    jax.jit(f).trace(S((Hkv, m, D), jnp.bfloat16), S((P, Hkv, D), jnp.bfloat16), S((P, Hkv, D), jnp.bfloat16),
                     S((1,), jnp.int32), S((B, Sc, Hkv, D), jnp.bfloat16), S((B, Sc, Hkv, D), jnp.bfloat16),
                     S((B,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    print(variants, "LOWERED")
except Exception as e:
    print(variants, "FAIL", type(e).__name__, str(e)[:200])
