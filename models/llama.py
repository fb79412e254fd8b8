"""The Llama decoder over a functional KV cache.

:class:`Llama` binds a static :class:`~models.config.LlamaConfig` (and the attention ``impl``);
every method is a pure function of ``(params, cache, tokens)`` that returns a new cache, so
all of them work inside user code under ``jax.jit``:

* :meth:`Llama.forward(params, tokens)` -- full forward without a cache (logits ``[B, T, V]``);
* :meth:`Llama.prefill_prefixes(params, level_tokens, level_lengths)` -> :class:`PrefixCache`
  -- each distinct prefix node is prefilled once, batched over the nodes of a level, level after
  level (a node attends to its ancestors and causally to itself);
* :meth:`Llama.prefill(params, prefix, tokens, n_tokens, capacity, backend)` ->
  ``(logits [B, V], KVCache)`` -- per-sequence continuations (left-padded ``[B, T]``, ``n_tokens``
  real tokens each, possibly 0) against their prefix path and themselves, causally;
* :meth:`Llama.decode_step(params, cache, tokens, active=None)` -> ``(logits [B, V], cache)``
  -- one token per sequence; rows with ``active = False`` write nothing and do not advance.
* :meth:`Llama.layer_forward(lp, x, pos, attend)` -- one layer without a cache, attention
  supplied by the caller (the training and scoring paths of :mod:`models.training.logprobs`).
* the :class:`~models.decoder.Decoder` interface the engine runs: ``facts``,
  :meth:`Llama.prefill_prompts` (a prompt batch's levels through :func:`prefill_levels`, then
  :meth:`Llama.prefill`), ``split_cache`` / ``join_cache`` (the prefix kept, the suffix buffers
  donated), ``sample_tokens`` / ``token_logprobs``.

All three cache-writing paths share :meth:`Llama.extend`: embed the new tokens at positions
``pos_offset + lengths + (0..n-1)`` (or at explicit ``positions_bt``, as the prompt cache's
prefill of uncached tokens between stored modules does), run the layers (each writes its new
keys/values into the suffix buffer, then attends through
:func:`models.attention.cache_attention`), and return the logits of the last token (new tokens
are left-padded, so it is always column ``T - 1``).

Backends (static, stored in the cache): ``"shared"``, ``"flat"`` (see :mod:`models.kv_cache`)
and ``"none"``: the attention product is skipped -- the attention output is replaced by
``q + v`` of the token itself (GQA-repeated) so no projection is dead code -- a throughput upper
bound for benchmarks that is **functionally wrong**.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from models import kv_cache as kvc
from models.attention import cache_attention
from models.config import LlamaConfig
from models.kv_cache import KVCache, PrefixCache
from models.decoder import DecoderFacts
from models.layers import apply_rope, dense, embed, lm_head, rms_norm, rope_inv_freq, swiglu_mlp
from models.sampling import sample_tokens, token_logprobs
from models.vocab_parallel import embed_lookup
from models.weights import stack_layers, unstack_layers

# Prefix levels longer than this are stored with their length rounded up to a multiple of it
# (rows past each node's length are masked padding): the Mosaic GPU prefix kernel, the shared
# path's default on Hopper, needs a prefix length that is a multiple of 128
# (``pallas_kernels.prefix_attention_mgpu.mgpu_supported``).  At most 127 extra rows per node.
PREFIX_ALIGN = 128

__all__ = ["Llama", "llama_facts", "prefill_levels"]


def _run_layers(body, x, params_layers, *caches):
    """Layer loop: ``lax.scan`` for stacked layers, an unrolled loop for a list of layers."""
    if kvc.is_stacked(params_layers):
        return jax.lax.scan(lambda h, xs: body(h, *xs), x, (params_layers,) + caches)
    outs = []
    for i, lp in enumerate(params_layers):
        x, out = body(x, lp, *(c[i] for c in caches))
        outs.append(out)
    return x, outs


def llama_facts(config: LlamaConfig) -> DecoderFacts:
    """The :class:`~models.decoder.DecoderFacts` of a Llama ``config``."""
    return DecoderFacts(family="llama", vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids,
                        pad_token_id=config.pad_token_id, max_position_embeddings=config.max_position_embeddings,
                        cache_values_per_token=2 * config.num_hidden_layers * config.num_key_value_heads
                        * config.head_dim)


def prefill_levels(model, params: dict, prompts, *, shape_buckets: bool) -> PrefixCache:
    """The :class:`PrefixCache` of ``prompts.levels`` (a :class:`~models.prefix_sharing.PromptBatch`),
    each node prefilled once by ``model`` (a :class:`Llama` or a
    :class:`~models.sharded_llama.ShardedLlama`); no level: an empty prefix cache."""
    if not prompts.levels:
        return kvc.empty_prefix_cache(model.config, params["embed"].dtype, stacked=kvc.is_stacked(params["layers"]))
    toks, lens = prompts.level_arrays(buckets=shape_buckets)
    prefix = model.prefill_prefixes_jit(params, toks, lens)
    if model.shared_impl == "tree":  # tree metadata needs host node lengths
        prefix = prefix.replace(tree_nodes=tuple(tuple(len(n) for n in lv) for lv in prompts.levels))
    return prefix


class Llama:
    """A Llama decoder bound to ``config``; methods are pure functions (see module docstring).

    ``impl`` picks the attention implementation: ``"auto"`` (Pallas kernels on GPU, pure JAX
    elsewhere) or ``"reference"``; ``interpret`` is passed to every ``jax_prefix_attn`` call (the
    Pallas kernels they run run in interpret mode).  ``shared_impl`` picks how the ``"shared"`` backend attends
    over prefix levels: ``"levels"`` (default: deepest level + suffix through
    ``shared_prefix_attention``, shallower levels with inter-sequence batching, LSE merge) or
    ``"tree"`` (one ``jax_prefix_attn.tree_attention`` call over the levels as a prefix tree and
    the suffix; needs a prefix cache from :func:`models.generate.prefill_prefix_cache` with this
    model, which records the node lengths on the host).  ``model_axis``: the mesh axis the
    parameters are split over when each device runs this model on its shard inside
    ``jax.shard_map`` (:mod:`models.sharded_llama`; ``config`` is then the per-shard config): the
    row-split o and down projections are summed over it (one ``psum`` each per layer) and the
    embedding lookup is vocabulary-parallel; ``None`` (default): one device, no collective.
    """

    def __init__(self, config: LlamaConfig, *, impl: str = "auto", shared_impl: str = "levels",
                 interpret: bool = False, model_axis: str | None = None):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if impl not in ("auto", "reference"):
            raise ValueError(f"impl must be 'auto' or 'reference', got {impl!r}")
        if shared_impl not in ("levels", "tree"):
            raise ValueError(f"shared_impl must be 'levels' or 'tree', got {shared_impl!r}")
        if not isinstance(interpret, bool):
            raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
        if model_axis is not None and not isinstance(model_axis, str):
            raise TypeError(f"model_axis must be a mesh axis name (str) or None, got {type(model_axis).__name__}")
        self.config = config
        self.model_axis = model_axis
        self.impl = impl
        self.shared_impl = shared_impl
        self.interpret = interpret
        self.inv_freq = rope_inv_freq(config)
        self._step_split = jax.jit(self._decode_step_split, static_argnames=("backend",),
                                   donate_argnames=("layers",))
        self._prefill = jax.jit(self.prefill, static_argnames=("capacity", "backend"))
        self._prefill_prefixes = jax.jit(self.prefill_prefixes)
        self._layout_cache = None   # (layers, stacked, params): the last layout conversion

    def prefill_prefixes_jit(self, params: dict, level_tokens: tuple, level_lengths: tuple) -> PrefixCache:
        """Jitted :meth:`prefill_prefixes` (compiled once per shape)."""
        return self._prefill_prefixes(params, level_tokens, level_lengths)

    def prefill_jit(self, params: dict, prefix: PrefixCache, tokens_bt, n_tokens_b, *, capacity: int,
                    backend: str = "shared") -> tuple[jax.Array, KVCache]:
        """Jitted :meth:`prefill` (``capacity`` and ``backend`` static)."""
        return self._prefill(params, prefix, tokens_bt, n_tokens_b, capacity=capacity, backend=backend)

    # ------------------------------------------------------------------ the decoder interface
    @property
    def facts(self) -> DecoderFacts:
        """:class:`~models.decoder.DecoderFacts` of the config."""
        return llama_facts(self.config)

    def prefill_prompts(self, params: dict, prompts, prefix: PrefixCache | None, *, capacity: int, attention: str,
                        shape_buckets: bool) -> tuple[jax.Array, KVCache]:
        """A :class:`~models.prefix_sharing.PromptBatch` into a :class:`KVCache` with backend
        ``attention``: its levels prefilled once (:func:`prefill_levels`) unless ``prefix`` holds
        them, then the suffixes (:meth:`prefill`)."""
        if prefix is None:
            prefix = prefill_levels(self, params, prompts, shape_buckets=shape_buckets)
        toks, n = prompts.suffix_arrays(buckets=shape_buckets)
        return self.prefill_jit(params, prefix, toks, n, capacity=capacity, backend=attention)

    def split_cache(self, cache: KVCache) -> tuple[KVCache, Any]:
        """``(cache without its suffix buffers, the suffix buffers)``: the prefix cache may be
        shared with other batches, the buffers are updated in place."""
        return cache.replace(layers=None), cache.layers

    def join_cache(self, kept: KVCache, donated: Any) -> KVCache:
        """The inverse of :meth:`split_cache`."""
        return kept.replace(layers=donated)

    def sample_tokens(self, logits_bv: jax.Array, keys_b: jax.Array, step, cfg) -> jax.Array:
        """:func:`models.sampling.sample_tokens`."""
        return sample_tokens(logits_bv, keys_b, step, cfg)

    def token_logprobs(self, logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
        """:func:`models.sampling.token_logprobs`."""
        return token_logprobs(logits_bv, tokens_b)

    def params_in_layout(self, params: dict, *, stacked: bool) -> dict:
        """``params`` with its layers stacked (``lax.scan`` loop) or as a list (unrolled loop).

        The last conversion is kept, so repeated calls with the same parameter tree convert once.
        """
        layers = params["layers"]
        if kvc.is_stacked(layers) == stacked:
            return params
        cached = self._layout_cache
        if cached is not None and cached[0] is layers and cached[1] == stacked:
            return cached[2]
        new = stack_layers(params) if stacked else unstack_layers(params)
        self._layout_cache = (layers, stacked, new)
        return new

    def decode_step_jit(self, params: dict, cache: KVCache, tokens_b, active_b=None):
        """Jitted :meth:`decode_step` that donates the cache's suffix buffers (not its
        :class:`PrefixCache`, which may be shared with other batches)."""
        active_b = jnp.ones(jnp.shape(tokens_b), bool) if active_b is None else active_b
        logits, layers, lengths = self._step_split(params, cache.prefix, cache.layers, cache.lengths,
                                                   cache.pos_offset, tokens_b, active_b, backend=cache.backend)
        return logits, cache.replace(layers=layers, lengths=lengths)

    def _decode_step_split(self, params, prefix, layers, lengths, pos_offset, tokens_b, active_b, *, backend):
        cache = KVCache(prefix=prefix, layers=layers, lengths=lengths, pos_offset=pos_offset, backend=backend)
        logits, cache = self.decode_step(params, cache, tokens_b, active_b)
        return logits, cache.layers, cache.lengths

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, Llama) and self._key() == other._key()

    def _key(self) -> tuple:
        return (self.config, self.impl, self.shared_impl, self.interpret, self.model_axis)

    # ------------------------------------------------------------------ one layer
    def _layer(self, x_bth, lp, prefix_kv, suffix_kv, *, pos_bt, n_new_b, lengths_b, new_lengths_b,
               prefix_lengths, backend, tree_nodes=None):
        """:meth:`layer_forward` whose attention first writes the new keys/values into the
        sequences' buffers, then attends over the cache."""
        bufs = {}

        def attend(q, k, v):
            bufs["k"] = kvc.write_suffix(suffix_kv["k"], k, lengths_b, n_new_b)
            bufs["v"] = kvc.write_suffix(suffix_kv["v"], v, lengths_b, n_new_b)
            if backend == "none":
                return q + jnp.repeat(v, q.shape[2] // k.shape[2], axis=2).astype(q.dtype)
            return cache_attention(q, prefix_kv["k"], prefix_kv["v"], prefix_lengths, bufs["k"], bufs["v"],
                                   new_lengths_b, backend=backend, impl=self.impl, interpret=self.interpret,
                                   tree_nodes=tree_nodes)

        x_bth, _ = self.layer_forward(lp, x_bth, pos_bt, attend)
        return x_bth, bufs

    # ------------------------------------------------------------------ cache-free layer
    def qkv(self, lp: dict, x_bth: jax.Array, pos_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer's attention inputs from ``x [B, T, H]`` at RoPE positions ``pos [B, T]``:
        ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]`` (norm, projections, RoPE on ``q`` and
        ``k``)."""
        c = self.config
        b, t, _ = x_bth.shape
        d = c.head_dim
        h = rms_norm(x_bth, lp["attn_norm"], c.rms_norm_eps)
        q, k, v = (dense(h, lp[w]).reshape(b, t, n, d) for w, n in (
            ("wq", c.num_attention_heads), ("wk", c.num_key_value_heads), ("wv", c.num_key_value_heads)))
        return apply_rope(q, pos_bt, self.inv_freq), apply_rope(k, pos_bt, self.inv_freq), v

    def layer_forward(self, lp: dict, x_bth: jax.Array, pos_bt: jax.Array, attend) -> tuple[jax.Array, tuple]:
        """One decoder layer without a cache (training and scoring paths).

        ``lp`` is one layer's parameters, ``x [B, T, H]`` its input, ``pos [B, T]`` the RoPE
        positions; ``attend(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, T, Hq, D]``
        computes the attention of the layer's queries over whatever keys the caller chooses (the
        layer's own ``k``/``v``, a shared prompt's, or both).  Returns ``(x_out [B, T, H], (k, v))``
        so callers can keep the keys/values for later queries.
        """
        b, t, _ = x_bth.shape
        q, k, v = self.qkv(lp, x_bth, pos_bt)
        attn = attend(q, k, v).reshape(b, t, q.shape[2] * q.shape[3])
        attn = self._sum_shards(dense(attn, lp["wo"]))
        x_bth = x_bth + attn.astype(x_bth.dtype)
        h = rms_norm(x_bth, lp["mlp_norm"], self.config.rms_norm_eps)
        mlp = self._sum_shards(swiglu_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"]))
        return x_bth + mlp.astype(x_bth.dtype), (k, v)

    def _sum_shards(self, x: jax.Array) -> jax.Array:
        """The all-reduce over the model axis of a row-split projection (identity on one device)."""
        return x if self.model_axis is None else jax.lax.psum(x, self.model_axis)

    def _embed(self, table_vh: jax.Array, tokens_bt: jax.Array) -> jax.Array:
        if self.model_axis is None:
            return embed(table_vh, tokens_bt)
        return embed_lookup(table_vh, tokens_bt, self.model_axis)

    # ------------------------------------------------------------------ shared core
    def extend(self, params: dict, prefix: PrefixCache, layers: Any, lengths_b: jax.Array,
               pos_offset_b: jax.Array, tokens_bt: jax.Array, n_new_b: jax.Array, *, backend: str,
               all_logits: bool = False, positions_bt: jax.Array | None = None):
        """Append ``n_new[b]`` tokens (the last ones of left-padded ``tokens [B, T]``).

        ``positions_bt``: int ``[B, T]`` explicit RoPE positions of the columns (pad columns'
        values are unused); None: ``pos_offset + lengths + 0..n-1`` for the real tokens.  The
        positions only rotate queries and keys: which keys a token sees is set by the cache
        lengths alone (its prefix path, and causally the suffix entries before it).
        Returns ``(logits, layers, new_lengths)``; logits are ``[B, V]`` for the last column, or
        ``[B, T, V]`` with ``all_logits`` (pad columns hold garbage).
        """
        kvc.check_layout(params["layers"], prefix.layers, layers)
        b, t = tokens_bt.shape
        n_new_b = n_new_b.astype(jnp.int32)
        dtype = params["embed"].dtype
        x = self._embed(params["embed"], tokens_bt).astype(dtype)
        ti = jnp.arange(t, dtype=jnp.int32)[None, :]
        if positions_bt is None:
            pos = jnp.maximum(pos_offset_b[:, None] + lengths_b[:, None] + ti - (t - n_new_b)[:, None], 0)
        else:
            pos = jnp.asarray(positions_bt, jnp.int32)
        new_lengths = lengths_b + n_new_b
        body = functools.partial(self._layer, pos_bt=pos, n_new_b=n_new_b, lengths_b=lengths_b,
                                 new_lengths_b=new_lengths, prefix_lengths=prefix.lengths, backend=backend,
                                 tree_nodes=prefix.tree_nodes if self.shared_impl == "tree" else None)
        x, layers = _run_layers(body, x, params["layers"], prefix.layers, layers)
        x = rms_norm(x if all_logits else x[:, -1], params["final_norm"], self.config.rms_norm_eps)
        return lm_head(x, params), layers, new_lengths

    # ------------------------------------------------------------------ public API
    def forward(self, params: dict, tokens_bt: jax.Array) -> jax.Array:
        """Logits ``[B, T, V]`` float32 of a plain causal forward pass (no prefix, no reuse)."""
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        b, t = tokens_bt.shape
        stacked = kvc.is_stacked(params["layers"])
        prefix = kvc.empty_prefix_cache(self.config, params["embed"].dtype, stacked=stacked)
        cache = kvc.init_kv_cache(self.config, prefix, b, t, params["embed"].dtype, backend="flat", stacked=stacked)
        logits, _, _ = self.extend(params, prefix, cache.layers, cache.lengths, cache.pos_offset, tokens_bt,
                                   jnp.full((b,), t, jnp.int32), backend="flat", all_logits=True)
        return logits

    def prefill_prefixes(self, params: dict, level_tokens: tuple, level_lengths: tuple) -> PrefixCache:
        """Prefill every distinct prefix node once, level by level.

        Args:
          level_tokens: tuple over levels of int ``[G_l, P_l]`` *left-padded* node tokens
            (``G_{l-1}`` divides ``G_l``; node ``g``'s parent is ``g // (G_l // G_{l-1})``).
          level_lengths: tuple over levels of int ``[G_l]`` real tokens per node (>= 1).
        Level ``l`` is stored as ``[G_l, P'_l, Hkv, D]`` with ``P'_l = P_l`` up to ``PREFIX_ALIGN``
        and ``P_l`` rounded up to a multiple of ``PREFIX_ALIGN`` above (masked rows).
        """
        stacked = kvc.is_stacked(params["layers"])
        dtype = params["embed"].dtype
        prefix = kvc.empty_prefix_cache(self.config, dtype, stacked=stacked)
        logits = None
        for toks, lens in zip(level_tokens, level_lengths):
            toks = jnp.asarray(toks, jnp.int32)
            lens = jnp.asarray(lens, jnp.int32)
            g, p = toks.shape
            cap = p if p <= PREFIX_ALIGN else -(-p // PREFIX_ALIGN) * PREFIX_ALIGN
            cache = kvc.init_kv_cache(self.config, prefix, g, cap, dtype, backend="shared", stacked=stacked)
            logits, layers, _ = self.extend(params, prefix, cache.layers, cache.lengths, cache.pos_offset,
                                            toks, lens, backend="shared")
            add = lambda pl, new: {"k": pl["k"] + (new["k"],), "v": pl["v"] + (new["v"],)}
            if stacked:
                new_layers = add(prefix.layers, layers)
            else:
                new_layers = [add(pl, nl) for pl, nl in zip(prefix.layers, layers)]
            prefix = PrefixCache(layers=new_layers, lengths=prefix.lengths + (lens,), last_logits=logits)
        return prefix

    def prefill(self, params: dict, prefix: PrefixCache, tokens_bt: jax.Array, n_tokens_b: jax.Array,
                capacity: int, backend: str = "shared") -> tuple[jax.Array, KVCache]:
        """Prefill per-sequence continuations against their prefix path.

        Args:
          prefix: a prefilled :class:`PrefixCache` (may have no level).
          tokens_bt: int ``[B, T]`` left-padded continuations (``T`` may be 0).
          n_tokens_b: int ``[B]`` real continuation tokens per sequence (0 = start from the prefix).
          capacity: suffix buffer length ``S_max`` (for ``"flat"`` it includes the prefix copy).
        Returns:
          ``(logits [B, V]`` float32 of each sequence's last prompt token, ``KVCache)``.
        """
        if backend not in kvc.BACKENDS:
            raise ValueError(f"backend must be one of {kvc.BACKENDS}, got {backend!r}")
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        n_tokens_b = jnp.asarray(n_tokens_b, jnp.int32)
        b, t = tokens_bt.shape
        stacked = kvc.is_stacked(params["layers"])
        dtype = params["embed"].dtype
        if backend == "flat":
            cache = kvc.flatten_prefix(self.config, prefix, b, capacity, dtype, stacked=stacked)
        else:
            cache = kvc.init_kv_cache(self.config, prefix, b, capacity, dtype, backend=backend, stacked=stacked)
        if prefix.num_levels:
            g = prefix.last_logits.shape[0]
            start_logits = jnp.repeat(prefix.last_logits, b // g, axis=0, total_repeat_length=b)
        else:
            start_logits = jnp.zeros((b, self.config.vocab_size), jnp.float32)
        if t == 0:
            return start_logits, cache
        logits, layers, lengths = self.extend(params, cache.prefix, cache.layers, cache.lengths, cache.pos_offset,
                                              tokens_bt, n_tokens_b, backend=backend)
        logits = jnp.where((n_tokens_b > 0)[:, None], logits, start_logits)
        return logits, cache.replace(layers=layers, lengths=lengths)

    def decode_step(self, params: dict, cache: KVCache, tokens_b: jax.Array,
                    active_b: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Feed one token per sequence: ``(logits [B, V] float32, new cache)``.

        Inactive rows (``active_b`` False) neither write the cache nor advance their length.
        """
        tokens_b = jnp.asarray(tokens_b, jnp.int32)
        n_new = jnp.ones_like(tokens_b) if active_b is None else jnp.asarray(active_b).astype(jnp.int32)
        logits, layers, lengths = self.extend(params, cache.prefix, cache.layers, cache.lengths, cache.pos_offset,
                                              tokens_b[:, None], n_new, backend=cache.backend)
        return logits, cache.replace(layers=layers, lengths=lengths)
