"""Storage of encoded schemas (`EncodedSchema`) in three tiers with byte budgets and
least-recently-used eviction.

* `device`: K/V as device arrays, ready for cached inference;
* `host`: K/V as NumPy arrays in host memory (cached inference copies them to the device);
* `disk` (optional `directory`): one safetensors file per schema, `<schema name>.safetensors`
  (`models.prompt_cache.schema_file`: the digest of every tensor in its header), and
  `manifest.json` (`models.prompt_cache.manifest`: the cache's identity, per schema its file's
  schema hash, size, tokens and header digest, and a digest of the manifest itself). Only
  safetensors and JSON are read and written, never pickle.

Device and host hold an entry in at most one of them: a lookup that hits the host tier moves the
entry to the device (`promote=True`), and an entry evicted from the device moves to the host.
The disk keeps a copy of every entry that fits its budget, written when the entry is inserted,
so encodings outlive the process; an entry evicted from the host is dropped from memory (and
written to disk first if its disk copy was evicted). Each tier evicts its least recently used
entries while it holds more bytes than its budget (`CacheBudgets`, None = unlimited); an entry
larger than a tier's budget passes through to the next tier.

The disk verifies itself (`models.prompt_cache.disk`): a schema file is verified completely
when it is read; one that fails is logged in one line, renamed to `NAME.corrupt-<UTC time>` and
treated as a miss, so `encode_or_load` encodes the schema again; a file replaced by a writer
stopped before it wrote the manifest is adopted if it verifies; an error of the system (no
permission, an I/O error) is raised, leaving the file in place. `stats()` counts the files and
manifests kept aside (`verification_failures`).

Processes may share a directory: every read-modify-write of it (a lookup that reads a file, a
write, an eviction, a removal) holds an exclusive `fcntl.flock` on the directory and starts
by reading the manifest again, so records written by other processes are merged, never lost;
the directory view (`names("disk")`, `stats()`) is the one of this process's last operation on
it.

A cache is bound to one model, dtype and tokenizer: a directory or file made for another one,
or an entry encoded from other schema text or options, is refused with a ValueError naming
what differs. `stats()` counts hits and misses per tier (a lookup that hits the host tier is a
device miss and a host hit) and reports bytes, entries and tokens per tier and the K/V bytes per
cached token. Entries hold their K/V packed without padding (`EncodedSchema`), so every tier's
bytes scale with the real tokens of the modules.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Mapping

import jax
import numpy as np

from models.config import LlamaConfig
from models.decoder import require_family
from models.llama import Llama
from models.prompt_cache.disk import DiskTier
from models.prompt_cache.encode import EncodedSchema, check_encoded, encode_schema
from models.prompt_cache.identity import CacheIdentity, model_identity, schema_identity, tokenizer_identity
from models.prompt_cache.layout import SchemaLayout, TokenEncoder, layout_schema
from models.prompt_cache.pml import Schema, check_schema
from models.prompt_cache.schema_file import ARRAYS, load_encoded, save_encoded

__all__ = ["TIERS", "CacheBudgets", "CacheStats", "PromptCache", "encoded_nbytes", "kv_bytes_per_token",
           "load_encoded", "save_encoded"]

TIERS = ("device", "host", "disk")


def kv_bytes_per_token(config: LlamaConfig, dtype) -> int:
    """K and V bytes of one cached token over all layers: `2 * L * Hkv * D * itemsize`."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * np.dtype(dtype).itemsize


def encoded_nbytes(encoded: EncodedSchema) -> int:
    """Bytes an `EncodedSchema` holds: its packed K/V (real tokens only) and its index arrays
    (positions, token ids, keep mask: 9 bytes per token; 8 bytes per row offset)."""
    return int(sum(getattr(encoded, a).nbytes for a in ARRAYS))


