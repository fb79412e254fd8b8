"""Tensor- and data-parallel layout of the Llama decoder on a ``("data", "model")`` device mesh.

* :func:`make_mesh` -- the first ``data_parallel x tensor_parallel`` devices as a
  :class:`jax.sharding.Mesh` with axes ``("data", "model")``; the ``model`` axis is the inner
  one, so the devices of one tensor-parallel group are neighbours in ``jax.devices()`` order
  (the same GPU host, NVLink).
* :class:`ShardedShapes` / :func:`padded_shapes` -- the global parameter sizes after padding
  every split dimension to a multiple of the ``model`` axis, and the per-shard
  :class:`~models.config.LlamaConfig` that each device runs (:meth:`ShardedShapes.local_config`).
* :func:`param_spec` / :func:`param_specs` -- the :class:`~jax.sharding.PartitionSpec` of each
  parameter (Megatron layout): ``wq``/``wk``/``wv`` column-split by heads, ``wo`` row-split;
  ``w_gate``/``w_up`` column-split, ``w_down`` row-split; ``embed`` ``[V, H]`` and ``lm_head``
  ``[H, V]`` split by vocabulary; norms replicated.  Everything is replicated over ``data``.
* :func:`cache_specs`, :func:`prefix_specs`, :func:`kv_cache_specs` -- caches split by kv heads
  on ``model`` and by sequences (prefix nodes) on ``data``: ``[B, S, Hkv, D]`` ->
  ``P("data", None, "model", None)``, so each device holds its own heads of its own sequences
  and a shared prefix node is stored once per model shard.
* :func:`shard_params` / :func:`place_params` -- put parameters into their shards with
  :func:`jax.make_array_from_callback`: every device receives only its block, cut (and padded)
  on the host, so the whole model is never materialised on one device.

Head counts that the ``model`` axis does not divide: the kv heads are padded to the next
multiple ``Hkv'`` of the axis size with inert heads, and each padded kv head gets its own group
of ``Hq / Hkv`` inert query heads (``Hq' = Hkv' * Hq / Hkv``).  Padded heads are zero columns
of ``wq``/``wk``/``wv`` and zero rows of ``wo``: their attention output is multiplied by zero
rows, so the result is exact.  Real heads keep their indices (padding is appended), so query
head ``h`` still uses kv head ``h // (Hq / Hkv)`` and every shard's query heads use only that
shard's kv heads.  For SmolLM2-135M (``Hq = 9``, ``Hkv = 3``) on 2 or 4 shards this gives
``Hkv' = 4``, ``Hq' = 12``: each device reads ``ceil(Hkv / tp)`` kv heads per cached token.  The
alternative -- replicating every kv head ``r = tp / gcd(Hkv, tp)`` times and splitting its
query heads over the copies -- stores and reads ``r * Hkv / tp`` kv heads per device (3 instead
of 1 at ``tp = 4``) and still needs query padding when ``r`` does not divide ``Hq / Hkv``;
decoding is bound by reading the cache, so padding to the next multiple is the faster choice.
The FFN width and the vocabulary are padded the same way (zero columns of ``w_gate``/``w_up``
and zero rows of ``w_down``: ``silu(0) * 0 = 0``; zero embedding rows and ``lm_head`` columns,
whose logits the vocabulary-parallel sampling of :mod:`models.vocab_parallel` masks to ``-inf``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import kv_cache as kvc
from models.collective_flags import check_collective_flags
from models.config import LlamaConfig
from models.kv_cache import KVCache, PrefixCache

__all__ = ["DATA", "MODEL", "ShardedShapes", "cache_specs", "empty_prefix_specs", "kv_cache_specs", "level_repeats",
           "make_mesh", "mesh_sizes", "padded_shapes", "param_spec", "param_specs", "place_params", "prefix_specs",
           "shard_params"]

DATA, MODEL = "data", "model"
COLUMN_SPLIT = ("wq", "wk", "wv", "w_gate", "w_up")   # [..., in, out]: out split over MODEL
ROW_SPLIT = ("wo", "w_down")                          # [..., in, out]: in split over MODEL
LAYER_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh:
    """A ``(data_parallel, tensor_parallel)`` mesh with axes ``("data", "model")`` over the first
    ``data_parallel * tensor_parallel`` of ``devices`` (default ``jax.devices()``: every device of
    every process, so the same call builds the multi-host mesh after ``jax.distributed.initialize``).

    Raises ``ValueError`` naming how many devices exist and how many are needed when there are
    too few (on a CPU host, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives ``N``);
    warns where this process's XLA collectives would fail across the GPUs
    (:func:`models.collective_flags.check_collective_flags`)."""
    tp = _positive_int("tensor_parallel", tensor_parallel)
    dp = _positive_int("data_parallel", data_parallel)
    devices = list(jax.devices() if devices is None else devices)
    need = tp * dp
    if len(devices) < need:
        kind = devices[0].platform if devices else "device"
        raise ValueError(f"tensor_parallel={tp} x data_parallel={dp} needs {need} devices, but only "
                         f"{len(devices)} {kind} device(s) exist")
    check_collective_flags(devices[:need], os.environ)
    return Mesh(np.asarray(devices[:need], dtype=object).reshape(dp, tp), (DATA, MODEL))


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(data_parallel, tensor_parallel)`` of a mesh with axes ``("data", "model")``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (see models.sharding.make_mesh), got "
                        f"{type(mesh).__name__}")
    if tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"mesh axes must be {(DATA, MODEL)}, got {tuple(mesh.axis_names)}")
    return int(mesh.shape[DATA]), int(mesh.shape[MODEL])


def host_array(x) -> np.ndarray:
    """The NumPy value of ``x``.  A ``jax.Array`` that spans devices of other processes (a mesh
    over several hosts after ``jax.distributed.initialize``) is gathered first, so every process
    gets the whole array; every process must call this for the same arrays in the same order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class ShardedShapes:
    """Global sizes of the split dimensions after padding to multiples of ``tensor_parallel``
    (see module docstring): query heads, kv heads, FFN width and vocabulary."""
    tensor_parallel: int
    heads_q: int
    heads_kv: int
    intermediate: int
    vocab: int

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """The configuration one shard runs: ``1 / tensor_parallel`` of each padded split size.

        ``eos_token_ids`` are dropped (they index the global vocabulary; the decode loop stops on
        the global config's)."""
        tp = self.tensor_parallel
        return dataclasses.replace(config, num_attention_heads=self.heads_q // tp,
                                   num_key_value_heads=self.heads_kv // tp, intermediate_size=self.intermediate // tp,
                                   vocab_size=self.vocab // tp, head_dim=config.head_dim, eos_token_ids=(),
                                   bos_token_id=None, pad_token_id=None)

    def padded_axis(self, name: str, config: LlamaConfig) -> tuple[int, int, int] | None:
        """``(axis, real size, padded size)`` of parameter ``name``'s split axis, or ``None``
        for a replicated parameter (norms)."""
        d = config.head_dim
        table = {"wq": (-1, config.num_attention_heads * d, self.heads_q * d),
                 "wk": (-1, config.num_key_value_heads * d, self.heads_kv * d),
                 "wv": (-1, config.num_key_value_heads * d, self.heads_kv * d),
                 "wo": (-2, config.num_attention_heads * d, self.heads_q * d),
                 "w_gate": (-1, config.intermediate_size, self.intermediate),
                 "w_up": (-1, config.intermediate_size, self.intermediate),
                 "w_down": (-2, config.intermediate_size, self.intermediate),
                 "embed": (-2, config.vocab_size, self.vocab),
                 "lm_head": (-1, config.vocab_size, self.vocab)}
        return table.get(name)


