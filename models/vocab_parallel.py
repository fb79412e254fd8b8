"""The vocabulary split over a mesh axis: embedding lookup, greedy choice, log-probabilities and
sampling over vocabulary shards, without gathering full logits where the result does not need
them.

Every function here runs per shard inside :func:`jax.shard_map` and takes the name of the mesh
axis the vocabulary is split over.  Shard ``i`` of that axis holds the contiguous vocabulary rows
``[i * V_loc, (i + 1) * V_loc)`` (embedding ``[V_loc, H]``, logits ``[B, V_loc]``); the padded
vocabulary ``V' = V_loc * axis_size`` may exceed the real ``vocab_size`` (ids ``>= vocab_size``
are padding: their logits are masked to ``-inf``).

* :func:`embed_lookup` -- each shard looks up the tokens it holds (zero rows elsewhere); one
  ``psum`` of ``[B, T, H]`` assembles the embeddings (exactly: one shard contributes each row).
  Ids outside ``[0, V')`` get a zero row (the one-device lookup clips them; callers validate
  token ids against the vocabulary).
* :func:`greedy_tokens` -- local ``max`` and ``argmax``, then ``pmax`` of the maxima (and of
  a NaN flag) and ``pmin`` of the global ids that reach it: the lowest id among the largest
  logits, or the first NaN of a row holding one, as ``jnp.argmax`` over the whole row.  Two
  small collectives instead of ``[B, V]``.
* :func:`token_logprobs` -- ``log_softmax`` at chosen ids from a sharded ``logsumexp`` (``pmax``
  then ``psum`` of ``[B]``) and the picked logit (``psum`` of ``[B]``).
* :func:`sample_tokens` -- greedy through :func:`greedy_tokens`; temperature / top-k / top-p
  gather the ``[B, V]`` rows of the shard's sequences over the axis and draw with
  :func:`models.sampling.sample_tokens`, so a sequence's samples are the ones one device draws.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.sampling import SamplingConfig
from models.sampling import sample_tokens as full_row_sample

__all__ = ["embed_lookup", "gather_logits", "greedy_tokens", "masked_logits", "sample_tokens", "token_logprobs"]


def _local_ids(v_local: int, axis: str) -> jax.Array:
    """Global vocabulary ids ``[V_loc]`` int32 of this shard."""
    return jax.lax.axis_index(axis).astype(jnp.int32) * v_local + jnp.arange(v_local, dtype=jnp.int32)


def embed_lookup(table_vh: jax.Array, tokens_bt: jax.Array, axis: str) -> jax.Array:
    """Embeddings ``[B, T, H]`` of global token ids from this shard's rows ``table [V_loc, H]``
    (every shard returns the whole, summed result)."""
    v = table_vh.shape[0]
    local = tokens_bt - jax.lax.axis_index(axis).astype(tokens_bt.dtype) * v
    mine = (local >= 0) & (local < v)
    rows = jnp.take(table_vh, jnp.clip(local, 0, v - 1), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), axis)


def masked_logits(logits_bv: jax.Array, vocab_size: int, axis: str) -> jax.Array:
    """This shard's logits ``[B, V_loc]`` float32 with padded ids (``>= vocab_size``) at ``-inf``."""
    ids = _local_ids(logits_bv.shape[-1], axis)
    return jnp.where(ids < vocab_size, logits_bv.astype(jnp.float32), -jnp.inf)


def greedy_tokens(logits_bv: jax.Array, vocab_size: int, axis: str) -> jax.Array:
    """``argmax`` ``[B]`` int32 over the whole vocabulary, as ``jnp.argmax`` of the whole rows:
    the lowest id among the largest logits, or the lowest id holding a NaN in a row with one."""
    x = masked_logits(logits_bv, vocab_size, axis)
    offset = jax.lax.axis_index(axis).astype(jnp.int32) * x.shape[-1]
    nan = jnp.isnan(x)
    has_nan = jnp.any(nan, axis=-1)
    clean = jnp.where(nan, -jnp.inf, x)
    best = jnp.max(clean, axis=-1)
    arg = jnp.where(has_nan, jnp.argmax(nan, axis=-1), jnp.argmax(clean, axis=-1)).astype(jnp.int32) + offset
    top, row_nan = jax.lax.pmax(jnp.stack([best, has_nan.astype(jnp.float32)]), axis)
    mine = jnp.where(row_nan > 0, has_nan, best == top)
    return jax.lax.pmin(jnp.where(mine, arg, jnp.iinfo(jnp.int32).max), axis)


def token_logprobs(logits_bv: jax.Array, tokens_b: jax.Array, vocab_size: int, axis: str) -> jax.Array:
    """``log_softmax(logits)[b, tokens[b]]`` ``[B]`` float32 over the whole vocabulary."""
    x = masked_logits(logits_bv, vocab_size, axis)
    top = jax.lax.pmax(jnp.max(x, axis=-1), axis)
    lse = top + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(x - top[:, None]), axis=-1), axis))
    ids = _local_ids(x.shape[-1], axis)
    picked = jax.lax.psum(jnp.sum(jnp.where(ids[None, :] == tokens_b[:, None], x, 0.0), axis=-1), axis)
    return picked - lse


def gather_logits(logits_bv: jax.Array, vocab_size: int, axis: str) -> jax.Array:
    """The whole rows ``[B, vocab_size]`` (an all-gather over ``axis``, padding dropped)."""
    return jax.lax.all_gather(logits_bv, axis, axis=1, tiled=True)[:, :vocab_size]


def sample_tokens(logits_bv: jax.Array, keys_b: jax.Array, step, cfg: SamplingConfig, vocab_size: int,
                  axis: str) -> jax.Array:
    """Next tokens ``[B]`` int32, the tokens :func:`models.sampling.sample_tokens` draws from the
    whole rows (see module docstring)."""
    if cfg.greedy:
        return greedy_tokens(logits_bv, vocab_size, axis)
    return full_row_sample(gather_logits(logits_bv, vocab_size, axis), keys_b, step, cfg)
