"""The decoder interface: what the generation engine (:mod:`models.generate`, :class:`models.LLM`)
needs from a model family, so that one engine runs every family.

* :class:`DecoderFacts` -- the config facts the engine reads: the family's name, the vocabulary
  size, the end-of-sequence and pad ids, the context length and the cache entries one token
  takes over all layers (for the sharing report's bytes) and whether prefix levels nest.
* :func:`require_family` -- the ``NotImplementedError`` an entry point of a feature that one
  family has (a reusable prefix cache, the Prompt Cache, ``prompt_logprobs``, several
  devices) raises for a model of another family, naming the feature and both families.
* :class:`Decoder` -- the protocol a model class implements (:class:`models.llama.Llama`,
  :class:`models.sharded_llama.ShardedLlama`, :class:`models.deepseek.Deepseek`):

  - ``config`` and ``facts``;
  - ``params_in_layout(params, stacked=)`` -- the parameters in the layer layout the engine asks
    for (``stacked``: one array per weight with a leading layer axis; else a list of layers);
  - ``prefill_prompts(params, prompts, prefix, capacity=, attention=, shape_buckets=)`` -- a
    :class:`~models.prefix_sharing.PromptBatch` into a fresh cache: its shared prefix levels
    stored once (or ``prefix``, a prefix cache prefilled before, where the family has one), then
    each sequence's own tokens; ``capacity`` is the per-sequence buffer length
    (:meth:`PromptBatch.validate` of the ``attention`` layout plus the new tokens);
    returns ``(logits [B, V] float32 after each sequence's last prompt token, cache)``;
  - ``decode_step(params, cache, tokens [B], active [B])`` -> ``(logits [B, V], cache)`` -- one
    token per sequence; inactive rows write nothing and do not advance (their logits are
    unused); ``decode_step_jit`` is the same step compiled;
  - ``split_cache(cache)`` -> ``(kept, donated)`` and ``join_cache(kept, donated)`` -- the
    cache's parts the fused decode loop must keep (e.g. a prefix that other batches reuse) and
    the per-sequence buffers it updates in place (donated to the compiled loop);
  - ``sample_tokens(logits, keys, step, cfg)`` and ``token_logprobs(logits, tokens)`` -- the
    sampler over the family's logits (a tensor-parallel model samples from vocabulary shards).

  Model objects are hashable (their config and options), since the compiled loop takes them as
  static arguments.  The cache is any pytree the family defines; the engine only passes it back.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

__all__ = ["Decoder", "DecoderFacts", "require_family"]


@dataclasses.dataclass(frozen=True)
class DecoderFacts:
    """The config facts the engine needs (module docstring).  ``cache_values_per_token``: cache
    entries one token adds over all layers (Llama: ``2 * layers * kv_heads * head_dim``;
    DeepSeek: ``layers * (kv_lora_rank + qk_rope_head_dim)``).  ``nested_prefixes``: whether the
    cache stores prefix levels one below another, each node once (Llama); False: one level of
    shared prompts, so :class:`models.LLM` plans its batches with the levels folded into one
    (:meth:`~models.prefix_sharing.PromptBatch.single_level`, DeepSeek)."""
    family: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_position_embeddings: int
    cache_values_per_token: int
    nested_prefixes: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "max_position_embeddings", "cache_values_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: received {v!r}, expected a positive int")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    def cache_bytes_per_token(self, dtype) -> int:
        """Bytes one token's cache entries take in ``dtype``."""
        return self.cache_values_per_token * np.dtype(dtype).itemsize


@runtime_checkable
class Decoder(Protocol):
    """A model family as the engine runs it (module docstring)."""
    config: Any

    @property
    def facts(self) -> DecoderFacts: ...

    def params_in_layout(self, params: dict, *, stacked: bool) -> dict: ...

    def prefill_prompts(self, params: dict, prompts, prefix, *, capacity: int, attention: str,
                        shape_buckets: bool) -> tuple[jax.Array, Any]: ...

    def decode_step(self, params: dict, cache, tokens_b, active_b=None) -> tuple[jax.Array, Any]: ...

    def decode_step_jit(self, params: dict, cache, tokens_b, active_b=None) -> tuple[jax.Array, Any]: ...

    def split_cache(self, cache) -> tuple[Any, Any]: ...

    def join_cache(self, kept, donated): ...

    def sample_tokens(self, logits_bv: jax.Array, keys_b: jax.Array, step, cfg) -> jax.Array: ...

    def token_logprobs(self, logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array: ...


def require_family(model, feature: str, family: str = "llama") -> None:
    """``NotImplementedError`` naming ``feature`` when ``model`` is a :class:`Decoder` of another
    family than ``family``; other objects are left to the caller's own type check."""
    if isinstance(model, Decoder) and model.facts.family != family:
        raise NotImplementedError(f"{feature}: implemented for the {family} family only, not for the "
                                  f"{model.facts.family} family")
