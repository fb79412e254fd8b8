"""Exact merging of partial attention states through their log-sum-exp.

If ``(o_n, lse_n)`` is attention of the same queries over disjoint key sets
``K_n``, attention over their union is

    lse = log(sum_n exp(lse_n))
    out = sum_n exp(lse_n - lse) * o_n

(Hydragen section 3.1 / Appendix A; RelayAttention section 3.3).  Empty parts
(``lse_n = -inf``) contribute nothing; if every part is empty the result is
``out = 0``, ``lse = -inf``.  Gradients are finite in all these cases.  A part is empty only
where its ``lse`` is exactly ``-inf``: a NaN ``lse``, or a non-finite ``out`` of a part that is
not empty, makes the merged ``out`` and ``lse`` NaN.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jax_prefix_attn._validation import check_array, check_same_dtype
from pallas_kernels._common import flag_nonfinite, merge_stacked

__all__ = ["merge_attention_states", "merge_two"]


def _merge_stacked(outs_nbthd: jax.Array, lses_nbth: jax.Array) -> tuple[jax.Array, jax.Array]:
    out, lse = merge_stacked(outs_nbthd.astype(jnp.float32), lses_nbth.astype(jnp.float32))
    return out.astype(outs_nbthd.dtype), flag_nonfinite(jax.lax.stop_gradient(out), lse)


def merge_attention_states(outs, lses) -> tuple[jax.Array, jax.Array]:
    """Merge ``N >= 1`` partial attention states.

    Args:
      outs: ``[N, *lead, D]`` stacked partial outputs, or a sequence of ``N`` arrays
        ``[*lead, D]`` (``lead`` is usually ``[B, Tq, Hq]``).
      lses: ``[N, *lead]`` float log-sum-exps (natural log), or a sequence of them.

    Returns:
      ``(out [*lead, D]`` in the dtype of ``outs``, ``lse [*lead]`` float32).
    """
    if isinstance(outs, (list, tuple)):
        if len(outs) == 0:
            raise ValueError("outs must hold at least one partial state, got an empty sequence")
        if not isinstance(lses, (list, tuple)) or len(lses) != len(outs):
            got = len(lses) if isinstance(lses, (list, tuple)) else type(lses).__name__
            raise ValueError(f"lses must be a sequence of the same length as outs ({len(outs)}), got {got}")
        for i, (o, l) in enumerate(zip(outs, lses)):
            check_array(f"outs[{i}]", o, tuple(range(1, 8)))
            check_array(f"lses[{i}]", l, tuple(range(0, 7)))
            if o.shape != outs[0].shape:
                raise ValueError(f"outs[{i}] must have shape {tuple(outs[0].shape)} like outs[0], got {tuple(o.shape)}")
            check_same_dtype("outs[0]", outs[0], f"outs[{i}]", o)
            if tuple(l.shape) != tuple(o.shape[:-1]):
                raise ValueError(f"lses[{i}] must have shape {tuple(o.shape[:-1])} (outs[{i}]'s shape "
                                 f"without head_dim), got {tuple(l.shape)}")
        outs = jnp.stack(outs)
        lses = jnp.stack([jnp.asarray(l, jnp.float32) for l in lses])
    check_array("outs", outs, tuple(range(2, 9)), layout="[N, *lead, head_dim]")
    check_array("lses", lses, tuple(range(1, 8)), layout="[N, *lead]")
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"lses must have shape {tuple(outs.shape[:-1])} (outs' shape without head_dim), "
                         f"got {tuple(lses.shape)}")
    if outs.shape[0] < 1:
        raise ValueError("outs must hold at least one partial state (N >= 1), got N = 0")
    return _merge_stacked(outs, lses)


def merge_two(out_a, lse_a, out_b, lse_b) -> tuple[jax.Array, jax.Array]:
    """Merge two partial states ``(out [*lead, D], lse [*lead])``."""
    return merge_attention_states([out_a, out_b], [lse_a, lse_b])