@dataclasses.dataclass(frozen=True)
class CacheBudgets:
    """Byte budget per tier; None = unlimited, 0 = the tier keeps nothing."""
    device: int | None = None
    host: int | None = None
    disk: int | None = None

    def __post_init__(self):
        for t in TIERS:
            v = getattr(self, t)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"CacheBudgets.{t}: received {v!r}, expected a non-negative int or None")


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Per tier (`TIERS`): lookups that hit / missed it, entries evicted from it, bytes, entries
    and tokens (module and scaffold rows, unpadded) it holds; `bytes_per_token`: K/V bytes of
    one cached token (`kv_bytes_per_token`). `bytes[t] / tokens[t]` is what tier `t` spends per
    stored token: the K/V plus the index arrays (and on disk the file headers).
    `verification_failures`: schema files and manifests of the directory that failed their
    check (damaged, truncated, empty, unreadable, swapped) and were kept aside."""
    hits: Mapping[str, int]
    misses: Mapping[str, int]
    evictions: Mapping[str, int]
    bytes: Mapping[str, int]
    entries: Mapping[str, int]
    tokens: Mapping[str, int]
    bytes_per_token: int
    verification_failures: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    schema_hash: str
    encoded: EncodedSchema
    nbytes: int


def _on_host(enc: EncodedSchema) -> EncodedSchema:
    return dataclasses.replace(enc, k=np.asarray(jax.device_get(enc.k)), v=np.asarray(jax.device_get(enc.v)))


def _on_device(enc: EncodedSchema) -> EncodedSchema:
    return dataclasses.replace(enc, k=jax.device_put(enc.k), v=jax.device_put(enc.v))


class PromptCache:
    """Encoded schemas of one model in device, host and disk tiers (see the module docstring).

    `tokenizer` lays schemas out (`layout_schema` with `placeholder_id`, `bos_id`); its identity
    is hashed unless `tokenizer_id` is given. `pad_multiple` is passed to `encode_schema`.
    Typical use::

        cache = PromptCache(model, params, tokenizer, directory="pc")
        encoded = cache.encode_or_load(schema)        # device, host, disk, else encode
        lay = cache.schema_layout(schema)             # for layout_prompt
    """

    def __init__(self, model: Llama, params: dict, tokenizer: TokenEncoder, *, directory: str | None = None,
                 budgets: CacheBudgets = CacheBudgets(), tokenizer_id: str | None = None,
                 placeholder_id: int | None = None, bos_id: int | None = None, pad_multiple: int = 8):
        require_family(model, "Prompt Cache")
        if not isinstance(model, Llama):
            raise TypeError(f"model: received {type(model).__name__}, expected models.Llama")
        if not isinstance(budgets, CacheBudgets):
            raise TypeError(f"budgets: received {type(budgets).__name__}, expected CacheBudgets")
        if tokenizer_id is not None and not isinstance(tokenizer_id, str):
            raise TypeError(f"tokenizer_id: received {type(tokenizer_id).__name__}, expected str")
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.budgets, self.pad_multiple = budgets, pad_multiple
        self.placeholder_id, self.bos_id = placeholder_id, bos_id
        dtype = np.dtype(params["embed"].dtype)
        self.identity = CacheIdentity(model_identity(model.config, params), dtype.name,
                                      tokenizer_id if tokenizer_id is not None else tokenizer_identity(tokenizer))
        self.bytes_per_token = kv_bytes_per_token(model.config, dtype)
        self._mem = {"device": collections.OrderedDict(), "host": collections.OrderedDict()}
        self._layouts: dict = {}
        zero = lambda: dict.fromkeys(TIERS, 0)
        self._hits, self._misses, self._evictions = zero(), zero(), zero()
        self.directory = None if directory is None else os.fspath(directory)
        self._disk = None if directory is None else DiskTier(self.directory, self.identity, budgets.disk)

    # ------------------------------------------------------------------ keys and layouts
    def schema_key(self, schema: Schema, scaffolds=()) -> str:
        """The schema hash an encoding of `schema` with `scaffolds` is stored under."""
        check_schema(schema)
        return schema_identity(schema, placeholder_id=self.placeholder_id, bos_id=self.bos_id, scaffolds=scaffolds)

    def schema_layout(self, schema: Schema) -> SchemaLayout:
        """`layout_schema(schema, tokenizer, ...)` with this cache's options (kept per schema)."""
        key = self.schema_key(schema)
        if key not in self._layouts:
            self._layouts[key] = layout_schema(schema, self.tokenizer, placeholder_id=self.placeholder_id,
                                               bos_id=self.bos_id)
        return self._layouts[key]

    # ------------------------------------------------------------------ lookups
    def lookup(self, schema: Schema, scaffolds=(), *, promote: bool = True) -> EncodedSchema | None:
        """The stored encoding of `schema` (tiers in order device, host, disk), or None.

        A host or disk hit moves the entry to the device tier with `promote` (else a disk hit
        goes to the host tier and a host hit stays there, with NumPy K/V). An entry stored for
        other schema text or options raises ValueError. A disk file that fails verification is
        logged, kept aside and counted (module docstring); the lookup is then a disk miss. An
        OSError reading it (no permission, an I/O error) is raised, the file left in place."""
        name, key = schema.name, self.schema_key(schema, scaffolds)
        for tier in ("device", "host"):
            entry = self._mem[tier].get(name)
            if entry is None:
                self._misses[tier] += 1
                continue
            self._check_key(name, entry.schema_hash, key, tier)
            self._hits[tier] += 1
            if self._disk is not None:
                self._disk.touch(name)
            if tier == "host" and promote:
                del self._mem["host"][name]
                entry = _Entry(key, _on_device(entry.encoded), entry.nbytes)
                self._place("device", name, entry)
            else:
                self._mem[tier].move_to_end(name)
            return entry.encoded
        disk = self._disk
        if disk is None:
            return None
        with disk.lock:
            disk.sync()
            rec, enc = disk.records.get(name), None
            if rec is not None:
                self._check_key(name, rec.schema_hash, key, "disk")
                enc = disk.load(name, key)
            if enc is None:
                self._misses["disk"] += 1
                return None
            self._hits["disk"] += 1
            disk.touch(name)
            disk.write_manifest()
        entry = _Entry(key, _on_device(enc) if promote else enc, encoded_nbytes(enc))
        self._place("device" if promote else "host", name, entry)
        return entry.encoded

    def insert(self, schema: Schema, encoded: EncodedSchema, scaffolds=()) -> None:
        """Store `encoded` (the encoding of `schema` with `scaffolds`) in the device tier and, with
        a directory, on disk; replaces an entry of the same schema name."""
        if not isinstance(encoded, EncodedSchema):
            raise TypeError(f"encoded: received {type(encoded).__name__}, expected EncodedSchema")
        if encoded.schema != schema.name:
            raise ValueError(f"encoded: encodes schema {encoded.schema!r}, expected {schema.name!r}")
        check_encoded(self.model.config, self.identity.dtype, encoded)
        for tier in ("device", "host"):
            self._mem[tier].pop(schema.name, None)
        entry = _Entry(self.schema_key(schema, scaffolds), _on_device(encoded), encoded_nbytes(encoded))
        if self._disk is not None:                   # replaces its file atomically: a failed write keeps it
            self._evictions["disk"] += self._disk.write(schema.name, entry.encoded, entry.schema_hash, entry.nbytes)
        self._place("device", schema.name, entry)

    def encode_or_load(self, schema: Schema, scaffolds=(), *, replace: bool = False,
                       promote: bool = True) -> EncodedSchema:
        """`lookup(schema)`, else encode every module (`encode_schema`) and `insert` it.
        `replace=True` drops an entry stored for other schema text or options instead of raising."""
        if replace:
            key = self.schema_key(schema, scaffolds)
            held = [self._mem[t][schema.name].schema_hash for t in ("device", "host") if schema.name in self._mem[t]]
            if self._disk is not None:
                with self._disk.lock:
                    self._disk.sync()
                    rec = self._disk.records.get(schema.name)
                    held += [] if rec is None else [rec.schema_hash]
            if any(h != key for h in held):
                self.remove(schema.name)
        enc = self.lookup(schema, scaffolds, promote=promote)
        if enc is not None:
            return enc
        enc = encode_schema(self.model, self.params, self.schema_layout(schema), scaffolds=scaffolds,
                            pad_multiple=self.pad_multiple)
        self.insert(schema, enc, scaffolds)
        return enc

    def remove(self, name: str) -> None:
        """Drop schema `name` from every tier (its file too)."""
        for tier in ("device", "host"):
            self._mem[tier].pop(name, None)
        if self._disk is not None:
            with self._disk.lock:
                self._disk.sync()
                if name in self._disk.records:
                    self._disk.delete(name)

    # ------------------------------------------------------------------ introspection
    def names(self, tier: str) -> tuple[str, ...]:
        """Schema names held by `tier`, least recently used first."""
        if tier not in TIERS:
            raise ValueError(f"tier: received {tier!r}, expected one of {TIERS}")
        if tier == "disk":
            return () if self._disk is None else tuple(self._disk.records)
        return tuple(self._mem[tier])

    def stats(self) -> CacheStats:
        """Hits, misses, evictions, bytes and entries per tier (module docstring)."""
        held = {t: [e.nbytes for e in self._mem[t].values()] for t in ("device", "host")}
        records = () if self._disk is None else self._disk.records.values()
        held["disk"] = [r.bytes for r in records]
        tokens = {t: sum(e.encoded.tokens for e in self._mem[t].values()) for t in ("device", "host")}
        tokens["disk"] = sum(r.tokens for r in records)
        return CacheStats(dict(self._hits), dict(self._misses), dict(self._evictions),
                          {t: int(sum(held[t])) for t in TIERS}, {t: len(held[t]) for t in TIERS}, tokens,
                          self.bytes_per_token, 0 if self._disk is None else self._disk.failures)

    # ------------------------------------------------------------------ tiers
    def _check_key(self, name: str, stored: str, key: str, tier: str) -> None:
        if stored != key:
            raise ValueError(f"schema {name!r}: the {tier} tier holds an encoding of other schema text or options "
                             f"(schema hash {stored[:12]}, expected {key[:12]}); pass replace=True to encode it again")

    def _place(self, tier: str, name: str, entry: _Entry) -> None:
        held = self._mem[tier]
        held[name] = entry
        held.move_to_end(name)
        budget = getattr(self.budgets, tier)
        while budget is not None and held and sum(e.nbytes for e in held.values()) > budget:
            old, e = held.popitem(last=False)
            self._evictions[tier] += 1
            if tier == "device":
                self._place("host", old, _Entry(e.schema_hash, _on_host(e.encoded), e.nbytes))
            elif self._disk is not None:
                with self._disk.lock:
                    self._disk.sync()
                    if old not in self._disk.records:
                        self._evictions["disk"] += self._disk.write(old, e.encoded, e.schema_hash, e.nbytes)
