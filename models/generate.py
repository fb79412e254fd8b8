"""The jit-compiled decode loop over a :class:`~models.prefix_sharing.PromptBatch`, and its
step-by-step variant.

* :func:`prefill_prefix_cache` -- prefill the distinct prefixes once; the returned
  :class:`~models.kv_cache.PrefixCache` can be passed to any number of later :func:`generate`
  calls (``prefix_cache=``) whose batches share those prefixes (the "system KV cache").
* :func:`generate` -- prefill, then the whole decode loop as one ``lax.while_loop`` under
  ``jax.jit`` with the cache donated: stops after ``max_new_tokens`` or when every sequence has
  produced an EOS id (per-sequence done flags; finished rows stop writing the cache and emit
  ``pad_token_id``).  Returns :class:`GenerateOutput` ``(tokens [B, max_new_tokens],
  lengths [B], cache, logprobs [B, max_new_tokens])`` (with ``top_logprobs=k``: also
  ``top_ids`` / ``top_logprobs [B, max_new_tokens, k]``); ``lengths[b]`` counts generated
  tokens including the EOS.  Each step's choice is :func:`models.token_step.choose_tokens`
  (penalties with per-sequence counts kept on the device, sampling, log-probabilities).
* :func:`generate_from_cache` -- the same decode loop from a cache the caller prefilled (e.g.
  Prompt Cache's prefill at explicit positions over stored module K/V).
* :func:`generate_stream` -- the same steps driven from Python (yields each step's tokens): the
  next decode step is dispatched before the host reads this step's tokens, so the device does
  not wait for the consumer.

``attention`` names the cache layout: ``"shared"`` stores each prefix node once (prefix and
suffix attended separately, merged exactly), ``"flat"`` gives every sequence its own copy of its
prompt (the FlashAttention baseline), ``"auto"`` is ``"shared"`` when the batch has prefix
levels and more than one sequence, else ``"flat"``; ``"none"`` skips attention (benchmark bound,
functionally wrong).  The default here (``attention=None``) is ``"shared"``: the batch's levels
are stored as given (:class:`models.LLM` and ``jpa-sample`` default to ``"auto"``).

Sampling: the default is :data:`~models.sampling.GREEDY`; sequence ``b`` draws with
``keys[b]`` (``keys=``, ``[B]`` keys), or with ``fold_in(key, b)`` from one ``key``, so a
sequence's tokens do not depend on the batch size.  The loop is compiled once per
:class:`~models.sampling.SamplingMode` (which options are on); the temperature, top-p, min-p and
penalty values are traced arguments.  ``shape_buckets=True`` rounds the prompt
arrays, the cache capacity and the loop's output width up with
:func:`~models.prefix_sharing.bucket_length`, so calls with other prompt lengths or
``max_new_tokens`` reuse the compiled functions.

``model``: any :class:`~models.decoder.Decoder` (:class:`~models.llama.Llama`,
:class:`~models.deepseek.Deepseek`); the loop runs through its interface (prefill of the prompt
batch, decode step, cache split into kept and donated parts, sampler).  ``prefix_cache``,
``mesh`` and :func:`generate_from_cache` are implemented for the llama family (another family
raises ``NotImplementedError`` naming the feature).

``mesh`` (:func:`generate`, :func:`generate_stream`, :func:`prefill_prefix_cache`): a ``("data", "model")`` mesh from
:func:`models.sharding.make_mesh` runs the model tensor parallel over ``model`` and data parallel
over ``data`` (:class:`~models.sharded_llama.ShardedLlama`); parameters are placed with
:func:`models.sharding.shard_params` unless they already are (place them once, or load them with
``params_from_hf_state_dict(..., mesh=)``, to avoid a transfer per call).  ``mesh=None`` runs on
one device.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import kv_cache as kvc
from models.kv_cache import KVCache, PrefixCache
from models.layer_layout import LAYOUTS, match_prefix_layout, resolve_layout
from models.decoder import Decoder, require_family
from models.llama import Llama, prefill_levels
from models.prefix_sharing import PromptBatch, bucket_length
from models.sampling import GREEDY, SamplingConfig
from models.sharded_llama import ShardedLlama
from models.sharding import host_array
from models.token_step import check_top_logprobs, choose_tokens, initial_counts, prompt_seen

__all__ = ["ATTENTION", "LAYOUTS", "GenerateOutput", "PromptBatch", "generate", "generate_from_cache",
           "generate_stream", "prefill_prefix_cache", "resolve_attention", "resolve_layout"]

ATTENTION = ("auto", "shared", "flat")  # the attention choices of generate, models.LLM and jpa-sample


def resolve_attention(prompts: PromptBatch, attention: str | None = "auto", *, default: str = "shared") -> str:
    """The cache layout ``"shared"``, ``"flat"`` (or ``"none"``) for ``attention`` on ``prompts``
    (``None``: ``default``)."""
    attention = default if attention is None else attention
    if attention not in ATTENTION + ("none",):
        raise ValueError(f"attention must be one of {ATTENTION} (or 'none': attention skipped, benchmarks only), "
                         f"got {attention!r}")
    if attention == "auto":
        return "shared" if prompts.levels and prompts.batch > 1 else "flat"
    return attention


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray      # int32 [B, max_new_tokens]; pad_token_id after a sequence finished
    lengths: np.ndarray     # int32 [B] generated tokens per sequence (EOS included)
    cache: Any              # final cache of the model's family (prompt + generated tokens but the last)
    logprobs: np.ndarray | None = None  # float32 [B, max_new_tokens] raw log-probs (0 after the end)
    top_ids: np.ndarray | None = None   # int32 [B, max_new_tokens, k] the k most probable ids (top_logprobs=k)
    top_logprobs: np.ndarray | None = None  # float32 [B, max_new_tokens, k] their raw log-probs


def _on_mesh(model, params: dict, mesh, prompts: PromptBatch):
    """``(model, params)`` to run: a :class:`ShardedLlama` and placed parameters with a mesh."""
    if mesh is None:
        return model, params
    require_family(model, "mesh (tensor- and data-parallel decoding)")
    model = model if isinstance(model, ShardedLlama) else ShardedLlama(model, mesh)
    if model.mesh != mesh:
        raise ValueError("model is a ShardedLlama on another mesh than mesh=")
    model.check_batch(prompts.batch)
    return model, model.place_params(params)


def _level_repeats(model, prompts: PromptBatch) -> tuple[int, ...]:
    sizes = prompts.level_sizes()
    return model.level_repeats(sizes) if isinstance(model, ShardedLlama) else (1,) * len(sizes)


def prefill_prefix_cache(model: Llama, params: dict, prompts: PromptBatch, *, layout: str = "auto",
                         shape_buckets: bool = False, mesh: jax.sharding.Mesh | None = None) -> PrefixCache:
    """Prefill ``prompts.levels`` once (reusable for later batches sharing those prefixes).

    ``layout`` as in :func:`~models.layer_layout.resolve_layout`; a prefix cache built in one layout is converted if
    :func:`generate` runs with the other.  ``shape_buckets``: node arrays padded to
    :func:`~models.prefix_sharing.bucket_length` (see module docstring).  ``mesh``: see the
    module docstring (pass the same mesh to :func:`generate`)."""
    require_family(model, "prefill_prefix_cache (a reusable prefix cache)")
    model, params = _on_mesh(model, params, mesh, prompts)
    prompts.validate(model.config.vocab_size)
    params = resolve_layout(model, params, layout)
    return prefill_levels(model, params, prompts, shape_buckets=shape_buckets)


def _check_prefix_cache(prefix: PrefixCache, prompts: PromptBatch, repeats: tuple[int, ...]) -> None:
    """``prefix`` holds the prompts' levels, node ``g`` of level ``l`` stored ``repeats[l]`` times."""
    sizes = tuple(g * r for g, r in zip(prompts.level_sizes(), repeats))
    if prefix.level_sizes() != sizes:
        raise ValueError(f"prefix_cache has level sizes {prefix.level_sizes()} but the prompts have "
                         f"{sizes}")
    for l, (lens, lv, r) in enumerate(zip(prefix.lengths, prompts.levels, repeats)):
        want = np.repeat(np.asarray([len(n) for n in lv]), r)
        got = host_array(lens)
        if not np.array_equal(got, want):
            raise ValueError(f"prefix_cache level {l} node lengths {got.tolist()} differ from the prompts' "
                             f"{want.tolist()}")


