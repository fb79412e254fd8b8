"""Collective matmul for the tensor-parallel decode step: the all-reduces of the row-parallel
projections overlapped with the matmuls of other rows of the batch.

On a mesh, a decoder layer ends in two row-parallel matmuls, each followed by an all-reduce over
the ``model`` axis: the o projection (``[B, Hq_loc * D] @ wo [Hq_loc * D, H]``) and the down
projection (``[B, F_loc] @ w_down [F_loc, H]``).  The all-reduce of ``[B, H]`` depends on the
whole matmul, and the next op (the residual add, the norm, the next matmul) on the whole
all-reduce, so in the plain step (:class:`models.llama.Llama` with ``model_axis``) the GPU
computes nothing while the collective runs.

With ``overlap_chunks = c > 1`` the layer's rows (the batch: one decode token per sequence) are
split into ``c`` chunks after attention.  Sequences are independent from the o projection to the
end of the layer, so each chunk runs its own chain: o projection, all-reduce, residual, norm,
SwiGLU MLP, all-reduce, residual.  Chunk ``i``'s all-reduce is issued as soon as its matmul is
done and has no data dependence on chunk ``i + 1``'s matmuls, so the GPU can run the NCCL kernel
(on XLA's collective stream) while the compute stream does the next chunk's matmul, a software
pipeline of the form::

    mm_o(0) | ar_o(0) + mm_o(1) | ar_o(1) + mlp(0) | ar_m(0) + mlp(1) | ar_m(1)

Only the last chunk's all-reduce (``1 / c`` of the bytes) is exposed when every matmul chunk
outlasts the all-reduce beside it.  Attention stays whole: the shared-prefix kernels read the
prefix once per batch, and splitting it would read it once per chunk.

Why batch rows and ``psum`` rather than the other forms of a collective matmul:

* XLA on GPU runs an all-reduce as an asynchronous pair (``all-reduce-start`` /
  ``all-reduce-done``) on a stream of its own and may schedule independent compute between the
  two (the latency hiding scheduler, ``--xla_gpu_enable_latency_hiding_scheduler=true``, plans
  this with a cost model).  What it needs is independent compute to place there, which row
  chunks give.  Whether a given XLA version's schedule does overlap them is a measurement
  (``bench/tensor_parallel.py --overlap-chunks``), not a property of this code.
* Splitting the output columns (``H``) instead gives chunks whose all-reduces are independent
  too, but the next op (RMSNorm over ``H``) needs every column, so the overlap ends at the
  projection; row chunks carry it through the whole MLP.
* A ``ppermute`` ring reduce-scatter (the TPU collective matmul) on 2 GPUs has one step: it hides
  the send of the peer's half behind the matmul of one's own half, and the all-gather that
  follows stays exposed (half the traffic).
* A reduce-scatter + all-gather per chunk moves the same bytes as the all-reduce (a ring
  all-reduce is exactly that) as two collectives, each with its own latency.

Independent all-reduces are what XLA's all-reduce combiner merges into one (to save latency),
which would put every chunk's reduction after the last chunk's matmul.  The chunks' all-reduces
are therefore chained by data: before its all-reduce, the first element of a chunk's partial
sums gets ``0 * s`` added in place, ``s`` one element of the previous all-reduce's result
(replaced by 0 unless finite, so the value is unchanged up to the sign of a zero and no NaN or
infinity crosses rows).  The collectives form one chain (the collectives of one communicator
run in order anyway), none can be combined with another, and no matmul waits for a collective
it does not read: the dependence enters through a one-element in-place update after the GEMM,
not through an elementwise op on its whole output, which XLA could fuse into the GEMM as an
epilogue (the GEMM would then wait for the previous all-reduce).  Neither an
``optimization_barrier`` tying each operand to the previous result nor a scalar token reduced
beside each chunk keeps them apart: XLA expands barriers into their operands before it combines
collectives, and ``psum`` of a tuple lowers to one all-reduce per operand, which XLA combines.

The result equals the plain step's: every row goes through the same ops; only the matmuls are
issued per chunk (on a GPU the chunked GEMMs may pick other kernels, so the sums can differ in
the last bits).  Chunks are contiguous row ranges of near-equal sizes; with fewer rows than
chunks each row is a chunk.

* :class:`CollectiveMatmul` -- the option (``overlap_chunks``), validated.
* :func:`row_chunks` -- the ``(start, stop)`` row ranges.
* :func:`overlapped_layer_tail` -- o projection to the end of the layer, chunked and chained.
* :class:`OverlappedLlama` -- a per-shard :class:`~models.llama.Llama` whose layers end with
  :func:`overlapped_layer_tail` (what :class:`models.sharded_llama.ShardedLlama` runs in its
  decode step when ``overlap_chunks > 1``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.layers import dense, rms_norm, swiglu_mlp
from models.llama import Llama

__all__ = ["CollectiveMatmul", "OverlappedLlama", "overlapped_layer_tail", "row_chunks"]


@dataclasses.dataclass(frozen=True)
class CollectiveMatmul:
    """How the tensor-parallel decode step reduces its row-parallel projections (module
    docstring).  ``overlap_chunks``: row chunks whose all-reduces overlap the other chunks'
    matmuls; 1 is the plain step (one all-reduce of ``[B_loc, H]`` after each projection)."""
    overlap_chunks: int = 1

    def __post_init__(self):
        v = self.overlap_chunks
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"CollectiveMatmul.overlap_chunks must be an int >= 1, got {v!r}")
        object.__setattr__(self, "overlap_chunks", int(v))

    @property
    def overlapped(self) -> bool:
        """Whether the step is chunked (``overlap_chunks > 1``)."""
        return self.overlap_chunks > 1


def row_chunks(rows: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of ``min(chunks, rows)`` contiguous ranges covering ``rows`` rows, sizes
    differing by at most one (the larger ones first); one empty range for ``rows = 0``."""
    n = max(1, min(chunks, rows))
    base, extra = divmod(rows, n)
    bounds = np.cumsum([0] + [base + (i < extra) for i in range(n)])
    return tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))


