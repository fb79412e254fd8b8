"""Session 20 review check: hashes of the jaxprs (kernel bodies included, no source locations)
of every Mosaic GPU kernel that runs prefix tiles.  The refactor that moved the per-tile step into
``prefix_attention_mgpu.prefix_tile_step`` left all 17 identical.  Run from the repository root
(CPU)."""
import hashlib, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
from jax import ShapeDtypeStruct as S
from pallas_kernels.prefix_attention_mgpu import prefix_partials_mgpu
from pallas_kernels.joint_decode_mgpu import joint_decode_mgpu
from pallas_kernels.shared_decode_mgpu import shared_decode_partials_mgpu
import test_decoupled_decode_mgpu as tdd
bf = jnp.bfloat16
def low(fn, *avals):
    return str(jax.make_jaxpr(fn)(*avals))   # the kernels' jaxprs (no source locations)
cases = {}
for d in (64, 128):
    for sched in (True, False):
        for pers in (None, 100):
            cases[f"prefix d{d} sched{sched} pers{pers}"] = lambda d=d, sched=sched, pers=pers: low(
                lambda q, k, v, n: prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, num_splits=4,
                                                        schedule_barrier=sched, persistent_ctas=pers),
                S((8, 1024, d), bf), S((4096, 8, d), bf), S((4096, 8, d), bf), S((1,), jnp.int32))
    cases[f"prefix d{d} 3 stages"] = lambda d=d: low(
        lambda q, k, v, n: prefix_partials_mgpu(q, k, v, n, scale=d ** -0.5, max_concurrent_steps=3),
        S((8, 1024, d), bf), S((4096, 8, d), bf), S((4096, 8, d), bf), S((1,), jnp.int32))
b, hq, hkv, p, s = 64, 32, 8, 1024, 128
for d in (64, 128):
    for sb in (True, False):
        cases[f"joint d{d} sched{sb}"] = lambda d=d, sb=sb: low(
            lambda q, pk, pv, n, sk, sv, sl: joint_decode_mgpu(q, pk, pv, n, sk, sv, sl, scale=d ** -0.5,
                                                               group=4, num_splits=2, block_s=64,
                                                               schedule_barrier=sb),
            S((hkv, b * 4, d), bf), S((p, hkv, d), bf), S((p, hkv, d), bf), S((), jnp.int32),
            S((b, s, hkv, d), bf), S((b, s, hkv, d), bf), S((b,), jnp.int32))
    cases[f"one-launch d{d}"] = lambda d=d: low(
        lambda q, pk, pv, n, sk, sv, sl: shared_decode_partials_mgpu(q, pk, pv, n, sk, sv, sl, scale=d ** -0.5,
                                                                     group=4, suffix_splits=2, block_s=64),
        S((hkv, b * 4, d), bf), S((p, hkv, d), bf), S((p, hkv, d), bf), S((), jnp.int32),
        S((b, 256, hkv, d), bf), S((b, 256, hkv, d), bf), S((b,), jnp.int32))
cases["decoupled"] = lambda: low(tdd._decode, S((256, 32, 128), bf), S((4096, 8, 128), bf),
                                 S((4096, 8, 128), bf), S((256, 128, 8, 128), bf),
                                 S((256, 128, 8, 128), bf), S((256,), jnp.int32))
for name, f in cases.items():
    try:
        h = hashlib.sha256(f().encode()).hexdigest()[:16]
    except Exception as e:
        h = f"ERROR {type(e).__name__}: {str(e)[:100]}"
    print(name, h, flush=True)