@functools.partial(jax.jit, static_argnames=("model", "width", "eos_ids", "pad_id", "top_k"),
                   donate_argnames=("donated",))
def _decode_loop(model: Decoder, params, kept, donated, logits_bv, keys_b, limit, seen_bv, sampling: SamplingConfig,
                 *, width: int, eos_ids: tuple, pad_id: int, top_k: int):
    # The cache's per-sequence buffers (``donated``, from ``model.split_cache``) are donated; the
    # rest (``kept``: e.g. a prefix cache reused by other batches) is not.  ``limit`` (dynamic)
    # <= ``width`` (static) steps are taken.  ``sampling`` is a pytree: its mode is static, its
    # values traced (one compilation for every value).
    cache = model.join_cache(kept, donated)
    pick = functools.partial(choose_tokens, model, keys_b=keys_b, seen=seen_bv, cfg=sampling, pad_id=pad_id, top_k=top_k)
    b = logits_bv.shape[0]
    eos = jnp.asarray(eos_ids, jnp.int32) if eos_ids else None

    def is_eos(tok_b):
        return jnp.isin(tok_b, eos) if eos is not None else jnp.zeros(tok_b.shape, bool)

    tok, lp, top, counts = pick(logits_bv, step=0, done_b=jnp.zeros((b,), bool),
                                counts=initial_counts(sampling, logits_bv))
    done = is_eos(tok)
    out = jnp.full((b, width), pad_id, jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((b, width), jnp.float32).at[:, 0].set(lp)
    tops = None if top is None else tuple(jnp.zeros((b, width, top_k), a.dtype).at[:, 0].set(a) for a in top)
    lengths = jnp.ones((b,), jnp.int32)

    def cond(state):
        i, _, _, done_b, *_ = state
        return (i < limit) & ~jnp.all(done_b)

    def body(state):
        i, cache, tok_b, done_b, out, lps, tops, counts, lengths = state
        logits, cache = model.decode_step(params, cache, tok_b, active_b=~done_b)
        new, lp, top, counts = pick(logits, step=i, done_b=done_b, counts=counts)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, i))
        lps = jax.lax.dynamic_update_slice(lps, lp[:, None], (0, i))
        if tops is not None:
            tops = tuple(jax.lax.dynamic_update_slice(t, a[:, None], (0, i, 0)) for t, a in zip(tops, top))
        lengths = lengths + (~done_b).astype(jnp.int32)
        return i + 1, cache, new, done_b | is_eos(new), out, lps, tops, counts, lengths

    state = (jnp.int32(1), cache, tok, done, out, lps, tops, counts, lengths)
    _, cache, _, _, out, lps, tops, _, lengths = jax.lax.while_loop(cond, body, state)
    return out, lps, tops, lengths, cache


