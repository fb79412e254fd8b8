"""Session 22 review check: hashes of the role-split kernel's jaxprs at three variants (three stream
workers, two, the interpreter form), identical before and after the review mend that made the
stream's TMA issue one helper (suffix_stream_mgpu.stream_issue_loads) for both kernels;
session21_review_jaxpr_hashes.py gave the same five stream-kernel hashes.  Run from the
repository root (CPU)."""
import hashlib, jax, jax.numpy as jnp
from jax import ShapeDtypeStruct as S
from pallas_kernels import split_decode_mgpu as sd
bf = jnp.bfloat16
for kw, interp in [(dict(prefix_ctas=104, stream_ctas=28), False), (dict(prefix_ctas=100, stream_ctas=32, stream_wgs=2), False), (dict(prefix_ctas=4, stream_ctas=2), True)]:
    f = lambda q,pk,pv,pl_,sk,sv,sl: sd.split_decode_mgpu(q,pk,pv,pl_,sk,sv,sl,interpret=interp,**kw)
    t = str(jax.make_jaxpr(f)(S((512,32,128),bf),S((8192,8,128),bf),S((8192,8,128),bf),S((1,),jnp.int32),S((512,128,8,128),bf),S((512,128,8,128),bf),S((512,),jnp.int32)))
    print("split", kw, interp, hashlib.sha256(t.encode()).hexdigest()[:16])
# split {'prefix_ctas': 104, 'stream_ctas': 28} False 55385372ed23513f
# split {'prefix_ctas': 100, 'stream_ctas': 32, 'stream_wgs': 2} False 1d7ee0dbc645fbab
# split {'prefix_ctas': 4, 'stream_ctas': 2} True fc3abd6983d714b1