def _after(x: jax.Array, previous: jax.Array | None) -> jax.Array:
    """``x`` made data-dependent on ``previous`` without changing its value (module docstring):
    its first element plus ``0 * s``, ``s`` the first element of ``previous`` where finite, else
    0 (XLA does not fold a floating ``* 0``), written back in place."""
    if previous is None:
        return x
    s = previous.reshape(-1)[0]
    zero = (jnp.where(jnp.isfinite(s), s, jnp.zeros((), s.dtype)) * jnp.zeros((), s.dtype)).astype(x.dtype)
    origin = (0,) * x.ndim
    return jax.lax.dynamic_update_slice(x, jax.lax.dynamic_slice(x, origin, (1,) * x.ndim) + zero, origin)


def overlapped_layer_tail(lp: dict, x_bth: jax.Array, attn_btk: jax.Array, *, eps: float, axis: str,
                          chunks: int) -> jax.Array:
    """The end of a tensor-parallel decoder layer, from the attention output to the layer's
    output, with the all-reduces of the row-parallel projections overlapped (module docstring).

    ``lp``: the layer's per-shard parameters (``wo [K_loc, H]``, ``mlp_norm [H]``,
    ``w_gate``/``w_up [H, F_loc]``, ``w_down [F_loc, H]``); ``x_bth [B, T, H]``: the layer's
    input (the residual stream, the same on every shard); ``attn_btk [B, T, K_loc]``: this
    shard's attention output (its heads, ``K_loc = Hq_loc * D``); ``axis``: the mesh axis the
    projections' partial sums are reduced over.  Returns ``[B, T, H]``, the value of::

        x = x + psum(attn @ wo);  x + psum(swiglu(rms_norm(x)))

    computed per chunk of rows of ``B``, with the ``2 * min(chunks, B)`` all-reduces chained in
    the order o projections of every chunk, then down projections of every chunk."""
    last = None
    mids = []
    for a, b in row_chunks(x_bth.shape[0], chunks):
        last = jax.lax.psum(_after(dense(attn_btk[a:b], lp["wo"]), last), axis)
        mids.append(x_bth[a:b] + last.astype(x_bth.dtype))
    outs = []
    for mid in mids:
        partial = swiglu_mlp(rms_norm(mid, lp["mlp_norm"], eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        last = jax.lax.psum(_after(partial, last), axis)
        outs.append(mid + last.astype(mid.dtype))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


class OverlappedLlama(Llama):
    """The per-shard :class:`~models.llama.Llama` (``model_axis`` set) whose layers end with
    :func:`overlapped_layer_tail` in ``collective.overlap_chunks`` row chunks; everything else
    (attention, cache, embedding, LM head) is the parent's.  Hashable and comparable with the
    option included."""

    def __init__(self, config: LlamaConfig, *, collective: CollectiveMatmul, impl: str = "auto",
                 shared_impl: str = "levels", interpret: bool = False, model_axis: str):
        if not isinstance(collective, CollectiveMatmul):
            raise TypeError(f"collective must be a CollectiveMatmul, got {type(collective).__name__}")
        if not isinstance(model_axis, str):
            raise TypeError(f"model_axis must be a mesh axis name (str), got {type(model_axis).__name__}")
        super().__init__(config, impl=impl, shared_impl=shared_impl, interpret=interpret, model_axis=model_axis)
        self.collective = collective

    def __hash__(self):
        return hash((super().__hash__(), self.collective))

    def __eq__(self, other):
        return (isinstance(other, OverlappedLlama) and super().__eq__(other)
                and self.collective == other.collective)

    def layer_forward(self, lp: dict, x_bth: jax.Array, pos_bt: jax.Array, attend) -> tuple[jax.Array, tuple]:
        """:meth:`models.llama.Llama.layer_forward` with the layer's tail from the o projection
        on overlapped (:func:`overlapped_layer_tail`)."""
        b, t, _ = x_bth.shape
        q, k, v = self.qkv(lp, x_bth, pos_bt)
        attn = attend(q, k, v).reshape(b, t, q.shape[2] * q.shape[3])
        out = overlapped_layer_tail(lp, x_bth, attn, eps=self.config.rms_norm_eps, axis=self.model_axis,
                                    chunks=self.collective.overlap_chunks)
        return out, (k, v)
