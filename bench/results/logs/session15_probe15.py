"""Session 15 probe: where the one-pass joint kernel's step time goes.  Variants patch
``shared_decode_mgpu.suffix_step`` (looked up when the joint kernel is traced) so the suffix
tiles are still loaded through the pipeline but their compute is cut down (timing only: the
outputs of jload/jmma/jnomask are wrong by construction).
jn = joint kernel as committed; jload = suffix tiles loaded, no suffix compute; jmma = the two
suffix wgmmas, no mask/softmax; jnomask = full softmax without the row/key masks; pre = the
independent path's prefix kernel alone; base = the default path."""
import functools, json, os, statistics, sys, time
import jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from bench.timing import GRAPH_ALWAYS, device_info
from jax_prefix_attn import shared_prefix_attention
from pallas_kernels import prefix_attention as pa
from pallas_kernels import shared_decode_mgpu as sd
from pallas_kernels import prefix_attention_mgpu as pm

PTS = [tuple(int(x) for x in s.split(":")) for s in sys.argv[1].split(",")]
VARS = sys.argv[2].split(",")
budget = float(os.environ.get("AB_BUDGET", 300))
t_start = time.time()
print(json.dumps(dict(header=device_info(), commit=os.environ.get("COMMIT"))), flush=True)
ORIG = sd.suffix_step

def step_load(*, carry, **kw):
    return carry

def step_mma(*, q_smem, k_smem, v_smem, carry, block_s, dtype, p_smem, cpu_check, **kw):
    s = pm.wg_scores(q_smem, k_smem, shape=(64, block_s), cpu_check=cpu_check)
    acc, m, l = carry
    acc = pm.wg_accumulate_pv(acc, s.astype(dtype), v_smem, p_smem, cpu_check=cpu_check)
    return acc, m, l

def step_nomask(*, q_smem, k_smem, v_smem, carry, block_s, dtype, p_smem, cpu_check,
                scale_log2, **kw):
    s = pm.wg_scores(q_smem, k_smem, shape=(64, block_s), cpu_check=cpu_check)
    acc, m_new, l_i, p16 = pm.softmax_step(s, None, carry, scale_log2=scale_log2, dtype=dtype)
    acc = pm.wg_accumulate_pv(acc, p16, v_smem, p_smem, cpu_check=cpu_check)
    return acc, m_new, l_i

J = {"MGPU_MERGE": "joint", "JOINT_SCHEDULE_BARRIER": False}
SET = {"base": ({}, None), "indep": ({"MGPU_MERGE": "independent"}, None),
       "jn": (J, None), "jload": (J, step_load), "jmma": (J, step_mma),
       "jnomask": (J, step_nomask),
       "jn1": (dict(J, JOINT_SPLITS=1), None), "jload1": (dict(J, JOINT_SPLITS=1), step_load),
       "jp2": (dict(J, JOINT_PREFETCH=2), None), "jp4": (dict(J, JOINT_PREFETCH=4), None),
       "jp8": (dict(J, JOINT_PREFETCH=8), None), "jloadp4": (dict(J, JOINT_PREFETCH=4), step_load)}

def make_fn(var):
    if var == "pre":
        def fn(q, pk, pv, sk, sv, sl):
            o, lse, _ = pa.decode_prefix_partials(q, pk, pv, jnp.int32(pk.shape[0]),
                                                  scale=q.shape[-1] ** -0.5)
            return o.reshape(-1)[:q.size].reshape(q.shape)
        return fn
    attrs, step = SET[var]
    def fn(q, pk, pv, sk, sv, sl):
        old = {k: getattr(pa, k) for k in attrs}
        for k, v in attrs.items():
            setattr(pa, k, v)
        if step is not None:
            sd.suffix_step = step
        try:
            return shared_prefix_attention(q[:, None], pk, pv, sk, sv, suffix_lengths=sl,
                                           impl="shared")[:, 0]
        finally:
            sd.suffix_step = ORIG
            for k, v in old.items():
                setattr(pa, k, v)
    return fn

def looped(var, n):
    fn = make_fn(var)
    @functools.partial(jax.jit, compiler_options=GRAPH_ALWAYS)
    def run(q, *rest):
        def body(_, q):
            return (q + fn(q, *rest).astype(q.dtype) * 1e-3).astype(q.dtype)
        return jax.lax.fori_loop(0, n, body, q)
    return run, fn

for b, p, s, hq in PTS:
    if time.time() - t_start > budget:
        print(json.dumps(dict(point=[b, p, s, hq], skipped=True)), flush=True)
        continue
    hkv = 8 if hq == 32 else 1
    args = make_inputs(b, p, s, hkv, hq, 128)
    rec = dict(point=[b, p, s, hq])
    runs, outs = {}, {}
    for var in VARS:
        try:
            run1, fn = looped(var, 4)
            jax.block_until_ready(run1(*args)); t0 = time.perf_counter(); jax.block_until_ready(run1(*args))
            t1 = (time.perf_counter() - t0) / 4
            n = max(4, min(2048, int(0.03 / max(t1, 1e-6))))
            run, _ = looped(var, n)
            jax.block_until_ready(run(*args))
            runs[var] = (run, n)
            outs[var] = jax.jit(fn)(*args).astype(jnp.float32)
        except Exception as e:  # noqa: BLE001
            rec[f"{var}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    ok = [v for v in VARS if v in runs]
    for var in ok:
        rec[f"{var}_maxdiff"] = float(jnp.abs(outs[var] - outs[ok[0]]).max())
    ts = {v: [] for v in ok}
    for _ in range(5):
        for var in ok:
            run, n = runs[var]
            t0 = time.perf_counter(); jax.block_until_ready(run(*args))
            ts[var].append((time.perf_counter() - t0) / n * 1e6)
    for var in ok:
        rec[f"{var}_us"] = round(statistics.median(ts[var]), 2)
        rec[f"{var}_over_{ok[0]}"] = round(rec[f"{var}_us"] / statistics.median(ts[ok[0]]), 3)
    print(json.dumps(rec), flush=True)