@functools.partial(jax.jit, static_argnames=("model", "eos_ids", "pad_id", "top_k"))
def _sample_step(logits_bv, keys_b, step, done_b, counts, seen_bv, cfg: SamplingConfig, *, model, eos_ids: tuple,
                 pad_id: int, top_k: int):
    """``(tokens [B], logprobs [B], top, done [B], counts)`` of one step (:func:`~models.token_step.choose_tokens`)."""
    tok, lp, top, counts = choose_tokens(model, logits_bv, keys_b, step, done_b, counts, seen_bv, cfg=cfg, pad_id=pad_id,
                                 top_k=top_k)
    hit = jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros(tok.shape, bool)
    return tok, lp, top, done_b | hit, counts


def _sequence_keys(key, keys, batch: int) -> jax.Array:
    if keys is not None:
        if key is not None:
            raise ValueError("pass key= (one key for the batch) or keys= (one per sequence), not both")
        keys = jnp.asarray(keys)
        if keys.shape[0] != batch:
            raise ValueError(f"keys must hold one key per sequence ({batch}), got shape {keys.shape}")
        return keys
    key = jax.random.PRNGKey(0) if key is None else key
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))


def _setup(model, params, prompts, max_new_tokens, attention, capacity, prefix_cache, eos_token_ids,
           pad_token_id, layout, shape_buckets, mesh=None):
    if not isinstance(prompts, PromptBatch):
        raise TypeError(f"prompts must be a PromptBatch, got {type(prompts).__name__}")
    model, params = _on_mesh(model, params, mesh, prompts)
    attention = resolve_attention(prompts, attention)
    need = prompts.validate(model.facts.vocab_size, max_new_tokens=max_new_tokens, capacity=capacity,
                            attention=attention)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if capacity is None:
        capacity = bucket_length(need, minimum=64) if shape_buckets else need
    params = resolve_layout(model, params, layout)
    if prefix_cache is not None:
        require_family(model, "prefix_cache (a reusable prefix cache)")
        _check_prefix_cache(prefix_cache, prompts, _level_repeats(model, prompts))
        prefix_cache = match_prefix_layout(prefix_cache, params)
    eos, pad = _stop_and_pad_ids(model, eos_token_ids, pad_token_id)
    logits, cache = model.prefill_prompts(params, prompts, prefix_cache, capacity=capacity, attention=attention,
                                          shape_buckets=shape_buckets)
    return model, params, logits, cache, eos, pad


