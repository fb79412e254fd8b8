import sys, os, re
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
from bench.timing import loop_time
from bench.shared_prefix import make_inputs, ours
from pallas_kernels.decode_attention import rows_from_q

for b in (256, 512, 1024):
    hq, hkv, d, g = 32, 8, 128, 4
    q = jax.random.normal(jax.random.PRNGKey(0), (b, hq, d), jnp.bfloat16)
    va = lambda q: rows_from_q(q[:, None], hkv, g)
    vb = lambda q: jnp.swapaxes(q.reshape(b, hkv, g * d), 0, 1).reshape(hkv, b * g, d)
    vc = lambda q: jnp.einsum("bhd->hbd", q.reshape(b, hkv, g * d)).reshape(hkv, b * g, d)
    res = {}
    for name, f in (("rows_from_q", va), ("swapaxes", vb), ("einsum", vc)):
        fn = lambda q, f=f: f(q).reshape(b, hq, d)  # same shape back for the loop
        res[name] = round(loop_time(fn, q, ()) * 1e6, 1)
    print(b, "transpose us (in loop, incl. loop add):", res, flush=True)
    if b == 1024:
        args = make_inputs(b, 4096, 128, hkv, hq, d)
        txt = jax.jit(ours("shared")).lower(*args).compile().as_text()
        open(os.environ.get("OUT", "/tmp") + "/shared_b1024.hlo", "w").write(txt)
        for m in re.finditer(r"\n(%?\S*transpose\S*) = .*", txt):
            print(m.group(0)[:300])
