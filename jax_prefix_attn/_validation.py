"""Input validation shared by every public attention entry point.

User errors raise ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
shape or value) naming the argument, what was received and what was expected.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x: Any) -> bool:
    """True when ``x``'s value is known on the host (not a tracer)."""
    if isinstance(x, (np.ndarray, np.generic, int)):
        return True
    if isinstance(x, jax.core.Tracer):
        return False
    return isinstance(x, jax.Array) and getattr(x, "is_fully_addressable", True)


def check_array(name: str, x: Any, ndim: int | tuple[int, ...], *, floating: bool = True,
                layout: str = "") -> None:
    """Check that ``x`` is an array of rank ``ndim`` with a floating (or integer) dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        want = " or ".join(str(n) for n in ndims)
        raise ValueError(
            f"{name} must have rank {want}{' ' + layout if layout else ''}, "
            f"got shape {tuple(x.shape)} (rank {x.ndim})")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32), got {x.dtype}")
    if not floating and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")


def check_kv(name_k: str, k: Any, name_v: str, v: Any, ndim: int | tuple[int, ...], *,
             layout: str, dtype: Any, dtype_of: str) -> None:
    """Check keys ``k`` and values ``v``: floating arrays of rank ``ndim`` (``layout``) of the same
    shape, both of ``dtype`` (the dtype of the argument named ``dtype_of``)."""
    check_array(name_k, k, ndim, layout=layout)
    check_array(name_v, v, ndim, layout=layout)
    if k.shape != v.shape:
        raise ValueError(f"{name_k} and {name_v} must have the same shape, got {name_k} "
                         f"{tuple(k.shape)} and {name_v} {tuple(v.shape)}")
    for name, x in ((name_k, k), (name_v, v)):
        if x.dtype != dtype:
            raise TypeError(f"{name} must have {dtype_of}'s dtype {dtype}, got {x.dtype}")


def check_lengths(name: str, lengths: Any, batch: int, max_len: int) -> None:
    """Check a per-sequence length vector ``[batch]``; values are checked when concrete."""
    if not hasattr(lengths, "shape"):
        raise TypeError(f"{name} must be an integer array of shape [{batch}], got {type(lengths).__name__}")
    check_array(name, lengths, 1, floating=False, layout=f"[batch={batch}]")
    if lengths.shape[0] != batch:
        raise ValueError(f"{name} must have shape [{batch}] (one length per batch entry), "
                         f"got shape {tuple(lengths.shape)}")
    if is_concrete(lengths):
        vals = np.asarray(lengths)
        if vals.size and vals.min() < 0:
            raise ValueError(f"{name} must be >= 0, got minimum {int(vals.min())}")
        if vals.size and vals.max() > max_len:
            raise ValueError(f"{name} must be <= {max_len} (the key axis size), got maximum {int(vals.max())}")


def check_bool(name: str, value: Any) -> None:
    """A flag must be a Python (or NumPy) bool: a traced or array value cannot pick a code path."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_sm_scale(sm_scale: Any) -> None:
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"sm_scale must be a Python float or None, got {type(sm_scale).__name__}")
    if not np.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")


def check_qkv(q: Any, k: Any, v: Any, *, kv_lengths: Any = None, sm_scale: Any = None) -> None:
    """Validate ``q [B, Tq, Hq, D]``, ``k/v [B, Tk, Hkv, D]`` and the optional arguments."""
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_array("k", k, 4, layout="[batch, seq_k, heads_kv, head_dim]")
    check_array("v", v, 4, layout="[batch, seq_k, heads_kv, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise TypeError(f"k and v must have the same dtype, got k {k.dtype} and v {v.dtype}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got q head_dim {q.shape[3]} "
                         f"and k head_dim {k.shape[3]}")
    check_gqa(q.shape[2], k.shape[2])
    if kv_lengths is not None:
        check_lengths("kv_lengths", kv_lengths, q.shape[0], k.shape[1])
    check_sm_scale(sm_scale)


def check_gqa(heads_q: int, heads_kv: int) -> None:
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q must be a multiple of heads_kv (GQA), got heads_q={heads_q} "
                         f"and heads_kv={heads_kv}")


def check_impl(impl: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(impl, str) or impl not in allowed:
        raise ValueError(f"impl must be one of {allowed}, got {impl!r}")