def _stop_and_pad_ids(model, eos_token_ids, pad_token_id) -> tuple[tuple, int]:
    """``(eos ids, pad id)``: the given ones, else the config's (pad: else the first EOS id, else 0)."""
    eos = model.facts.eos_token_ids if eos_token_ids is None else tuple(int(e) for e in eos_token_ids)
    if pad_token_id is None:
        pad_token_id = model.facts.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return eos, int(pad_token_id)


def _run_decode(model: Decoder, params, cache, logits, *, max_new_tokens: int, sampling: SamplingConfig, key, keys,
                eos: tuple, pad: int, shape_buckets: bool, seen, top_k: int,
                on_start: Callable[[], None] | None = None) -> GenerateOutput:
    """The jitted decode loop from a prefilled ``cache`` and its last-token ``logits [B, V]``.

    The loop is dispatched without waiting for ``logits``: it is traced and compiled while the
    prefill that computes them runs on the device.  ``on_start`` is then called once ``logits``
    are ready, i.e. when the loop can start on the device."""
    seq_keys = _sequence_keys(key, keys, logits.shape[0])
    width = bucket_length(max_new_tokens) if shape_buckets else max_new_tokens
    kept, donated = model.split_cache(cache)
    out, lps, tops, lengths, cache = _decode_loop(model, params, kept, donated, logits, seq_keys,
                                                  jnp.int32(max_new_tokens), seen, sampling, width=width,
                                                  eos_ids=eos, pad_id=pad, top_k=top_k)
    if on_start is not None:
        jax.block_until_ready(logits)
        on_start()
    top_ids, top_lps = (None, None) if tops is None else (host_array(a)[:, :max_new_tokens] for a in tops)
    return GenerateOutput(tokens=host_array(out)[:, :max_new_tokens], lengths=host_array(lengths), cache=cache,
                          logprobs=host_array(lps)[:, :max_new_tokens], top_ids=top_ids, top_logprobs=top_lps)


