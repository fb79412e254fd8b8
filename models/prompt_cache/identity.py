"""What a stored encoding depends on, as short hashes: the model (config and weights), the
dtype of its K/V, the tokenizer and the schema (with the layout options of its encoding).

* `model_identity(config, params)`: SHA-256 of the config's fields and, per parameter leaf (per
  layer for layer leaves), its shape, dtype, a position-weighted checksum of all its bit
  patterns (integer arithmetic modulo 2**32, so exact and independent of the device and of the
  summation order) and 16 evenly spaced elements' bit patterns. One jitted pass over the
  weights; the stacked and list layer layouts give the same identity.
* `tokenizer_identity(tokenizer)`: SHA-256 of the `tokenizers` JSON (`backend.to_str()`) and the
  special ids, or of every token's bytes for a tokenizer that only has `token_bytes`.
* `schema_identity(schema, ...)`: SHA-256 of `schema_to_pml(schema)`, the placeholder and BOS
  ids and the scaffolds.
* `CacheIdentity`: model, dtype and tokenizer of one cache; `mismatches` names what differs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.kv_cache import is_stacked
from models.prompt_cache.pml import Schema, schema_to_pml

__all__ = ["CacheIdentity", "model_identity", "tokenizer_identity", "schema_identity"]

_SAMPLES = 16        # elements per leaf (per layer) whose bit patterns enter the digest
_UINT = ((1, jnp.uint8), (2, jnp.uint16), (4, jnp.uint32))   # itemsize -> unsigned type of that width


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _rows_digest(x_rn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(checksum [R] uint32, sample [R, S] uint32)` of the rows of `x [R, N]`."""
    itemsize = x_rn.dtype.itemsize
    uint = dict(_UINT).get(itemsize)
    if uint is None:
        raise TypeError(f"params: a leaf of dtype {x_rn.dtype} ({itemsize} bytes), expected 1, 2 or 4 bytes")
    bits = jax.lax.bitcast_convert_type(x_rn, uint).astype(jnp.uint32)
    n = x_rn.shape[1]
    weight = jnp.arange(n, dtype=jnp.uint32) % 65521 + 1
    idx = np.linspace(0, max(n - 1, 0), min(n, _SAMPLES)).astype(np.int32)
    return jnp.sum(bits * weight, axis=1, dtype=jnp.uint32), bits[:, idx]


@jax.jit
def _digests(params: dict):
    top = {k: v for k, v in params.items() if k != "layers"}
    top_d = jax.tree_util.tree_map(lambda x: _rows_digest(x.reshape(1, -1)), top)
    layers = params["layers"]
    if is_stacked(layers):
        layer_d = jax.tree_util.tree_map(lambda x: _rows_digest(x.reshape(x.shape[0], -1)), layers)
    else:
        layer_d = [jax.tree_util.tree_map(lambda x: _rows_digest(x.reshape(1, -1)), lp) for lp in layers]
    return top_d, layer_d


def _path(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def model_identity(config: LlamaConfig, params: dict) -> str:
    """Hex SHA-256 of `config` and a digest of every weight (see the module docstring)."""
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config: received {type(config).__name__}, expected LlamaConfig")
    if not isinstance(params, dict) or "layers" not in params or "embed" not in params:
        raise TypeError(f"params: received {type(params).__name__}, expected a parameter dict with 'embed' and "
                        f"'layers'")
    top_d, layer_d = jax.device_get(_digests(params))
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], np.ndarray)
    records = []
    top_leaves = jax.tree_util.tree_flatten_with_path({k: v for k, v in params.items() if k != "layers"})[0]
    for (path, leaf), (_, (ck, smp)) in zip(top_leaves, jax.tree_util.tree_flatten_with_path(top_d, is_pair)[0]):
        records.append([_path(path), list(leaf.shape), str(leaf.dtype), int(ck[0]), smp[0].tolist()])
    layers = params["layers"]
    if is_stacked(layers):
        leaves = jax.tree_util.tree_flatten_with_path(layers)[0]
        digests = [d for _, d in jax.tree_util.tree_flatten_with_path(layer_d, is_pair)[0]]
        n = leaves[0][1].shape[0] if leaves else 0
        per_layer = [[(p, x.shape[1:], x.dtype, ck[i], smp[i]) for (p, x), (ck, smp) in zip(leaves, digests)]
                     for i in range(n)]
    else:
        per_layer = []
        for lp, ld in zip(layers, layer_d):
            leaves = jax.tree_util.tree_flatten_with_path(lp)[0]
            digests = [d for _, d in jax.tree_util.tree_flatten_with_path(ld, is_pair)[0]]
            per_layer.append([(p, x.shape, x.dtype, ck[0], smp[0]) for (p, x), (ck, smp) in zip(leaves, digests)])
    for i, layer in enumerate(per_layer):
        for p, shape, dtype, ck, smp in layer:
            records.append([f"layers/{i}/{_path(p)}", list(shape), str(dtype), int(ck), smp.tolist()])
    return _sha({"config": dataclasses.asdict(config), "params": records})


def tokenizer_identity(tokenizer) -> str:
    """Hex SHA-256 of the tokenizer's vocabulary, merges and special ids (module docstring)."""
    backend = getattr(tokenizer, "backend", None)
    special = [getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "add_bos_token")]
    special.append(sorted(getattr(tokenizer, "stop_token_ids", ()) or ()))
    if backend is not None and callable(getattr(backend, "to_str", None)):
        return _sha({"tokenizers_json": backend.to_str(), "special": special})
    if callable(getattr(tokenizer, "token_bytes", None)) and isinstance(getattr(tokenizer, "vocab_size", None), int):
        h = hashlib.sha256()
        for i in range(tokenizer.vocab_size):
            b = tokenizer.token_bytes(i)
            h.update(len(b).to_bytes(4, "little") + b)
        return _sha({"token_bytes": h.hexdigest(), "special": special})
    raise TypeError(f"tokenizer: received {type(tokenizer).__name__}, which has no vocabulary to hash "
                    f"(expected backend.to_str() or token_bytes() and vocab_size); pass tokenizer_id=")


def schema_identity(schema: Schema, *, placeholder_id: int | None, bos_id: int | None, scaffolds=()) -> str:
    """Hex SHA-256 of the schema's PML and the options its encoding depends on."""
    return _sha({"pml": schema_to_pml(schema), "placeholder_id": placeholder_id, "bos_id": bos_id,
                 "scaffolds": [list(s) for s in scaffolds]})


@dataclasses.dataclass(frozen=True)
class CacheIdentity:
    """The model, K/V dtype and tokenizer a cache was made for (hex hashes and a dtype name)."""
    model: str
    dtype: str
    tokenizer: str

    def mismatches(self, stored: "CacheIdentity") -> list[str]:
        """One phrase per field in which `stored` differs from this identity, e.g.
        `"dtype: stored float32, expected bfloat16"` (hashes shortened to 12 digits)."""
        out = []
        for f in ("model", "dtype", "tokenizer"):
            got, want = getattr(stored, f), getattr(self, f)
            if got != want:
                short = (lambda s: s[:12]) if f != "dtype" else (lambda s: s)
                out.append(f"{f}: stored {short(got)}, expected {short(want)}")
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
