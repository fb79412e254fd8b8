"""Program tiles of the tree kernels, bounded by the shared memory one CTA may allocate.

A schedule's work item is a block of ``block_m`` query vectors over ``block_kv``-key chunks
(:mod:`pallas_kernels.tree_attention`); the *program tile* is the part of it one program holds
at a time.  By default the two agree; given ``smem_bytes`` (the device's ``smem_per_block``) the
functions here shrink the tile until the estimated shared memory of the Triton lowering fits:
rows are cut into more programs (each row's softmax is independent of the others') and a chunk's
keys into consecutive steps of the same online softmax (or, for dQ, the same sum), so the
result is the same up to float rounding whatever the tile.

Estimates, in bytes, ``s`` the itemsize of q/k/v, ``m`` rows, ``c`` keys per step, ``d`` the
head_dim.  float32 dots (``precision=HIGHEST``) run on the FMA units with both operands staged
through shared memory, so the score tile ``[m, c]`` is there too; 16-bit dots need less, and
the same bound covers them:

* forward (:func:`partials_smem`): ``s * (m*d + m*c + 4*c*d)``;
* dK/dV (:func:`dkv_smem`, ``bk`` key columns per program): ``s * (m*(2d + bk + 8) + 2*bk*d)``;
* dQ (:func:`dq_smem`, ``step`` keys per loop step in ``bq``-column slices):
  ``s * (m*(2d + bq + 8) + (step/bq)*(2*bq*d + 4*bq) + 2*bq*d)``.

Each bound is at least the ``ttg.shared`` size Triton allocates for the kernel lowered for sm_90
(``num_stages=2``, the kernels' warps), checked for float32 and bfloat16, head_dim 64/128/256,
16-512 rows and 16-256 keys, whole and split tiles: 1.00-1.32x the allocation for float32 (the
forward's 128 x 128 tile at head_dim 64: 229,376 estimated, 197,120 allocated; a 4,096-row
tile: 3,276,800 estimated, 3,246,080 allocated) and 1.00-2.33x for bfloat16 (an overestimate
only shrinks a tile that would have fitted).
"""
from __future__ import annotations

import jax.numpy as jnp

__all__ = ["partials_smem", "dkv_smem", "dq_smem", "partials_tile", "dkv_rows", "dq_tile", "MIN_TILE"]

MIN_TILE = 16  # smallest rows / keys of a program tile (a Triton dot needs >= 16)


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def partials_smem(rows: int, cols: int, head_dim: int, dtype) -> int:
    """Estimated shared memory (bytes) of a forward program (``tree_partials``) holding ``rows``
    query vectors over ``cols`` keys per step."""
    m, c, d = rows, cols, head_dim
    return _itemsize(dtype) * (m * d + m * c + 4 * c * d)


def dkv_smem(rows: int, block_k: int, head_dim: int, dtype) -> int:
    """Estimated shared memory (bytes) of a dK/dV program: ``block_k`` key columns, ``rows``
    query vectors per loop step."""
    m, d = rows, head_dim
    return _itemsize(dtype) * (m * (2 * d + block_k + 8) + 2 * block_k * d)


def dq_smem(rows: int, step: int, block_k: int, head_dim: int, dtype) -> int:
    """Estimated shared memory (bytes) of a dQ program: ``rows`` query vectors, ``step`` keys per
    loop step unrolled in ``block_k``-column slices."""
    m, d, bq = rows, head_dim, block_k
    return _itemsize(dtype) * (m * (2 * d + bq + 8) + (step // bq) * (2 * bq * d + 4 * bq) + 2 * bq * d)


def _too_big(what: str, smem_bytes: int, need: int):
    return ValueError(f"no {what} tile fits smem_bytes={smem_bytes}: the smallest needs an estimated "
                      f"{need} bytes of shared memory (head_dim too large for this device)")


def _shrink(tile: tuple, need, pick, what: str, smem_bytes: int | None) -> tuple:
    """``tile`` with one size halved at a time -- the one whose index ``pick(*tile)`` names (None:
    none may shrink) -- until ``need(*tile)`` bytes fit ``smem_bytes`` (None: no bound)."""
    tile = list(tile)
    while smem_bytes is not None and need(*tile) > smem_bytes:
        i = pick(*tile)
        if i is None:
            raise _too_big(what, smem_bytes, need(*tile))
        tile[i] //= 2
    return tuple(tile)


def partials_tile(block_m: int, block_kv: int, head_dim: int, dtype, smem_bytes: int | None) -> tuple[int, int]:
    """``(rows, cols)`` of a forward program for items of ``block_m`` query vectors and
    ``block_kv``-key chunks: the item's own when ``smem_bytes`` is None or it fits; else the
    larger of the two halved (keys on a tie: a key step costs no extra reads, a row cut re-reads
    the keys) until the estimate fits.  Powers of two dividing the item's, >= :data:`MIN_TILE`."""
    def pick(rows, cols):
        if cols >= rows and cols > MIN_TILE:
            return 1
        return 0 if rows > MIN_TILE else 1 if cols > MIN_TILE else None
    return _shrink((block_m, block_kv), lambda r, c: partials_smem(r, c, head_dim, dtype), pick, "forward",
                   smem_bytes)


def dkv_rows(block_m: int, block_k: int, head_dim: int, dtype, smem_bytes: int | None) -> int:
    """Query vectors per loop step of a dK/dV program: ``block_m`` (one item's rows) when
    ``smem_bytes`` is None or it fits, else halved until the estimate fits."""
    (rows,) = _shrink((block_m,), lambda r: dkv_smem(r, block_k, head_dim, dtype),
                      lambda r: 0 if r > MIN_TILE else None, "dK/dV", smem_bytes)
    return rows


def dq_tile(block_m: int, block_kv: int, block_k: int, head_dim: int, dtype,
            smem_bytes: int | None) -> tuple[int, int, int]:
    """``(rows, step, bq)`` of a dQ program: the item's rows, its whole chunk per loop step and
    ``block_k``-column slices when ``smem_bytes`` is None or they fit; else the step halved down to
    the slice first, then the rows, then the slice (down to :data:`MIN_TILE`)."""
    def pick(rows, step, bq):
        return 1 if step > bq else 0 if rows > MIN_TILE else 2 if bq > MIN_TILE else None
    return _shrink((block_m, block_kv, block_k), lambda r, st, q: dq_smem(r, st, q, head_dim, dtype), pick, "dQ",
                   smem_bytes)
