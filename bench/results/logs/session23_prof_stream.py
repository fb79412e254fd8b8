"""Session 23: one kernel to profile with Nsight Compute: the role-split kernel's stream role
alone (``DBG=noprefix``, the default) or both roles (``DBG=``), Hq=32/Hkv=8 B=512 P=8K S=128 on
103 + 29 CTAs.  Log: ``session23_ncu_stream_noprefix_h200.txt``, from
``ncu --section WarpStateStats --section SourceCounters --section SpeedOfLight
--section MemoryWorkloadAnalysis --section SchedulerStats -k regex:'^kernel' -c 1 python3 <this>``."""
import os, jax, jax.numpy as jnp
from bench.shared_prefix import make_inputs
from pallas_kernels import split_decode_mgpu as sd
b, p, s, hkv, hq = 512, 8192, 128, 8, 32
q, pk, pv, sk, sv, sl = make_inputs(b, p, s, hkv, hq, 128)
dbg = os.environ.get("DBG", "noprefix")
f = jax.jit(lambda q, sk, sv, sl: sd.split_decode_mgpu(q, pk, pv, jnp.full((1,), p, jnp.int32), sk, sv, sl, prefix_ctas=103, stream_ctas=29, num_splits=4, _debug=dbg))
for _ in range(3):
    f(q, sk, sv, sl).block_until_ready()
