"""A :class:`~models.prefix_sharing.PromptBatch` into a DeepSeek latent cache: the prefill half of
the :class:`~models.decoder.Decoder` interface of :class:`~models.deepseek.Deepseek`.

The latent cache has one level of shared prompts (:class:`~models.deepseek.cache.LatentPrefix`,
``seq_to_prefix``), so the batch's prefix levels are folded into one:

* ``attention="shared"`` with levels: every node of the deepest level is stored once with its
  whole path (its ancestors' tokens, then its own: :meth:`PromptBatch.single_level`), sequence
  ``b`` hangs from node
  ``b // (B // G)``, and each sequence's own tokens are appended to its suffix buffer
  (:meth:`Deepseek.extend`, absorbed MLA over the shared latent prompt);
* ``attention="flat"``, or a batch without levels: every sequence's whole prompt is its own
  prompt entry (``G = B``; the flat baseline, each sequence reading its prompt through
  ``seq_to_prefix``), the suffix buffers start empty.

Prompt entries are right-padded to the longest (rounded up by
:func:`~models.prefix_sharing.bucket_length` with ``shape_buckets``); suffixes are left-padded as
:meth:`PromptBatch.suffix_arrays` gives them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.deepseek.cache import LatentCache, init_latent_cache
from models.prefix_sharing import PromptBatch, bucket_length

__all__ = ["ATTENTION_LAYOUTS", "prefill_prompt_batch", "prompt_entries"]

ATTENTION_LAYOUTS = ("shared", "flat")


def prompt_entries(prompts: PromptBatch, attention: str) -> tuple[list[list[int]], np.ndarray, PromptBatch]:
    """``(stored prompts, seq_to_prefix [B], the batch whose suffixes are appended)`` (module
    docstring); ``ValueError`` naming ``attention`` outside :data:`ATTENTION_LAYOUTS`."""
    if attention not in ATTENTION_LAYOUTS:
        raise ValueError(f"attention: received {attention!r}, expected one of {ATTENTION_LAYOUTS} for the "
                         f"deepseek family")
    b = prompts.batch
    if attention == "flat" or not prompts.levels:
        whole = [prompts.full_prompt(i) for i in range(b)]
        return whole, np.arange(b, dtype=np.int32), PromptBatch.plain([()] * b)
    nodes = prompts.single_level().levels[0]
    return [list(n) for n in nodes], (np.arange(b) // (b // len(nodes))).astype(np.int32), prompts


def prefill_prompt_batch(model, params: dict, prompts: PromptBatch, *, capacity: int, attention: str,
                         shape_buckets: bool) -> tuple[jax.Array, LatentCache]:
    """``(logits [B, V] after each sequence's last prompt token, cache)`` of ``prompts`` through
    ``model`` (a :class:`~models.deepseek.Deepseek`); ``capacity``: the suffix buffer length."""
    stored, s2p, rest = prompt_entries(prompts, attention)
    width = max(len(s) for s in stored)
    width = bucket_length(width) if shape_buckets else width
    toks = np.zeros((len(stored), width), np.int32)
    for j, s in enumerate(stored):
        toks[j, :len(s)] = s
    lens = np.asarray([len(s) for s in stored], np.int32)
    prefix = model.prefill_prefix_jit(params, jnp.asarray(toks), jnp.asarray(lens))
    cache = init_latent_cache(model.config, prefix, s2p, capacity)
    logits = prefix.last_logits[jnp.asarray(s2p)]
    suf, n = rest.suffix_arrays(buckets=shape_buckets)
    if suf.shape[1] == 0:
        return logits, cache
    new_logits, cache = model.extend_jit(params, cache, jnp.asarray(suf), jnp.asarray(n))
    return jnp.where(jnp.asarray(n > 0)[:, None], new_logits, logits), cache
