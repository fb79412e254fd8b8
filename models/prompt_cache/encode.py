"""Module encoding: the K/V of every module of a schema, per layer, at the positions the layout
assigns, each module attending only to its own tokens (causally).

All modules of a schema go through the decoder in one batched call: module `m`'s own tokens
are row `m` of a right-padded `[M, T]` batch with their explicit positions. Attention is plain
causal attention over the row, so a real token (column `i < length[m]`) sees exactly the
module's tokens `0..i`; padding columns come after every real one and only padding rows see
them. K are stored after RoPE (at the module's positions), so cached inference concatenates
them as they are.

Scaffolds (paper section 3.3): a group of modules encoded together as one text, an extra row
of the same batch. A prompt that imports all of them can use the scaffold's K/V instead of the
members', removing the masking effect; a scaffold of the modules at the start of a schema
with contiguous positions holds exactly the K/V of an ordinary prefill of those tokens.

Cached inference reads `EncodedSchema.module(name)` (K/V `[L, n, Hkv, D]` and positions `[n]`),
drops the parameter placeholders with `ModuleLayout.keep_mask`, and attends the prompt's
uncached tokens (`PromptLayout.new_token_ids` at `new_positions`) to the concatenation.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn
from models import kv_cache as kvc
from models.layers import embed
from models.llama import Llama
from models.prompt_cache.layout import SchemaLayout

__all__ = ["EncodedSchema", "Row", "encode_schema", "encode_modules", "pack_rows", "schema_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedSchema:
    """K/V of every module (and scaffold) of a schema.

    `k`, `v`: `[L, M, T, Hkv, D]` in the parameters' dtype (row `m` holds `names[m]`, columns
    at or past `lengths[m]` are padding); `positions`, `token_ids`: int32 `[M, T]`; `keep`:
    bool `[M, T]`, True for real tokens that are not parameter placeholders; `lengths`: int32
    `[M]`. A scaffold's name joins its modules' names with `+` in schema order.
    """
    schema: str
    names: tuple
    k: jax.Array
    v: jax.Array
    positions: np.ndarray
    token_ids: np.ndarray
    keep: np.ndarray
    lengths: np.ndarray

    def module(self, name: str) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """`(k [L, n, Hkv, D], v [L, n, Hkv, D], positions [n])` of module or scaffold `name`."""
        if name not in self.names:
            raise ValueError(f"name: no module {name!r} in encoded schema {self.schema!r} "
                             f"(modules: {list(self.names)})")
        m = self.names.index(name)
        n = int(self.lengths[m])
        return self.k[:, m, :n], self.v[:, m, :n], self.positions[m, :n]

    @property
    def nbytes(self) -> int:
        """Bytes of the real (unpadded) K/V rows."""
        per_token = self.k.shape[0] * self.k.shape[3] * self.k.shape[4] * self.k.dtype.itemsize * 2
        return int(self.lengths.sum()) * per_token


@dataclasses.dataclass(frozen=True)
class Row:
    """One row to encode: its `name` and int32 `token_ids`, `positions`, bool `keep` `[n]`."""
    name: str
    token_ids: np.ndarray
    positions: np.ndarray
    keep: np.ndarray


def schema_rows(schema_layout: SchemaLayout, scaffolds=()) -> list[Row]:
    """One row per module, then one per scaffold: the tokens of its modules sorted by position,
    so they attend to each other as one text would (the paper's scaffolding)."""
    rows = [Row(m.name, m.token_ids, m.positions, m.keep_mask) for m in schema_layout.modules]
    order = {m.name: i for i, m in enumerate(schema_layout.modules)}
    for j, group in enumerate(scaffolds):
        if isinstance(group, str) or len(group) < 2:
            raise ValueError(f"scaffolds[{j}]: received {group!r}, expected a sequence of two or more module names")
        unknown = [n for n in group if n not in order]
        if unknown or len(set(group)) != len(group):
            raise ValueError(f"scaffolds[{j}]: {list(group)} names unknown ({unknown}) or repeated modules")
        mods = [schema_layout.modules[order[n]] for n in sorted(group, key=order.__getitem__)]
        unions = [m.union for m in mods if m.union is not None]
        if len(set(unions)) != len(unions):
            raise ValueError(f"scaffolds[{j}]: {list(group)} holds two members of one union")
        pos = np.concatenate([m.positions for m in mods])
        by_pos = np.argsort(pos, kind="stable")
        rows.append(Row("+".join(m.name for m in mods), np.concatenate([m.token_ids for m in mods])[by_pos],
                        pos[by_pos], np.concatenate([m.keep_mask for m in mods])[by_pos]))
    return rows


def pack_rows(rows: list[Row], pad_multiple: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(token_ids [M, T], positions [M, T], keep [M, T], lengths [M])`: the rows right-padded
    with id 0 at position 0 (keep False) to `T`, the longest row rounded up to `pad_multiple`
    (fewer distinct shapes to compile)."""
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple: received {pad_multiple!r}, expected a positive int")
    lengths = np.asarray([len(r.token_ids) for r in rows], np.int32)
    t = max(int(lengths.max(initial=0)), 1)
    t = -(-t // pad_multiple) * pad_multiple
    ids = np.zeros((len(rows), t), np.int32)
    pos = np.zeros((len(rows), t), np.int32)
    keep = np.zeros((len(rows), t), bool)
    for i, r in enumerate(rows):
        ids[i, :lengths[i]] = r.token_ids
        pos[i, :lengths[i]] = r.positions
        keep[i, :lengths[i]] = r.keep
    return ids, pos, keep, lengths


@functools.partial(jax.jit, static_argnums=0)
def encode_modules(model: Llama, params: dict, tokens_mt: jax.Array, positions_mt: jax.Array):
    """`(k, v)`, each `[L, M, T, Hkv, D]`: every layer's keys (after RoPE at `positions_mt`)
    and values of right-padded rows `tokens_mt [M, T]`, each row attending causally to itself."""
    def attend(q, k, v):
        return jax_prefix_attn.attention(q, k, v, causal=True, impl=model.impl, interpret=model.interpret)[0]

    x = embed(params["embed"], tokens_mt).astype(params["embed"].dtype)
    layers = params["layers"]
    if kvc.is_stacked(layers):
        _, (k, v) = jax.lax.scan(lambda h, lp: model.layer_forward(lp, h, positions_mt, attend), x, layers)
        return k, v
    ks, vs = [], []
    for lp in layers:
        x, (k, v) = model.layer_forward(lp, x, positions_mt, attend)
        ks.append(k)
        vs.append(v)
    return jnp.stack(ks), jnp.stack(vs)


def encode_schema(model: Llama, params: dict, schema_layout: SchemaLayout, *, scaffolds=(),
                  pad_multiple: int = 8) -> EncodedSchema:
    """Encode every module of `schema_layout`, and every scaffold (a sequence of module names
    encoded as one text), in one batched call (see the module docstring)."""
    if not isinstance(model, Llama):
        raise TypeError(f"model: received {type(model).__name__}, expected models.Llama")
    if not isinstance(schema_layout, SchemaLayout):
        raise TypeError(f"schema_layout: received {type(schema_layout).__name__}, expected SchemaLayout")
    rows = schema_rows(schema_layout, scaffolds)
    ids, pos, keep, lengths = pack_rows(rows, pad_multiple)
    real = ids[np.arange(ids.shape[1])[None, :] < lengths[:, None]]
    vocab = model.config.vocab_size
    if real.size and (real.min() < 0 or real.max() >= vocab):
        raise ValueError(f"schema_layout: token ids span [{real.min()}, {real.max()}], expected [0, {vocab})")
    k, v = encode_modules(model, params, jnp.asarray(ids), jnp.asarray(pos))
    return EncodedSchema(schema_layout.name, tuple(r.name for r in rows), k, v, pos, ids, keep, lengths)
