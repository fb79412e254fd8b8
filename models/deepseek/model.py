"""The DeepSeek-V2/V3 decoder (MLA attention, dense and mixture-of-experts MLPs) over a
functional latent KV cache.

:class:`Deepseek` binds a static :class:`~models.deepseek.config.DeepseekConfig`; every method
is a pure function of its arguments (parameters as :mod:`models.deepseek.weights` builds them,
caches as :mod:`models.deepseek.cache`), so all of them run under ``jax.jit``:

* :meth:`Deepseek.forward(params, tokens)` -- logits ``[B, T, V]`` of a plain causal forward,
  attention in the non-absorbed form (:func:`models.deepseek.attention.attend_expanded`);
* :meth:`Deepseek.prefill_prefix(params, tokens, lengths)` -> :class:`LatentPrefix` -- ``G``
  prompts (right-padded ``[G, P]``) through the same forward, keeping each layer's latents and
  rotary keys and the logits after each prompt;
* :meth:`Deepseek.extend(params, cache, tokens, n_new)` -> ``(logits [B, V], cache)`` -- append
  ``n_new[b]`` tokens (the last ones of left-padded ``[B, T]``) to each sequence: each layer
  writes their latents into the suffix buffers, then attends over the shared latent prefix and
  the suffix in the absorbed form through :func:`jax_prefix_attn.mla_attention`
  (:func:`models.deepseek.attention.attend_absorbed`);
* :meth:`Deepseek.decode_step(params, cache, tokens, active=None)` -- one token per sequence;
  rows with ``active = False`` write nothing and do not advance;
* :meth:`Deepseek.completion_hidden` -- the hidden states that score given completions of
  prompts (what :func:`models.training.logprobs.completion_logprobs` runs for this family);
* the :class:`~models.decoder.Decoder` interface the engine runs: ``facts``,
  :meth:`Deepseek.prefill_prompts` (a prompt batch into a latent cache,
  :mod:`models.deepseek.batch`), ``split_cache`` / ``join_cache`` (the latent suffix buffers
  donated to the decode loop), ``decode_step_jit``, ``sample_tokens`` / ``token_logprobs``,
  ``params_in_layout`` (the list layout only: dense and MoE layers differ).

Positions: prompt token ``i`` sits at ``i``; suffix entry ``j`` of a sequence at its prompt's
length plus ``j``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.decoder import DecoderFacts
from models.deepseek.attention import attend_absorbed, attend_expanded, mla_inputs
from models.deepseek.batch import prefill_prompt_batch
from models.deepseek.cache import LatentCache, LatentPrefix, check_latent_cache
from models.deepseek.config import DeepseekConfig
from models.deepseek.moe import moe_mlp
from models.deepseek.rope import rope_cos_sin_factor, rope_inv_freq
from models.kv_cache import write_suffix
from models.layers import dense, embed, lm_head, rms_norm, swiglu_mlp
from models.sampling import sample_tokens, token_logprobs

__all__ = ["Deepseek"]


class Deepseek:
    """A DeepSeek-V2/V3 decoder bound to ``config`` (see the module docstring).

    ``impl`` is the attention implementation of the non-absorbed prefill
    (:func:`jax_prefix_attn.attention`: ``"auto"``, ``"flash"`` or ``"reference"``) and
    ``interpret`` runs its kernels in Pallas interpret mode; the absorbed form (decoding and
    the completions of ``completion_logprobs``) runs :func:`jax_prefix_attn.mla_attention`
    with ``impl="auto"`` (its Mosaic GPU kernels where they run), or the reference when
    ``impl="reference"``."""

    def __init__(self, config: DeepseekConfig, *, impl: str = "auto", interpret: bool = False):
        if not isinstance(config, DeepseekConfig):
            raise TypeError(f"config must be a DeepseekConfig, got {type(config).__name__}")
        if impl not in ("auto", "flash", "reference"):
            raise ValueError(f"impl must be 'auto', 'flash' or 'reference', got {impl!r}")
        if not isinstance(interpret, bool):
            raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
        self.config = config
        self.impl = impl
        # The absorbed form's kernels (Mosaic GPU, :func:`jax_prefix_attn.mla_attention`):
        # "auto" takes them where they run, "reference" never.
        self.mla_impl = "reference" if impl == "reference" else "auto"
        self.interpret = interpret
        self.inv_freq = rope_inv_freq(config)
        self.rope_factor = rope_cos_sin_factor(config)
        self.extend_jit = jax.jit(self.extend)
        self.prefill_prefix_jit = jax.jit(self.prefill_prefix)
        self._step_split = jax.jit(self._decode_step_split, donate_argnames=("donated",))

    def __hash__(self):
        return hash((self.config, self.impl, self.interpret))

    def __eq__(self, other):
        return isinstance(other, Deepseek) and (self.config, self.impl, self.interpret) == (
            other.config, other.impl, other.interpret)

    # ------------------------------------------------------------------ the decoder interface
    @property
    def facts(self) -> DecoderFacts:
        """:class:`~models.decoder.DecoderFacts` of the config (no pad id: the engine pads with
        the first end-of-sequence id, else 0)."""
        c = self.config
        return DecoderFacts(family="deepseek", vocab_size=c.vocab_size, eos_token_ids=c.eos_token_ids,
                            pad_token_id=None, max_position_embeddings=c.max_position_embeddings,
                            cache_values_per_token=c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim),
                            nested_prefixes=False)

    def params_in_layout(self, params: dict, *, stacked: bool) -> dict:
        """``params`` (a list of layers); ``ValueError`` for the stacked layout."""
        if stacked:
            raise ValueError("layout: received 'stacked', expected 'list' or 'auto' for the deepseek family "
                             "(its dense and mixture-of-experts layers have different parameters)")
        return params

    def prefill_prompts(self, params: dict, prompts, prefix, *, capacity: int, attention: str,
                        shape_buckets: bool) -> tuple[jax.Array, LatentCache]:
        """A :class:`~models.prefix_sharing.PromptBatch` into a :class:`LatentCache`
        (:func:`models.deepseek.batch.prefill_prompt_batch`); ``prefix`` must be None (no
        reusable prefix cache for this family: ``NotImplementedError``)."""
        if prefix is not None:
            raise NotImplementedError("prefix_cache (a reusable prefix cache): implemented for the llama family "
                                      "only, not for the deepseek family")
        return prefill_prompt_batch(self, params, prompts, capacity=capacity, attention=attention,
                                    shape_buckets=shape_buckets)

    def split_cache(self, cache: LatentCache) -> tuple[LatentCache, tuple]:
        """``(cache without its suffix buffers, (latent, rope_k) suffix buffers)``."""
        return cache.replace(latent=None, rope_k=None), (cache.latent, cache.rope_k)

    def join_cache(self, kept: LatentCache, donated: tuple) -> LatentCache:
        """The inverse of :meth:`split_cache`."""
        return kept.replace(latent=donated[0], rope_k=donated[1])

    def decode_step_jit(self, params: dict, cache: LatentCache, tokens_b, active_b=None):
        """Jitted :meth:`decode_step` that donates the suffix buffers (not the shared prompts)."""
        active_b = jnp.ones(jnp.shape(tokens_b), bool) if active_b is None else active_b
        kept, donated = self.split_cache(cache)
        return self._step_split(params, kept, donated, tokens_b, active_b)

    def _decode_step_split(self, params, kept, donated, tokens_b, active_b):
        return self.decode_step(params, self.join_cache(kept, donated), tokens_b, active_b)

    def sample_tokens(self, logits_bv: jax.Array, keys_b: jax.Array, step, cfg) -> jax.Array:
        """:func:`models.sampling.sample_tokens`."""
        return sample_tokens(logits_bv, keys_b, step, cfg)

    def token_logprobs(self, logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
        """:func:`models.sampling.token_logprobs`."""
        return token_logprobs(logits_bv, tokens_b)

    # ------------------------------------------------------------------ layers
    def _layer(self, i: int, lp: dict, x_bth: jax.Array, pos_bt: jax.Array, attend):
        """Layer ``i``: ``attend(q_nope, q_rope, latent, rope_k) -> [B, T, Hn, Dv]`` supplies the
        attention.  Returns ``(x_out [B, T, H], (latent [B, T, R], rope_k [B, T, Dr]))``."""
        c = self.config
        b, t, _ = x_bth.shape
        h = rms_norm(x_bth, lp["attn_norm"], c.rms_norm_eps)
        q_nope, q_rope, latent, rope_k = mla_inputs(c, lp, h, pos_bt, self.inv_freq, self.rope_factor)
        o = attend(q_nope, q_rope, latent, rope_k)
        x_bth = x_bth + dense(o.reshape(b, t, c.num_attention_heads * c.v_head_dim), lp["wo"]).astype(x_bth.dtype)
        h = rms_norm(x_bth, lp["mlp_norm"], c.rms_norm_eps)
        mlp = moe_mlp(c, lp, h) if c.is_moe_layer(i) else swiglu_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"])
        return x_bth + mlp.astype(x_bth.dtype), (latent, rope_k)

    def _check_params(self, params: dict) -> None:
        n = len(params["layers"])
        if n != self.config.num_hidden_layers:
            raise ValueError(f"params have {n} layers, the config {self.config.num_hidden_layers}")

    def _causal(self, params: dict, tokens_bt: jax.Array):
        """Non-absorbed causal pass: ``(final hidden [B, T, H], latents, rope keys)``."""
        self._check_params(params)
        b, t = tokens_bt.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        x = embed(params["embed"], tokens_bt).astype(params["embed"].dtype)
        latents, rope_ks = [], []
        for i, lp in enumerate(params["layers"]):
            attend = lambda qn, qr, c, kr, lp=lp: attend_expanded(  # noqa: E731
                self.config, lp, qn, qr, c, kr, impl=self.impl, interpret=self.interpret)
            x, (latent, rope_k) = self._layer(i, lp, x, pos, attend)
            latents.append(latent)
            rope_ks.append(rope_k)
        return rms_norm(x, params["final_norm"], self.config.rms_norm_eps), latents, rope_ks

    # ------------------------------------------------------------------ public API
    def forward(self, params: dict, tokens_bt: jax.Array) -> jax.Array:
        """Logits ``[B, T, V]`` float32 of a plain causal forward pass."""
        x, _, _ = self._causal(params, jnp.asarray(tokens_bt, jnp.int32))
        return lm_head(x, params)

    def prefill_prefix(self, params: dict, tokens_gp: jax.Array, lengths_g: jax.Array | None = None) -> LatentPrefix:
        """Prefill ``G`` prompts once: ``tokens [G, P]`` right-padded, ``lengths [G]`` real
        tokens each (default ``P``; at least 1).  Pad rows hold garbage that the lengths mask."""
        tokens_gp = jnp.asarray(tokens_gp, jnp.int32)
        g, p = tokens_gp.shape
        lengths = jnp.full((g,), p, jnp.int32) if lengths_g is None else jnp.asarray(lengths_g, jnp.int32)
        x, latents, rope_ks = self._causal(params, tokens_gp)
        last = jnp.take_along_axis(x, jnp.clip(lengths - 1, 0, p - 1)[:, None, None], axis=1)[:, 0]
        return LatentPrefix(latent=tuple(latents), rope_k=tuple(rope_ks), lengths=lengths,
                            last_logits=lm_head(last, params))

    def extend(self, params: dict, cache: LatentCache, tokens_bt: jax.Array,
               n_new_b: jax.Array) -> tuple[jax.Array, LatentCache]:
        """Append the last ``n_new[b]`` tokens of left-padded ``tokens [B, T]`` to each sequence
        (the module docstring).  Returns the logits ``[B, V]`` float32 of column ``T - 1`` (the
        last new token; garbage for a sequence with ``n_new = 0``) and the new cache."""
        self._check_params(params)
        check_latent_cache(self.config, cache)
        c = self.config
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        n_new = jnp.asarray(n_new_b, jnp.int32)
        b, t = tokens_bt.shape
        ti = jnp.arange(t, dtype=jnp.int32)[None, :]
        pos = jnp.maximum(cache.positions[:, None] + ti - (t - n_new)[:, None], 0)
        new_lengths = cache.lengths + n_new
        prefix = cache.prefix
        x = embed(params["embed"], tokens_bt).astype(params["embed"].dtype)
        latents, rope_ks = list(cache.latent), list(cache.rope_k)
        for i, lp in enumerate(params["layers"]):
            def attend(qn, qr, lat, kr, i=i, lp=lp):
                latents[i] = write_suffix(latents[i], lat, cache.lengths, n_new)
                rope_ks[i] = write_suffix(rope_ks[i], kr, cache.lengths, n_new)
                return attend_absorbed(c, lp, qn, qr, prefix.latent[i], prefix.rope_k[i], latents[i],
                                       rope_ks[i], suffix_lengths=new_lengths, prefix_lengths=prefix.lengths,
                                       seq_to_prefix=cache.seq_to_prefix, impl=self.mla_impl)
            x, _ = self._layer(i, lp, x, pos, attend)
        logits = lm_head(rms_norm(x[:, -1], params["final_norm"], c.rms_norm_eps), params)
        return logits, cache.replace(latent=tuple(latents), rope_k=tuple(rope_ks), lengths=new_lengths)

    def prompt_hidden(self, params: dict, tokens_bt: jax.Array) -> jax.Array:
        """Final-normed hidden states ``[B, T, H]`` of a plain causal pass (what the LM head
        turns into :meth:`forward`'s logits; :mod:`models.prompt_logprobs` scores prompts with
        them chunk by chunk)."""
        return self._causal(params, jnp.asarray(tokens_bt, jnp.int32))[0]

    def completion_hidden(self, params: dict, prompt_gp: jax.Array, plen_g: jax.Array, comp_bc: jax.Array,
                          n: int, *, shared: bool, remat: bool, policy=None) -> jax.Array:
        """Hidden states ``[G*N, C, H]`` (before the final norm) that predict each token of
        ``N`` right-padded completions ``comp [G*N, C]`` of each of ``G`` prompts ``[G, P]``
        (lengths ``plen [G]``): row ``t`` is the state of the token before completion token
        ``t`` (:func:`models.training.logprobs.completion_logprobs`).  ``shared``: each layer runs the
        prompts once (non-absorbed, causal) and the completions in the absorbed form over
        their prompt's latents as a grouped shared prefix and, causally, their own latents
        (:func:`jax_prefix_attn.mla_attention`); else every completion runs behind its own copy
        of its prompt.  ``remat``: each layer is rematerialised in the backward."""
        self._check_params(params)
        c = self.config
        g, p = prompt_gp.shape
        b, cl = comp_bc.shape
        s2p = jnp.arange(b, dtype=jnp.int32) // n
        dtype = params["embed"].dtype
        expanded = lambda lp: lambda qn, qr, lat, kr: attend_expanded(  # noqa: E731
            c, lp, qn, qr, lat, kr, impl=self.impl, interpret=self.interpret)
        if shared:
            pos_p = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (g, p))
            pos_c = plen_g[s2p][:, None] + jnp.arange(cl, dtype=jnp.int32)[None]
            full = jnp.full((b,), cl, jnp.int32)  # right-padded: causality hides the padding

            def layer(carry, lp, i):
                x_p, x_c = carry
                x_p, (lat_p, kr_p) = self._layer(i, lp, x_p, pos_p, expanded(lp))
                absorbed = lambda qn, qr, lat, kr: attend_absorbed(  # noqa: E731
                    c, lp, qn, qr, lat_p, kr_p, lat, kr, suffix_lengths=full, prefix_lengths=plen_g,
                    seq_to_prefix=s2p, impl=self.mla_impl)
                return x_p, self._layer(i, lp, x_c, pos_c, absorbed)[0]
            carry = (embed(params["embed"], prompt_gp).astype(dtype), embed(params["embed"], comp_bc).astype(dtype))
        else:
            length = plen_g[s2p][:, None]
            j = jnp.arange(p + cl, dtype=jnp.int32)[None]
            from_prompt = jnp.take_along_axis(prompt_gp[s2p], jnp.minimum(j, p - 1), axis=1)
            from_comp = jnp.take_along_axis(comp_bc, jnp.clip(j - length, 0, cl - 1), axis=1)
            pos = jnp.broadcast_to(j, (b, p + cl))

            def layer(x, lp, i):
                return self._layer(i, lp, x, pos, expanded(lp))[0]
            carry = embed(params["embed"], jnp.where(j < length, from_prompt, from_comp)).astype(dtype)
        for i, lp in enumerate(params["layers"]):
            step = (lambda carry, lp, i=i: layer(carry, lp, i))
            carry = (jax.checkpoint(step, policy=policy) if remat else step)(carry, lp)
        if shared:
            x_p, x_c = carry
            last = x_p[jnp.arange(g), plen_g - 1]
            return jnp.concatenate([last[s2p][:, None], x_c[:, :-1]], axis=1)
        idx = length - 1 + jnp.arange(cl, dtype=jnp.int32)[None]
        return jnp.take_along_axis(carry, idx[..., None], axis=1)

    def decode_step(self, params: dict, cache: LatentCache, tokens_b: jax.Array,
                    active_b: jax.Array | None = None) -> tuple[jax.Array, LatentCache]:
        """Feed one token per sequence: ``(logits [B, V] float32, new cache)``.  Inactive rows
        (``active_b`` False) neither write the cache nor advance (their logits are garbage)."""
        tokens_b = jnp.asarray(tokens_b, jnp.int32)
        n_new = jnp.ones_like(tokens_b) if active_b is None else jnp.asarray(active_b).astype(jnp.int32)
        return self.extend(params, cache, tokens_b[:, None], n_new)
