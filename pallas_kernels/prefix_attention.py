"""Inter-sequence batched prefix attention (Pallas, Triton lowering).

Hydragen section 3.2: the queries of *all* sequences that share a prefix attend to the same
keys, so for each kv head their rows ``(sequence, query position, query head of the GQA
group)`` are stacked into the M dimension of one matrix-matrix product against the prefix.
Each prefix tile is then loaded once per ``block_m`` rows instead of once per sequence, and the
work runs on tensor cores.

Layout: rows are ``q_hmd [Hkv, B_sorted * R2, D]`` with ``R2 = next_pow2(Tq * Hq / Hkv)`` rows
per sequence (compact, so no 16-row padding per sequence is computed), sequences sorted by
prefix group.  Row blocks of ``block_m`` rows are multiples of ``R2``; a block that straddles a
group boundary loops over both groups' prefixes (the kernel of :mod:`decode_attention` loops
over the pool entries present in a block), every other block reads one prefix.  When
``Hkv * (rows / block_m)`` programs are too few to fill the GPU, the prefix is split across
programs (split-KV) and the splits are merged by the suffix pass or by XLA.

Tilings (:func:`jax_prefix_attn.leaves.triton_prefix.prefix_tiling`, from the device profile's
``large_m_tiling`` and ``prefix_tiling``), on an H200: with enough rows to run unsplit, 64-key
tiles, 8 warps, 3 stages and the two-phase key loop; otherwise 128 x 64 tiles, 4 warps and 2
stages (their rates: ``docs/performance.md``, "Planner regions and tilings").
"""
from __future__ import annotations

from pallas_kernels.decode_attention import Source, ragged_attention
from pallas_kernels.decode_attention import supported as _triton_supported

__all__ = ["prefix_partials", "supported"]


def supported(*, head_dim: int, dtype) -> str | None:
    """``None`` when :func:`prefix_partials` takes ``head_dim`` and ``dtype``, else the reason."""
    return _triton_supported(head_dim=head_dim, dtype=dtype)


def prefix_partials(q_hmd, prefix_k, prefix_v, row_group, row_limit, *, scale, block_m, block_k,
                    num_splits, num_warps, num_stages, interpret=False, two_phase=False):
    """Batched prefix attention: float32 partials ``(o [splits, Hkv, M, D], lse [splits, Hkv, M])``.

    ``q_hmd [Hkv, M, D]`` rows sorted by ``row_group [M]`` (prefix entry of ``prefix_k/v
    [G, P, Hkv, D]``), ``row_limit [M]`` visible prefix keys per row (0 for padding rows).
    """
    return ragged_attention(q_hmd, [Source(prefix_k, prefix_v, row_group, row_limit)],
                            scale=scale, block_m=block_m, block_k=block_k, num_splits=num_splits,
                            finalize=False, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret, two_phase=two_phase)