def padded_shapes(config: LlamaConfig, tensor_parallel: int) -> ShardedShapes:
    """:class:`ShardedShapes` of ``config`` on ``tensor_parallel`` model shards."""
    tp = _positive_int("tensor_parallel", tensor_parallel)
    kv = _round_up(config.num_key_value_heads, tp)
    return ShardedShapes(tensor_parallel=tp, heads_q=kv * config.q_per_kv, heads_kv=kv,
                         intermediate=_round_up(config.intermediate_size, tp), vocab=_round_up(config.vocab_size, tp))


# ------------------------------------------------------------------------------ partition specs
def param_spec(name: str, ndim: int) -> P:
    """Spec of parameter ``name`` with ``ndim`` axes (a leading layer axis when stacked)."""
    lead = (None,) * (ndim - 2)
    if name in COLUMN_SPLIT:
        return P(*lead, None, MODEL)
    if name in ROW_SPLIT:
        return P(*lead, MODEL, None)
    if name == "embed":
        return P(MODEL, None)
    if name == "lm_head":
        return P(None, MODEL)
    return P()


def _leaf_name(path) -> str:
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    raise ValueError(f"parameter at {jax.tree_util.keystr(path)} has no name")


def param_specs(params: dict):
    """The tree of :func:`param_spec` of a parameter tree (stacked or list layout)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: param_spec(_leaf_name(path), np.ndim(x)), params)


def _kv_spec(ndim: int) -> P:
    return P(*((None,) * (ndim - 4)), DATA, None, MODEL, None)


def _cache_leaf_spec(x) -> P:
    nd = np.ndim(x)
    if nd == 1:                         # lengths [B], pos_offset [B], node lengths [G]
        return P(DATA)
    if nd == 2:                         # last logits [G, V]
        return P(DATA, MODEL)
    if nd in (4, 5):                    # keys / values [(L,) B or G, S, Hkv, D]
        return _kv_spec(nd)
    raise ValueError(f"no cache spec for an array of {nd} axes")


def cache_specs(tree):
    """Specs of a :class:`~models.kv_cache.KVCache` / :class:`~models.kv_cache.PrefixCache` (or
    any part of one): sequences and prefix nodes on ``data``, kv heads and logits' vocabulary on
    ``model``."""
    return jax.tree_util.tree_map(_cache_leaf_spec, tree)


def _layer_tree(per_layer: dict, stacked: bool, num_layers: int):
    return per_layer if stacked else [per_layer for _ in range(num_layers)]


def prefix_specs(num_levels: int, *, stacked: bool, num_layers: int) -> PrefixCache:
    """Specs of a :class:`~models.kv_cache.PrefixCache` of ``num_levels`` levels."""
    kv = tuple(_kv_spec(5 if stacked else 4) for _ in range(num_levels))
    return PrefixCache(layers=_layer_tree({"k": kv, "v": kv}, stacked, num_layers),
                       lengths=tuple(P(DATA) for _ in range(num_levels)),
                       last_logits=P(DATA, MODEL) if num_levels else None)


def kv_cache_specs(prefix: PrefixCache, *, stacked: bool, num_layers: int, backend: str) -> KVCache:
    """Specs of a :class:`~models.kv_cache.KVCache` hanging from ``prefix`` (a spec tree)."""
    kv = _kv_spec(5 if stacked else 4)
    return KVCache(prefix=prefix, layers=_layer_tree({"k": kv, "v": kv}, stacked, num_layers), lengths=P(DATA),
                   pos_offset=P(DATA), backend=backend)


def empty_prefix_specs(config: LlamaConfig, *, stacked: bool) -> PrefixCache:
    """Specs of a prefix cache with no level (it holds no array)."""
    return kvc.empty_prefix_cache(config, jnp.float32, stacked=stacked)


# ------------------------------------------------------------------------------ placement
def _padded_block(host: np.ndarray, padded_shape: tuple, index: tuple) -> np.ndarray:
    """Block ``index`` (a tuple of unit-step slices) of ``host`` zero-padded at the end of each
    axis to ``padded_shape``."""
    spans = [s.indices(n)[:2] for s, n in zip(index, padded_shape)]
    real = tuple(slice(lo, max(lo, min(hi, m))) for (lo, hi), m in zip(spans, host.shape))
    src = np.asarray(host[real])
    if src.shape == tuple(hi - lo for lo, hi in spans):
        return src
    out = np.zeros(tuple(hi - lo for lo, hi in spans), src.dtype)
    out[tuple(slice(0, k) for k in src.shape)] = src
    return out


def _index(index, ndim: int) -> tuple:
    index = () if index is None else tuple(index)
    return index + (slice(None),) * (ndim - len(index))


def _place(read: Callable[[tuple], np.ndarray], shape: tuple, spec: P, mesh: Mesh, dtype) -> jax.Array:
    """A global array of ``shape`` whose device blocks come from ``read(block index)``."""
    dtype = jnp.dtype(dtype)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec),
                                        lambda idx: read(_index(idx, len(shape))).astype(dtype), dtype=dtype)


def _padded_shape(name: str, shape: tuple, config: LlamaConfig, shapes: ShardedShapes) -> tuple:
    pad = shapes.padded_axis(name, config)
    if pad is None:
        return tuple(shape)
    axis, real, padded = pad
    if shape[axis] != real:
        raise ValueError(f"parameter {name!r} has shape {tuple(shape)}: expected {real} along axis {axis} for "
                         f"this config")
    shape = list(shape)
    shape[axis] = padded
    return tuple(shape)


def _is_placed(x, shape: tuple, spec: P, mesh: Mesh) -> bool:
    return (isinstance(x, jax.Array) and tuple(x.shape) == shape and isinstance(x.sharding, NamedSharding)
            and x.sharding.is_equivalent_to(NamedSharding(mesh, spec), len(shape)))


def shard_params(config: LlamaConfig, params: dict, mesh: Mesh) -> dict:
    """``params`` (stacked or list layout, unpadded sizes, on the host or on devices) padded and
    placed in their shards on ``mesh`` (see module docstring); leaves already padded and placed
    there are kept as they are.  Leaves keep their dtype."""
    _, tp = mesh_sizes(mesh)
    shapes = padded_shapes(config, tp)

    def one(path, x):
        name = _leaf_name(path)
        spec = param_spec(name, np.ndim(x))
        pad = shapes.padded_axis(name, config)
        if pad is not None and np.shape(x)[pad[0]] == pad[2] and _is_placed(x, tuple(np.shape(x)), spec, mesh):
            return x
        shape = _padded_shape(name, np.shape(x), config, shapes)
        if _is_placed(x, shape, spec, mesh):
            return x
        host = np.asarray(jax.device_get(x))
        return _place(lambda idx: _padded_block(host, shape, idx), shape, spec, mesh, host.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def place_params(config: LlamaConfig, get: Callable[[str, int | None], np.ndarray], mesh: Mesh, dtype, *,
                 stacked: bool = True) -> dict:
    """Parameters placed directly into their shards from host tensors.

    ``get(name, layer)`` returns the host array (``[in, out]`` orientation, unpadded) of
    parameter ``name`` of ``layer`` (``None`` for ``embed``, ``final_norm``, ``lm_head``); it is
    called once per device block, so each device's block is cut, padded and cast on the host
    without a whole copy of the model on any device (and, for the stacked layout, without
    stacking the layers on the host)."""
    _, tp = mesh_sizes(mesh)
    shapes = padded_shapes(config, tp)
    n_layers = config.num_hidden_layers

    def whole(name):
        host_shape = np.shape(get(name, None))
        shape = _padded_shape(name, host_shape, config, shapes)
        return _place(lambda idx: _padded_block(get(name, None), shape, idx), shape, param_spec(name, len(shape)),
                      mesh, dtype)

    def layer_leaf(name):
        layer_shape = _padded_shape(name, np.shape(get(name, 0)), config, shapes)
        if not stacked:
            return [_place(lambda idx, i=i: _padded_block(get(name, i), layer_shape, idx), layer_shape,
                           param_spec(name, len(layer_shape)), mesh, dtype) for i in range(n_layers)]
        shape = (n_layers,) + layer_shape

        def read(idx):
            return np.stack([_padded_block(get(name, i), layer_shape, idx[1:]) for i in range(n_layers)[idx[0]]])
        return _place(read, shape, param_spec(name, len(shape)), mesh, dtype)

    per_name = {name: layer_leaf(name) for name in LAYER_NAMES}
    layers = per_name if stacked else [{n: per_name[n][i] for n in LAYER_NAMES} for i in range(n_layers)]
    params = {"embed": whole("embed"), "layers": layers, "final_norm": whole("final_norm")}
    if not config.tie_word_embeddings:
        params["lm_head"] = whole("lm_head")
    return params


def level_repeats(level_sizes: tuple[int, ...], data_parallel: int) -> tuple[int, ...]:
    """How many times each node of each prefix level is stored so that the ``data`` axis splits
    every level evenly: ``lcm(G_l, data_parallel) / G_l``.  A node shared by sequences of several
    data shards is stored once per data shard (each shard holds the prefixes of its own
    sequences); node ``g`` of the repeated level is node ``g // r`` of the original, and sequence
    ``b`` still maps to its node with ``b // (B / G)``."""
    return tuple(math.lcm(int(g), data_parallel) // int(g) for g in level_sizes)

