"""Shape buckets of the differential fuzz harness (see :mod:`fuzz_cases`).

GQA groups 1-16 (3, 5, 6, 7 and 12 among them), head_dim 16-256 (24 and 96: zero-padded by
the library), float32 / bfloat16 / float16, one or several prefix groups, ``Tq`` 1 (decoding)
to multi-query chunks, forests with several roots, inner sequences, single-level and shallow
forests and draft token trees.  ``"cpu"`` buckets are small (the kernels run in interpret
mode; each bucket compiles each implementation once, which is most of the run's time);
``"gpu"`` buckets have realistic sizes for the compiled default paths.
"""
from __future__ import annotations

from fuzz_cases import AttnBucket, MergeBucket, SharedBucket, TreeBucket

F32, BF16, F16 = "float32", "bfloat16", "float16"

# families in the proportion of cases they get (out of 20)
SHARE = (("shared", 8), ("tree", 5), ("attention", 4), ("merge", 3))

CPU = {
    "shared": [SharedBucket(3, 1, 3, 1, 16, 1, 20, 9, F32),       # group 3, decoding
               SharedBucket(4, 3, 10, 2, 16, 2, 24, 12, BF16),    # group 5, 2 prefixes
               SharedBucket(2, 2, 14, 2, 24, 1, 17, 8, F32),      # group 7, head_dim 24
               SharedBucket(3, 1, 12, 1, 16, 3, 16, 5, F16),      # group 12, 3 prefixes
               SharedBucket(2, 4, 16, 1, 16, 1, 9, 16, BF16),     # group 16, Tq 4
               SharedBucket(3, 2, 4, 4, 64, 2, 33, 7, F32)],      # group 1, head_dim 64
    "attention": [AttnBucket(2, 5, 13, 6, 1, 16, True, F32),      # group 6
                  AttnBucket(3, 1, 20, 8, 4, 24, False, BF16),    # group 2
                  AttnBucket(2, 7, 7, 24, 2, 16, True, F16)],     # group 12
    "tree": [TreeBucket(1, (2, 3, 2, 20, (1, 2)), 1, 6, 2, 16, 8, F32,
                        impls=("reference", "flatten", "hybrid", "auto_gpu")),   # group 3
             TreeBucket(2, (1, 3, 3, 30, (1, 2)), 3, 5, 1, 16, 6, BF16,
                        impls=("reference", "levelwise", "mirror")),             # group 5
             TreeBucket(3, (2, 2, 2, 15, (1, 2)), 4, 7, 1, 16, 9, F32, drafts=True,
                        impls=("reference", "flatten")),                         # group 7
             TreeBucket(4, (3, 1, 0, 25, (1, 3)), 1, 4, 2, 16, 5, F16,
                        impls=("reference", "auto_gpu", "nodes"))],              # single level
    "merge": [MergeBucket(3, 2, 2, 4, 16, F32), MergeBucket(40, 1, 2, 3, 8, BF16)],
}
CPU_MORE = {
    "shared": [SharedBucket(2, 1, 12, 2, 16, 1, 8, 4, F32),       # group 6
               SharedBucket(2, 3, 8, 4, 16, 2, 10, 6, BF16),      # group 2
               SharedBucket(3, 1, 8, 1, 16, 1, 12, 3, F32),       # group 8
               SharedBucket(2, 1, 8, 2, 96, 1, 10, 5, BF16)],     # head_dim 96
    "attention": [AttnBucket(2, 3, 9, 5, 1, 16, True, F32),       # group 5
                  AttnBucket(1, 4, 6, 7, 1, 96, False, F32)],     # group 7, head_dim 96
    "tree": [TreeBucket(5, (1, 2, 5, 8, (1, 3)), 1, 6, 1, 16, 4, F32,
                        impls=("reference", "auto_gpu")),                        # shallow, group 6
             TreeBucket(6, (1, 4, 2, 40, (1, 2)), 2, 16, 1, 16, 5, BF16,
                        impls=("reference", "nodes"))],                          # group 16
    "merge": [MergeBucket(2, 3, 1, 8, 32, F16)],
}
GPU = {
    "shared": [SharedBucket(64, 1, 32, 8, 128, 1, 2048, 256, BF16, True),
               SharedBucket(128, 1, 32, 8, 128, 1, 2048, 128, BF16, True),  # Mosaic GPU
               SharedBucket(128, 1, 8, 1, 128, 1, 1024, 256, BF16, True),   # group 8
               SharedBucket(16, 4, 28, 4, 128, 2, 1024, 512, BF16),    # group 7, 2 prefixes
               SharedBucket(32, 1, 40, 8, 128, 1, 1024, 64, F16, True),  # group 5 (Mosaic GPU rows)
               SharedBucket(8, 8, 24, 8, 96, 1, 512, 256, BF16),       # group 3, head_dim 96
               SharedBucket(64, 1, 12, 1, 64, 4, 1024, 128, F32),      # group 12, 4 prefixes
               SharedBucket(16, 2, 64, 4, 256, 1, 512, 64, BF16)],     # group 16, head_dim 256
    "attention": [AttnBucket(4, 512, 512, 32, 8, 128, True, BF16),
                  AttnBucket(2, 1, 4096, 28, 4, 128, False, BF16),     # group 7
                  AttnBucket(2, 300, 700, 40, 8, 96, True, F16),       # group 5, head_dim 96
                  AttnBucket(1, 1024, 1024, 12, 1, 256, True, F32)],   # group 12
    "tree": [TreeBucket(11, (1, 3, 4, 600, (2, 6)), 1, 32, 8, 128, 256, BF16,
                        impls=("reference", "auto", "flatten", "hybrid")),
             TreeBucket(12, (2, 4, 3, 300, (1, 4)), 4, 24, 8, 128, 128, BF16,
                        impls=("reference", "auto", "levelwise")),       # group 3
             TreeBucket(13, (1, 2, 8, 1000, (1, 3)), 8, 40, 8, 128, 64, BF16, drafts=True,
                        impls=("reference", "auto", "flatten")),         # group 5, drafts
             TreeBucket(14, (4, 1, 0, 2000, (4, 16)), 1, 28, 4, 128, 128, F16,
                        impls=("reference", "auto")),                    # group 7, single level
             TreeBucket(15, (1, 2, 6, 64, (2, 4)), 1, 32, 8, 128, 128, BF16,
                        impls=("reference", "auto"))],                   # shallow
    "merge": [MergeBucket(3, 64, 1, 32, 128, BF16), MergeBucket(40, 8, 4, 8, 64, F32)],
}


def buckets(platform: str) -> dict:
    """``{family: [bucket, ...]}`` on ``platform``."""
    if platform != "cpu":
        return GPU
    return {fam: lst + CPU_MORE[fam] for fam, lst in CPU.items()}