def generate(model: Decoder, params: dict, prompts: PromptBatch, *, max_new_tokens: int, attention: str | None = None,
             sampling: SamplingConfig = GREEDY, key: jax.Array | None = None, keys: jax.Array | None = None,
             capacity: int | None = None, prefix_cache: PrefixCache | None = None,
             eos_token_ids: Sequence[int] | None = None, pad_token_id: int | None = None, layout: str = "auto",
             shape_buckets: bool = False, mesh: jax.sharding.Mesh | None = None, top_logprobs: int = 0,
             on_prefill: Callable[[], None] | None = None) -> GenerateOutput:
    """Sample up to ``max_new_tokens`` tokens for every sequence of ``prompts``.

    ``attention``, ``sampling``, ``key`` / ``keys`` and ``shape_buckets`` as in the module
    docstring; ``eos_token_ids`` defaults to the config's (pass ``()`` to never stop early);
    ``capacity`` defaults to what the batch needs; ``layout`` picks the layer layout it runs with
    (:func:`~models.layer_layout.resolve_layout`: ``"auto"`` = the list layout on GPU); the returned cache is in that
    layout.  ``mesh``: tensor- and data-parallel decoding (module docstring); the tokens are
    those of one device up to floating-point summation order.  ``sampling``'s penalties
    (:mod:`models.penalties`) count each sequence's prompt (:meth:`PromptBatch.full_prompt`) and
    generated tokens.  ``top_logprobs=k > 0``: the output's ``top_ids`` / ``top_logprobs`` hold
    the ``k`` most probable ids of each step's raw distribution.  ``on_prefill`` (for timing):
    called when the decode loop can start on the device -- after the loop was dispatched (it is
    traced and compiled while the prefill runs on the device, so nothing waits for the prefill
    before that) and once the prefill's logits are ready.
    """
    top_k = check_top_logprobs(top_logprobs)
    model, params, logits, cache, eos, pad = _setup(model, params, prompts, max_new_tokens, attention, capacity,
                                                    prefix_cache, eos_token_ids, pad_token_id, layout, shape_buckets,
                                                    mesh)
    seen = prompt_seen(sampling, prompts, prompts.batch, model.facts.vocab_size)
    return _run_decode(model, params, cache, logits, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                       keys=keys, eos=eos, pad=pad, shape_buckets=shape_buckets, seen=seen, top_k=top_k,
                       on_start=on_prefill)


def generate_from_cache(model: Llama, params: dict, cache: KVCache, logits_bv: jax.Array, *, max_new_tokens: int,
                        sampling: SamplingConfig = GREEDY, key: jax.Array | None = None,
                        keys: jax.Array | None = None, eos_token_ids: Sequence[int] | None = None,
                        pad_token_id: int | None = None, shape_buckets: bool = False, top_logprobs: int = 0,
                        prompt_token_ids: Sequence[Sequence[int]] | None = None) -> GenerateOutput:
    """The decode loop of :func:`generate` from a cache the caller prefilled.

    ``cache``: a :class:`KVCache` whose suffix buffers hold each sequence's prompt continuation
    (``lengths``) and whose ``pos_offset + lengths`` is the RoPE position of the next token (e.g.
    a prefill at explicit positions, :func:`models.prompt_cache.infer.prefill_at_positions`);
    ``logits_bv [B, V]``: the logits after each sequence's last prompt token.  ``params`` must be
    in the cache's layer layout.  ``cache.capacity`` must hold ``lengths + max_new_tokens - 1``
    (ValueError otherwise).  Sampling, keys, stop and pad ids, ``top_logprobs`` as in
    :func:`generate`; ``prompt_token_ids`` (one sequence of ids per row) is needed by a
    repetition penalty only.
    """
    require_family(model, "generate_from_cache")
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: received {type(cache).__name__}, expected KVCache")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: received {max_new_tokens!r}, expected an int >= 1")
    if tuple(logits_bv.shape) != (cache.batch, model.config.vocab_size):
        raise ValueError(f"logits_bv: received shape {tuple(logits_bv.shape)}, expected "
                         f"{(cache.batch, model.config.vocab_size)}")
    top_k = check_top_logprobs(top_logprobs)
    kvc.check_layout(params["layers"], cache.layers)
    need = int(host_array(cache.lengths).max()) + max_new_tokens - 1
    if need > cache.capacity:
        raise ValueError(f"cache: capacity {cache.capacity} cannot hold the longest prompt continuation plus "
                         f"max_new_tokens - 1 = {need} tokens")
    eos, pad = _stop_and_pad_ids(model, eos_token_ids, pad_token_id)
    seen = prompt_seen(sampling, prompt_token_ids, cache.batch, model.config.vocab_size)
    return _run_decode(model, params, cache, logits_bv, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                       keys=keys, eos=eos, pad=pad, shape_buckets=shape_buckets, seen=seen, top_k=top_k)


