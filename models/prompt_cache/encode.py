"""Module encoding: the K/V of every module of a schema, per layer, at the positions the layout
assigns, each module attending only to its own tokens (causally).

All modules of a schema go through the decoder in one batched call: module `m`'s own tokens
are row `m` of a right-padded `[M, T]` batch with their explicit positions. Attention is plain
causal attention over the row, so a real token (column `i < length[m]`) sees exactly the
module's tokens `0..i`; padding columns come after every real one and only padding rows see
them. K are stored after RoPE (at the module's positions), so cached inference concatenates
them as they are.

Storage is packed, without the padding: every layer's K/V of the real tokens is gathered out
of the padded batch inside the compiled encoding (per layer, so no `[L, M, T]` padded copy is
ever materialised) into one `[L, N, Hkv, D]` buffer, `N` the schema's real tokens, with row
`m` at `offsets[m]:offsets[m + 1]`. Memory, host copies and files scale with real tokens; a
long module next to short ones costs nothing extra.

Scaffolds (paper section 3.3): a group of modules encoded together as one text, an extra row
of the same batch. A prompt that imports all of them can use the scaffold's K/V instead of the
members', removing the masking effect; a scaffold of the modules at the start of a schema
with contiguous positions holds exactly the K/V of an ordinary prefill of those tokens.

Cached inference reads `EncodedSchema.module(name)` (K/V `[L, n, Hkv, D]` and positions `[n]`)
or `EncodedSchema.kept(row)` (indices into the packed buffer of the row's tokens that are not
parameter placeholders) and attends the prompt's uncached tokens (`PromptLayout.new_token_ids`
at `new_positions`) to the concatenation.
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

__all__ = ["EncodedSchema", "Row", "check_encoded", "encode_schema", "encode_modules", "pack_rows", "schema_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedSchema:
    """K/V of every module (and scaffold) of a schema, packed without padding.

    `k`, `v`: `[L, N, Hkv, D]` in the parameters' dtype (device arrays, or NumPy in the host
    tier); row `m` (`names[m]`) holds tokens `offsets[m]:offsets[m + 1]` of the packed axis;
    `positions`, `token_ids`: int32 `[N]`; `keep`: bool `[N]`, True for tokens that are not
    parameter placeholders; `offsets`: int64 `[M + 1]`, `offsets[0] = 0`, `offsets[M] = N`.
    A scaffold's name joins its modules' names with `+` in schema order.
    """
    schema: str
    names: tuple
    k: jax.Array
    v: jax.Array
    positions: np.ndarray
    token_ids: np.ndarray
    keep: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        off = np.asarray(self.offsets)
        n = int(off[-1]) if off.size else -1
        if off.ndim != 1 or off.size != len(self.names) + 1 or off[0] != 0 or (np.diff(off) < 0).any():
            raise ValueError(f"offsets: received {off.tolist()[:8]}..., expected {len(self.names) + 1} "
                             f"non-decreasing offsets from 0 (one row per name)")
        for a in ("positions", "token_ids", "keep"):
            if np.shape(getattr(self, a)) != (n,):
                raise ValueError(f"{a}: received shape {np.shape(getattr(self, a))}, expected ({n},) = offsets[-1]")
        if self.k.ndim != 4 or self.k.shape[1] != n or self.v.shape != self.k.shape:
            raise ValueError(f"k, v: received shapes {tuple(self.k.shape)} and {tuple(self.v.shape)}, expected "
                             f"equal [L, {n}, Hkv, D]")

    @property
    def tokens(self) -> int:
        """`N`, the real tokens of every row together (the packed axis)."""
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int32 `[M]`: tokens of each row."""
        return np.diff(np.asarray(self.offsets)).astype(np.int32)

    def span(self, row: int) -> slice:
        """The packed-axis slice of row `row`."""
        return slice(int(self.offsets[row]), int(self.offsets[row + 1]))

    def kept(self, row: int) -> np.ndarray:
        """int64 indices into the packed axis of row `row`'s tokens that are not placeholders."""
        sp = self.span(row)
        return sp.start + np.flatnonzero(np.asarray(self.keep[sp]))

    def module(self, name: str) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """`(k [L, n, Hkv, D], v [L, n, Hkv, D], positions [n])` of module or scaffold `name`."""
        if name not in self.names:
            raise ValueError(f"name: no module {name!r} in encoded schema {self.schema!r} "
                             f"(modules: {list(self.names)})")
        sp = self.span(self.names.index(name))
        return self.k[:, sp], self.v[:, sp], self.positions[sp]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V (`N` tokens; nothing is padded)."""
        return 2 * self.k.size * self.k.dtype.itemsize


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
    """`(token_ids [M, T], positions [M, T], keep [M, T], lengths [M])`: the compute batch of
    `encode_modules`, the rows right-padded with id 0 at position 0 (keep False) to `T`, the
    longest row rounded up to `pad_multiple` (fewer distinct shapes to compile)."""
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
def encode_modules(model: Llama, params: dict, tokens_mt: jax.Array, positions_mt: jax.Array,
                   index_n: jax.Array):
    """`(k, v)`, each `[L, n, Hkv, D]`: every layer's keys (after RoPE at `positions_mt`) and
    values of right-padded rows `tokens_mt [M, T]`, each row attending causally to itself,
    gathered per layer at the flat row-major `(row, column)` indices `index_n [n]`."""
    def attend(q, k, v):
        return jax_prefix_attn.attention(q, k, v, causal=True, impl=model.impl, interpret=model.interpret)[0]

    def pack(x):
        return jnp.take(x.reshape((-1,) + x.shape[2:]), index_n, axis=0)

    def layer(h, lp):
        h, (k, v) = model.layer_forward(lp, h, positions_mt, attend)
        return h, (pack(k), pack(v))

    x = embed(params["embed"], tokens_mt).astype(params["embed"].dtype)
    layers = params["layers"]
    if kvc.is_stacked(layers):
        return jax.lax.scan(layer, x, layers)[1]
    ks, vs = [], []
    for lp in layers:
        x, (k, v) = layer(x, lp)
        ks.append(k)
        vs.append(v)
    return jnp.stack(ks), jnp.stack(vs)


def check_encoded(config, dtype, encoded: EncodedSchema) -> None:
    """Raise ``ValueError`` unless ``encoded`` holds K/V of a model with ``config`` (layers, kv
    heads, head_dim) in ``dtype``."""
    want = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    got = (encoded.k.shape[0],) + tuple(encoded.k.shape[2:])
    if np.dtype(encoded.k.dtype) != np.dtype(dtype) or got != want:
        raise ValueError(f"encoded: K/V of dtype {np.dtype(encoded.k.dtype).name} and (layers, kv heads, head_dim) "
                         f"{got}, expected {np.dtype(dtype).name} and {want}")


def encode_schema(model: Llama, params: dict, schema_layout: SchemaLayout, *, scaffolds=(),
                  pad_multiple: int = 8) -> EncodedSchema:
    """Encode every module of `schema_layout`, and every scaffold (a sequence of module names
    encoded as one text), in one batched call (see the module docstring); `pad_multiple` rounds
    the batch's row length and the packed length of the compiled call up (fewer shapes to
    compile; the stored K/V are cut to the real tokens)."""
    if not isinstance(model, Llama):
        raise TypeError(f"model: received {type(model).__name__}, expected models.Llama")
    if not isinstance(schema_layout, SchemaLayout):
        raise TypeError(f"schema_layout: received {type(schema_layout).__name__}, expected SchemaLayout")
    rows = schema_rows(schema_layout, scaffolds)
    ids, pos, _, lengths = pack_rows(rows, pad_multiple)
    real = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    vocab = model.config.vocab_size
    if real.any() and (ids[real].min() < 0 or ids[real].max() >= vocab):
        raise ValueError(f"schema_layout: token ids span [{ids[real].min()}, {ids[real].max()}], expected "
                         f"[0, {vocab})")
    flat = np.flatnonzero(real.reshape(-1))
    n = len(flat)
    index = np.zeros(-(-max(n, 1) // pad_multiple) * pad_multiple, np.int32)
    index[:n] = flat
    k, v = encode_modules(model, params, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(index))
    if k.shape[1] != n:
        k, v = k[:, :n], v[:, :n]
    cat = lambda a, dtype: np.concatenate([getattr(r, a) for r in rows]).astype(dtype)  # noqa: E731
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return EncodedSchema(schema_layout.name, tuple(r.name for r in rows), k, v, cat("positions", np.int32),
                         cat("token_ids", np.int32), cat("keep", bool), offsets)
