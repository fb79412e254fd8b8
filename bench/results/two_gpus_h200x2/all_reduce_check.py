"""All-reduce across 2 GPUs at decode-sized and large operands, under the XLA_FLAGS given."""
import os, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
res = []
for n in (8 * 4096, 4 * 1024 * 1024):
    f = jax.jit(shard_map(lambda x: jax.lax.psum(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))
    x = jnp.ones((2, n), jnp.bfloat16)
    try:
        res.append((n, float(np.asarray(f(x)).ravel()[0])))
    except Exception as e:
        res.append((n, "FAIL " + repr(e)[:160]))
print(jax.__version__, repr(os.environ.get("XLA_FLAGS", "")), res, flush=True)