def generate_stream(model: Decoder, params: dict, prompts: PromptBatch, *, max_new_tokens: int,
                    attention: str | None = None, sampling: SamplingConfig = GREEDY, key: jax.Array | None = None,
                    keys: jax.Array | None = None, capacity: int | None = None,
                    prefix_cache: PrefixCache | None = None, eos_token_ids: Sequence[int] | None = None,
                    pad_token_id: int | None = None, layout: str = "auto", shape_buckets: bool = False,
                    logprobs: bool = False, mesh: jax.sharding.Mesh | None = None,
                    top_logprobs: int = 0) -> Iterator:
    """Like :func:`generate` but driven from Python: yields the ``[B]`` tokens of each step
    (``logprobs=True``: ``(tokens [B], logprobs [B])``; ``top_logprobs=k > 0``: ``(tokens,
    logprobs, top_ids [B, k], top_logprobs [B, k])``), the same tokens :func:`generate` gives.

    Prefill runs at the first ``next()``.  It stops after ``max_new_tokens`` steps or once every
    sequence has produced an EOS id; a consumer may stop iterating earlier (``break``).
    ``mesh``: as in :func:`generate`.  The penalties' token counts stay on the device."""
    top_k = check_top_logprobs(top_logprobs)
    model, params, logits, cache, eos, pad = _setup(model, params, prompts, max_new_tokens, attention, capacity,
                                                    prefix_cache, eos_token_ids, pad_token_id, layout, shape_buckets,
                                                    mesh)
    seen = prompt_seen(sampling, prompts, prompts.batch, model.facts.vocab_size)
    seq_keys = _sequence_keys(key, keys, prompts.batch)
    values = jax.tree_util.tree_map(jnp.asarray, sampling)   # on the device once, not at every step
    sample = functools.partial(_sample_step, keys_b=seq_keys, seen_bv=seen, cfg=values, model=model, eos_ids=eos,
                               pad_id=pad, top_k=top_k)
    tok, lp, top, done, counts = sample(logits, step=0, done_b=jnp.zeros((prompts.batch,), bool),
                                        counts=initial_counts(sampling, logits))
    for i in range(max_new_tokens):
        last = i + 1 == max_new_tokens
        # The next step is dispatched before the host reads this step's tokens -- except after the
        # first token, which is handed out before the decode step (maybe still to compile) runs.
        if i and not last:
            logits, cache = model.decode_step_jit(params, cache, tok, ~done)
        if top is not None:
            yield host_array(tok), host_array(lp), host_array(top[0]), host_array(top[1])
        else:
            yield (host_array(tok), host_array(lp)) if logprobs else host_array(tok)
        if last or host_array(done).all():
            return
        if not i:
            logits, cache = model.decode_step_jit(params, cache, tok, ~done)
        tok, lp, top, done, counts = sample(logits, step=i + 1, done_b=done, counts=counts)
