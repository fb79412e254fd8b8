"""A seeded sample of shared-prefix shapes and the leaf the planner picks for each on an H200,
shared by the CPU lowering test and the GPU correctness test of every planner-chosen leaf.

The sample: the README's decode shapes (Hq/Hkv/D = 32/8/128, bf16, one prefix, ``Tq = 1``) that
once failed to lower on a jax release, then, for every leaf of :data:`LEAVES`, random shapes in
B 1-2048, P 1-16K, S 1-1K, G 1-4 prefixes, Tq 1-4, GQA groups 1-8, D 64/128, bf16/fp16 drawn
until the planner (``impl`` auto, shared or flat, H200 profile) picks that leaf
``PER_LEAF`` times.  Shapes whose reference would not fit a GPU test's memory budget
(:data:`MAX_SCORES` score entries) are redrawn.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_prefix_attn import plan_shared_prefix
from jax_prefix_attn.device import H200

__all__ = ["Case", "LEAVES", "README_SHAPES", "PER_LEAF", "MAX_SCORES", "sample_cases", "plan_for"]

LEAVES = ("MgpuSplit", "MgpuJoint", "MgpuOneLaunch", "MgpuTwoLaunch", "TritonOverlap",
          "TritonTwoLaunch", "FlatOwn", "FlatRows")
# (B, P, S) at Hq/Hkv/D = 32/8/128, bf16, Tq = 1, one prefix
README_SHAPES = ((512, 8192, 128), (1024, 4096, 64), (1024, 16384, 256), (3, 129, 5),
                 (256, 4096, 256))
PER_LEAF = 13
MAX_SCORES = 2 ** 30          # B * Tq * Hq * (P + S): float32 scores of the reference


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape: ``q [b, tq, hq, d]``, ``groups`` prefixes of ``p`` keys (``groups == 1``: one
    prefix ``[P, Hkv, D]``), suffixes of capacity ``s``; ``impl`` as planned; ``leaf`` the leaf
    the planner picks on an H200."""
    b: int
    tq: int
    hq: int
    hkv: int
    d: int
    groups: int
    p: int
    s: int
    dtype: str
    impl: str
    leaf: str

    @property
    def id(self) -> str:
        return (f"{self.leaf}-b{self.b}-tq{self.tq}-h{self.hq}x{self.hkv}-d{self.d}-g{self.groups}"
                f"-p{self.p}-s{self.s}-{self.dtype}-{self.impl}")


def plan_for(case: Case, device=H200):
    """The plan ``shared_prefix_attention(..., impl=case.impl)`` makes for ``case`` on
    ``device``."""
    return plan_shared_prefix(batch=case.b, tq=case.tq, heads_q=case.hq, heads_kv=case.hkv,
                              head_dim=case.d, groups=case.groups, prefix_len=case.p,
                              suffix_len=case.s, dtype=case.dtype, impl=case.impl, device=device)


def _leaf(**shape) -> str:
    plan = plan_for(Case(**shape, leaf=""))
    return "+".join(sorted({type(c.leaf).__name__ for c in plan.chunks}))


def _draw(rng: np.random.Generator) -> dict:
    """Random shapes; half of them in the Mosaic GPU decode region's form (one prefix, ``Tq =
    1``, 128-key prefix tiles, 64-key suffix tiles), which uniform draws seldom reach."""
    hkv = int(rng.choice([1, 2, 4, 8]))
    group = int(rng.choice([1, 2, 4, 8]))
    d = int(rng.choice([64, 128]))
    dtype = "bfloat16" if rng.random() < 0.7 else "float16"
    impl = str(rng.choice(["auto", "auto", "shared", "flat"]))
    if rng.random() < 0.5:   # the leaves' regions sit at round sizes: draw those half the time
        round_sizes = rng.random() < 0.5
        return dict(b=int(rng.choice([32, 64, 128, 256, 512, 1024, 2048])), tq=1, hq=hkv * group,
                    hkv=hkv, d=d, groups=1,
                    p=int(rng.choice([1024, 2048, 4096, 8192, 16384])) if round_sizes
                    else 128 * int(rng.integers(1, 129)),
                    s=int(rng.choice([64, 128, 256, 1024])) if round_sizes
                    else 64 * int(rng.integers(1, 17)), dtype=dtype, impl=impl)
    groups = int(rng.integers(1, 5)) if rng.random() < 0.4 else 1
    return dict(b=max(groups, int(np.exp(rng.uniform(0, np.log(2048))))),
                tq=int(rng.choice([1, 1, 2, 3, 4])), hq=hkv * group, hkv=hkv, d=d, groups=groups,
                p=int(np.exp(rng.uniform(0, np.log(16384)))),
                s=int(np.exp(rng.uniform(0, np.log(1024)))), dtype=dtype, impl=impl)


def sample_cases(seed: int = 55, per_leaf: int = PER_LEAF) -> list[Case]:
    """The README shapes (auto) and ``per_leaf`` random shapes for each leaf of :data:`LEAVES`."""
    cases = [Case(b=b, tq=1, hq=32, hkv=8, d=128, groups=1, p=p, s=s, dtype="bfloat16",
                  impl="auto", leaf=_leaf(b=b, tq=1, hq=32, hkv=8, d=128, groups=1, p=p, s=s,
                                          dtype="bfloat16", impl="auto"))
             for b, p, s in README_SHAPES]
    rng = np.random.default_rng(seed)
    want = {leaf: per_leaf for leaf in LEAVES}
    for _ in range(20_000):
        if not any(want.values()):
            break
        shape = _draw(rng)
        if shape["b"] * shape["tq"] * shape["hq"] * (shape["p"] + shape["s"]) > MAX_SCORES:
            continue
        try:
            leaf = _leaf(**shape)
        except ValueError:   # a forced family that cannot run these shapes
            continue
        if want.get(leaf, 0) > 0:
            want[leaf] -= 1
            cases.append(Case(**shape, leaf=leaf))
    return cases
