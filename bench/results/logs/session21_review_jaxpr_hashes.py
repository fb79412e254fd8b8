"""Session 21 review check: hashes of the streamed suffix kernel's jaxprs (kernel body included, no
source locations) at five variants (two workers with the token / separate scratch, three workers,
one worker, the interpreter form).  Identical before and after the review mend that moved its
in-place-or-fresh accumulation and wgmma-layout iota into prefix_attention_mgpu (wg_accumulate,
wgmma_iota); session20_kernel_jaxpr_hashes.py gave the same 17 hashes for the other kernels.
Run from the repository root (CPU)."""
import hashlib, jax, jax.numpy as jnp
from jax import ShapeDtypeStruct as S
from pallas_kernels.suffix_stream_mgpu import suffix_stream_mgpu
bf = jnp.bfloat16
for wgs, sep, interp in [(2, False, False), (2, True, False), (3, False, False), (1, False, False), (2, False, True)]:
    f = lambda q, k, v, l: suffix_stream_mgpu(q, k, v, l, scale=0.1, group=4, ctas=4, wgs=wgs, separate_scratch=sep, interpret=interp)
    t = str(jax.make_jaxpr(f)(S((8, 2048, 128), bf), S((512, 128, 8, 128), bf), S((512, 128, 8, 128), bf), S((512,), jnp.int32)))
    print("stream", wgs, sep, interp, hashlib.sha256(t.encode()).hexdigest()[:16])
