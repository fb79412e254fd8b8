"""Input validation shared by every public attention entry point.

User errors raise ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong
shape or value) naming the argument, what was received and what was expected.

Traced lengths and indices cannot be checked up front: every implementation clamps them (the
clamp rule, README "Conventions").  With ``check_ranges=True`` an entry point adds
``checkify`` checks (:func:`check_range`) that report them; the caller then wraps the call in
``jax.experimental.checkify.checkify`` (``errors=checkify.user_checks``), as any
``checkify.check`` needs.  Without it the compiled program holds no check at all (a
``debug_check`` would still cost a host callback on some jax versions' GPU lowering).

The dtype rule of every entry point: queries, keys and values share one floating dtype
(float16, bfloat16 or float32); anything else is a ``TypeError`` naming both arguments and
their dtypes (as ``jax.nn.dot_product_attention``).  Nothing is promoted.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


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


def check_same_dtype(name_a: str, a: Any, name_b: str, b: Any) -> None:
    """The dtype rule (module docstring): ``a`` and ``b`` have one dtype, else a ``TypeError``
    naming both."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} and {name_b} must have the same dtype (float16, bfloat16 or "
                        f"float32; nothing is promoted), got {name_a} {a.dtype} and {name_b} "
                        f"{b.dtype}")


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
            raise TypeError(f"{dtype_of} and {name} must have the same dtype (float16, bfloat16 or "
                            f"float32; nothing is promoted), got {dtype_of} {jnp.dtype(dtype)} and "
                            f"{name} {x.dtype}")


def check_range(name: str, x: Any, lo: Any, hi: Any, *, enabled: bool, bounds: str | None = None,
                rule: str = "clamped to them") -> None:
    """With ``enabled``, for a traced integer array ``x``: a ``checkify.check`` that every value
    lies in ``[lo, hi]`` (``lo``/``hi`` scalars or arrays broadcastable to ``x``; ``bounds``
    describes them in the message, default ``"[lo, hi]"``), reported with the values under
    ``checkify.checkify(f, errors=checkify.user_checks)``.  Nothing otherwise (see the module
    docstring).  ``rule`` says what the library does with out-of-range values."""
    if not enabled or is_concrete(x):
        return
    bounds = f"[{lo}, {hi}]" if bounds is None else bounds
    checkify.check(jnp.all((x >= lo) & (x <= hi)),
                   f"{name} out of range: values must be in {bounds} (out-of-range values are "
                   f"{rule}), got {{}}", x)


def check_lengths(name: str, lengths: Any, batch: int, max_len: int, *, checked: bool = False) -> None:
    """Check a per-sequence length vector ``[batch]``; values are checked when concrete (a
    ``ValueError``), else, with ``checked``, by :func:`check_range` (they are clamped to
    ``[0, max_len]``)."""
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
    else:
        check_range(name, lengths, 0, max_len, enabled=checked)


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


def check_qkv(q: Any, k: Any, v: Any, *, kv_lengths: Any = None, sm_scale: Any = None,
              check_ranges: bool = False) -> None:
    """Validate ``q [B, Tq, Hq, D]``, ``k/v [B, Tk, Hkv, D]`` and the optional arguments
    (``check_ranges``: checkify checks of traced lengths, see the module docstring)."""
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_array("k", k, 4, layout="[batch, seq_k, heads_kv, head_dim]")
    check_array("v", v, 4, layout="[batch, seq_k, heads_kv, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    check_same_dtype("q", q, "k", k)
    check_same_dtype("q", q, "v", v)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got q head_dim {q.shape[3]} "
                         f"and k head_dim {k.shape[3]}")
    check_gqa(q.shape[2], k.shape[2])
    if kv_lengths is not None:
        check_lengths("kv_lengths", kv_lengths, q.shape[0], k.shape[1], checked=check_ranges)
    check_sm_scale(sm_scale)


def check_gqa(heads_q: int, heads_kv: int) -> None:
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q must be a multiple of heads_kv (GQA), got heads_q={heads_q} "
                         f"and heads_kv={heads_kv}")


def check_impl(impl: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(impl, str) or impl not in allowed:
        raise ValueError(f"impl must be one of {allowed}, got {impl!r}")


def check_prefix_groups(prefix_name: str, prefix_shape: tuple, batch: int, *, suffix_lengths: Any,
                        suffix_cap: int, prefix_lengths: Any, seq_to_prefix: Any,
                        check_ranges: bool) -> tuple[Any, Any, Any]:
    """The length and group arguments of a shared-prefix call with ``G, P = prefix_shape[:2]``
    (``prefix_name`` names the prefix array in messages): ``suffix_lengths [batch]`` in
    ``[0, suffix_cap]``, ``prefix_lengths [G]`` (default ``P``), ``seq_to_prefix [batch]`` in
    ``[0, G)`` (required when ``G > 1``).  Returns them as int32 ``(seq_to_prefix,
    prefix_lengths, suffix_lengths)``."""
    g, p = prefix_shape[:2]
    if g < 1:
        raise ValueError(f"{prefix_name} must hold at least one prefix group, got shape {tuple(prefix_shape)}")
    check_lengths("suffix_lengths", suffix_lengths, batch, suffix_cap, checked=check_ranges)
    if prefix_lengths is None:
        prefix_lengths = jnp.full((g,), p, jnp.int32)
    else:
        check_lengths("prefix_lengths", prefix_lengths, g, p, checked=check_ranges)
    if seq_to_prefix is None:
        if g != 1:
            raise ValueError(f"seq_to_prefix [batch={batch}] is required when there are G={g} prefix "
                             f"groups ({prefix_name} shape {tuple(prefix_shape)})")
        seq_to_prefix = jnp.zeros((batch,), jnp.int32)
    else:
        if not hasattr(seq_to_prefix, "shape"):
            raise TypeError(f"seq_to_prefix must be an integer array of shape [{batch}], got "
                            f"{type(seq_to_prefix).__name__}")
        check_array("seq_to_prefix", seq_to_prefix, 1, floating=False, layout=f"[batch={batch}]")
        if seq_to_prefix.shape[0] != batch:
            raise ValueError(f"seq_to_prefix must have shape [{batch}], got {tuple(seq_to_prefix.shape)}")
        if is_concrete(seq_to_prefix):
            vals = np.asarray(seq_to_prefix)
            if vals.size and (vals.min() < 0 or vals.max() >= g):
                raise ValueError(f"seq_to_prefix values must be in [0, {g}) (the number of prefix "
                                 f"groups), got range [{int(vals.min())}, {int(vals.max())}]")
        else:
            check_range("seq_to_prefix", seq_to_prefix, 0, g - 1, enabled=check_ranges)
    return (jnp.asarray(seq_to_prefix, jnp.int32), jnp.asarray(prefix_lengths, jnp.int32),
            jnp.asarray(suffix_lengths, jnp.int32))

