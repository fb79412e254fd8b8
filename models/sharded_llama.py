""":class:`ShardedLlama`: the Llama decoder on a ``("data", "model")`` mesh, tensor parallel over
``model`` and data parallel over ``data``.

Each model call (:meth:`~ShardedLlama.prefill_prefixes`, :meth:`~ShardedLlama.prefill`,
:meth:`~ShardedLlama.decode_step`) is one :func:`jax.shard_map` over the mesh in which every
device runs the ordinary :class:`~models.llama.Llama` code on its shard: its own query and kv
heads, FFN columns and vocabulary rows (the per-shard config of
:meth:`models.sharding.ShardedShapes.local_config`), its own sequences and their prefix nodes.
Attention goes through the same :func:`models.attention.cache_attention` and therefore the same
``jax_prefix_attn`` kernels, on the local heads; per layer there are exactly two all-reduces
(``psum`` of ``[B_loc, T, H]`` after the o projection and after the down projection) plus one
for the embedding lookup per call.  ``collective_matmul``
(:class:`models.collective_matmul.CollectiveMatmul`) with ``overlap_chunks > 1`` runs the decode
step's layers with those all-reduces split by rows and overlapped with the other rows' matmuls
(:class:`models.collective_matmul.OverlappedLlama`; the same results); prefill is unchanged.
Logits stay split over the vocabulary: greedy sampling and log-probabilities reduce ``[B]``
vectors across shards (:mod:`models.vocab_parallel`).

Arrays in and out are global arrays laid out by :mod:`models.sharding` (parameters padded and
placed with :func:`models.sharding.shard_params` / :func:`~models.sharding.place_params`;
caches split by kv heads and sequences), so the methods compose with ``jax.jit`` and the decode
loop of :func:`models.generate.generate` (``mesh=``).  The batch must be a multiple of the
``data`` axis; prefix levels whose node count it does not divide are stored once per data shard
(:func:`models.sharding.level_repeats`).  The ``"tree"`` shared-attention option is not
available on a mesh (its metadata is built from host node lengths of the whole level).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import kv_cache as kvc
from models import sharding
from models import vocab_parallel
from models.collective_matmul import CollectiveMatmul, OverlappedLlama
from models.kv_cache import KVCache, PrefixCache
from models.decoder import DecoderFacts
from models.llama import Llama, prefill_levels
from models.sampling import SamplingConfig
from models.sharding import DATA, MODEL

__all__ = ["ShardedLlama"]


class ShardedLlama:
    """``model`` run on ``mesh`` (see module docstring); hashable and comparable, so it can be a
    static ``jax.jit`` argument like :class:`~models.llama.Llama`.

    ``config`` is the model's (global) config; ``local`` the :class:`~models.llama.Llama` each
    device runs (``local_decode``: the one of the decode step, an
    :class:`~models.collective_matmul.OverlappedLlama` when ``collective_matmul.overlap_chunks >
    1``, else ``local``); ``shapes`` the padded global sizes; ``prefill_model``: the model whose
    jitted prefills :meth:`prefill_jit` and :meth:`prefill_prefixes_jit` run (this one without
    the option, so models that differ only in it share the compiled prefills)."""

    def __init__(self, model: Llama, mesh: Mesh, *, collective_matmul: CollectiveMatmul = CollectiveMatmul()):
        if not isinstance(model, Llama):
            raise TypeError(f"model must be a Llama, got {type(model).__name__}")
        if model.model_axis is not None:
            raise ValueError(f"model must be a whole (single-device) Llama, got one with model_axis="
                             f"{model.model_axis!r}")
        if model.shared_impl == "tree":
            raise ValueError("shared_impl='tree' is not available on a mesh; use shared_impl='levels'")
        if not isinstance(collective_matmul, CollectiveMatmul):
            raise TypeError(f"collective_matmul must be a models.collective_matmul.CollectiveMatmul, got "
                            f"{type(collective_matmul).__name__}")
        self.data_parallel, self.tensor_parallel = sharding.mesh_sizes(mesh)
        self.mesh = mesh
        self.base = model
        self.config = model.config
        self.impl, self.shared_impl, self.interpret = model.impl, model.shared_impl, model.interpret
        self.shapes = sharding.padded_shapes(model.config, self.tensor_parallel)
        self.local = Llama(self.shapes.local_config(model.config), impl=model.impl, shared_impl=model.shared_impl,
                           interpret=model.interpret, model_axis=MODEL)
        self.collective_matmul = collective_matmul
        self.local_decode = self.local
        if collective_matmul.overlapped and self.tensor_parallel > 1:
            self.local_decode = OverlappedLlama(self.local.config, collective=collective_matmul, impl=model.impl,
                                                shared_impl=model.shared_impl, interpret=model.interpret,
                                                model_axis=MODEL)
        # prefill does not depend on the option: one compiled prefill per model and mesh
        self.prefill_model = self if self.local_decode is self.local else ShardedLlama(model, mesh)

    def __hash__(self):
        return hash((self.base, self.mesh, self.collective_matmul))

    def __eq__(self, other):
        return isinstance(other, ShardedLlama) and ((self.base, self.mesh, self.collective_matmul)
                                                    == (other.base, other.mesh, other.collective_matmul))

    # ------------------------------------------------------------------ parameters
    def place_params(self, params: dict) -> dict:
        """``params`` padded and placed on the mesh (:func:`models.sharding.shard_params`; arrays
        already placed are kept)."""
        return sharding.shard_params(self.config, params, self.mesh)

    def params_in_layout(self, params: dict, *, stacked: bool) -> dict:
        """``params`` with stacked layers or a list of layers, kept in their shards (the
        conversion is remembered by the wrapped :class:`~models.llama.Llama`, so repeated calls
        with the same parameters convert once)."""
        if kvc.is_stacked(params["layers"]) == stacked:
            return params
        new = self.base.params_in_layout(params, stacked=stacked)
        return jax.device_put(new, self._shardings(sharding.param_specs(new)))

    def _shardings(self, specs):
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=lambda s: isinstance(s, P))

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def check_batch(self, batch: int) -> None:
        """Raise ``ValueError`` unless ``batch`` sequences split evenly over the ``data`` axis."""
        if batch % self.data_parallel:
            raise ValueError(f"the batch ({batch} sequences) must be a multiple of data_parallel "
                             f"({self.data_parallel})")

    def level_repeats(self, level_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """:func:`models.sharding.level_repeats` on this mesh's ``data`` axis."""
        return sharding.level_repeats(level_sizes, self.data_parallel)

    # ------------------------------------------------------------------ model calls
    def prefill_prefixes(self, params: dict, level_tokens: tuple, level_lengths: tuple) -> PrefixCache:
        """:meth:`models.llama.Llama.prefill_prefixes` on the mesh; levels are repeated by
        :meth:`level_repeats` (the returned cache has ``G_l * r_l`` nodes per level)."""
        reps = self.level_repeats(tuple(int(jnp.shape(t)[0]) for t in level_tokens))
        toks = tuple(jnp.repeat(jnp.asarray(t, jnp.int32), r, axis=0) for t, r in zip(level_tokens, reps))
        lens = tuple(jnp.repeat(jnp.asarray(n, jnp.int32), r, axis=0) for n, r in zip(level_lengths, reps))
        stacked = kvc.is_stacked(params["layers"])
        out = sharding.prefix_specs(len(toks), stacked=stacked, num_layers=self.config.num_hidden_layers)
        fn = self._shard_map(self.local.prefill_prefixes,
                             (sharding.param_specs(params), tuple(P(DATA, None) for _ in toks),
                              tuple(P(DATA) for _ in lens)), out)
        return fn(params, toks, lens)

    def prefill(self, params: dict, prefix: PrefixCache, tokens_bt, n_tokens_b, capacity: int,
                backend: str = "shared") -> tuple[jax.Array, KVCache]:
        """:meth:`models.llama.Llama.prefill` on the mesh: ``(logits [B, V'] split over the
        vocabulary, KVCache split by sequences and kv heads)``."""
        if backend not in kvc.BACKENDS:
            raise ValueError(f"backend must be one of {kvc.BACKENDS}, got {backend!r}")
        tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
        self.check_batch(tokens_bt.shape[0])
        stacked = kvc.is_stacked(params["layers"])
        prefix_out = (sharding.empty_prefix_specs(self.config, stacked=stacked) if backend == "flat"
                      else sharding.cache_specs(prefix))
        out = (P(DATA, MODEL), sharding.kv_cache_specs(prefix_out, stacked=stacked,
                                                       num_layers=self.config.num_hidden_layers, backend=backend))
        local = functools.partial(self.local.prefill, capacity=capacity, backend=backend)
        fn = self._shard_map(local, (sharding.param_specs(params), sharding.cache_specs(prefix), P(DATA, None),
                                     P(DATA)), out)
        return fn(params, prefix, tokens_bt, jnp.asarray(n_tokens_b, jnp.int32))

    def decode_step(self, params: dict, cache: KVCache, tokens_b, active_b=None) -> tuple[jax.Array, KVCache]:
        """:meth:`models.llama.Llama.decode_step` on the mesh: ``(logits [B, V'] split over the
        vocabulary, new cache)``."""
        tokens_b = jnp.asarray(tokens_b, jnp.int32)
        active_b = jnp.ones(tokens_b.shape, bool) if active_b is None else jnp.asarray(active_b, bool)
        self.check_batch(tokens_b.shape[0])
        backend = cache.backend

        def local(params, prefix, layers, lengths, pos_offset, tok, active):
            c = KVCache(prefix=prefix, layers=layers, lengths=lengths, pos_offset=pos_offset, backend=backend)
            logits, c = self.local_decode.decode_step(params, c, tok, active)
            return logits, c.layers, c.lengths

        layer_specs = sharding.cache_specs(cache.layers)
        fn = self._shard_map(local, (sharding.param_specs(params), sharding.cache_specs(cache.prefix), layer_specs,
                                     P(DATA), P(DATA), P(DATA), P(DATA)), (P(DATA, MODEL), layer_specs, P(DATA)))
        logits, layers, lengths = fn(params, cache.prefix, cache.layers, cache.lengths, cache.pos_offset, tokens_b,
                                     active_b)
        return logits, cache.replace(layers=layers, lengths=lengths)

    # ------------------------------------------------------------------ jitted entry points
    def prefill_prefixes_jit(self, params: dict, level_tokens: tuple, level_lengths: tuple) -> PrefixCache:
        """Jitted :meth:`prefill_prefixes` (compiled once per shape and mesh)."""
        return _prefill_prefixes(self.prefill_model, params, level_tokens, level_lengths)

    def prefill_jit(self, params: dict, prefix: PrefixCache, tokens_bt, n_tokens_b, *, capacity: int,
                    backend: str = "shared") -> tuple[jax.Array, KVCache]:
        """Jitted :meth:`prefill` (``capacity`` and ``backend`` static)."""
        return _prefill(self.prefill_model, params, prefix, tokens_bt, n_tokens_b, capacity=capacity,
                        backend=backend)

    def decode_step_jit(self, params: dict, cache: KVCache, tokens_b, active_b=None):
        """Jitted :meth:`decode_step` that donates the cache's suffix buffers (not its prefix)."""
        active_b = jnp.ones(jnp.shape(tokens_b), bool) if active_b is None else active_b
        logits, layers, lengths = _decode_step(self, params, cache.prefix, cache.layers, cache.lengths,
                                               cache.pos_offset, tokens_b, active_b, backend=cache.backend)
        return logits, cache.replace(layers=layers, lengths=lengths)

    # ------------------------------------------------------------------ the decoder interface
    @property
    def facts(self) -> DecoderFacts:
        """The whole model's :class:`~models.decoder.DecoderFacts`."""
        return self.base.facts

    def prefill_prompts(self, params: dict, prompts, prefix: PrefixCache | None, *, capacity: int, attention: str,
                        shape_buckets: bool) -> tuple[jax.Array, KVCache]:
        """As :meth:`models.llama.Llama.prefill_prompts`, on the mesh."""
        if prefix is None:
            prefix = prefill_levels(self, params, prompts, shape_buckets=shape_buckets)
        toks, n = prompts.suffix_arrays(buckets=shape_buckets)
        return self.prefill_jit(params, prefix, toks, n, capacity=capacity, backend=attention)

    def split_cache(self, cache: KVCache) -> tuple[KVCache, object]:
        """As :meth:`models.llama.Llama.split_cache`."""
        return self.base.split_cache(cache)

    def join_cache(self, kept: KVCache, donated) -> KVCache:
        """As :meth:`models.llama.Llama.join_cache`."""
        return self.base.join_cache(kept, donated)

    # ------------------------------------------------------------------ sampling
    def sample_tokens(self, logits_bv: jax.Array, keys_b: jax.Array, step, cfg: SamplingConfig) -> jax.Array:
        """Next tokens ``[B]`` from vocabulary-split logits: the tokens
        :func:`models.sampling.sample_tokens` gives on the whole rows
        (:func:`models.vocab_parallel.sample_tokens`)."""
        fn = self._shard_map(functools.partial(vocab_parallel.sample_tokens, cfg=cfg, vocab_size=self.config.vocab_size,
                                               axis=MODEL), (P(DATA, MODEL), P(DATA), P()), P(DATA))
        return fn(logits_bv, keys_b, jnp.asarray(step, jnp.int32))

    def token_logprobs(self, logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
        """:func:`models.sampling.token_logprobs` of vocabulary-split logits."""
        fn = self._shard_map(functools.partial(vocab_parallel.token_logprobs, vocab_size=self.config.vocab_size,
                                               axis=MODEL), (P(DATA, MODEL), P(DATA)), P(DATA))
        return fn(logits_bv, jnp.asarray(tokens_b, jnp.int32))


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill_prefixes(model: ShardedLlama, params, level_tokens, level_lengths):
    return model.prefill_prefixes(params, level_tokens, level_lengths)


@functools.partial(jax.jit, static_argnames=("model", "capacity", "backend"))
def _prefill(model: ShardedLlama, params, prefix, tokens_bt, n_tokens_b, *, capacity, backend):
    return model.prefill(params, prefix, tokens_bt, n_tokens_b, capacity, backend)


@functools.partial(jax.jit, static_argnames=("model", "backend"), donate_argnames=("layers",))
def _decode_step(model: ShardedLlama, params, prefix, layers, lengths, pos_offset, tokens_b, active_b, *, backend):
    cache = KVCache(prefix=prefix, layers=layers, lengths=lengths, pos_offset=pos_offset, backend=backend)
    logits, cache = model.decode_step(params, cache, tokens_b, active_b)
    return logits, cache.layers, cache.lengths
