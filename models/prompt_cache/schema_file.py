"""One encoded schema (`EncodedSchema`) as a safetensors file that verifies itself.

The file is an ordinary safetensors file (an 8-byte little-endian header length, a JSON header,
the raw tensor bytes) holding `k`, `v`, `positions`, `token_ids`, `keep` and `offsets`. Its
metadata names the format, the cache identity (model, dtype, tokenizer), the schema's name and
hash, its module names, its token count and `digests`: the SHA-256 of every tensor's bytes.
`header_digest` (SHA-256 of the header bytes, which hold those tensor digests) is what a
manifest records for the file, so one digest covers the whole file.

* `save_encoded` writes the file atomically (`write_atomic`: a temporary file, fsync, rename).
* `load_encoded` reads the whole file once and checks, in this order, its structure (length,
  header JSON, tensor names, dtypes, shapes and byte ranges that tile the data exactly), the
  header digest against the manifest's (when given), every tensor's digest, then the format,
  identity and schema; the first failure raises `CorruptFile` (a ValueError) naming the file
  and what failed (`HeaderDigestMismatch`, a `CorruptFile`, when only the header digest was
  checked so far), or for a file of another model, dtype, tokenizer or schema a ValueError
  naming what differs. Errors of the system rather than of the file's bytes (no permission,
  an I/O error) are raised as the OSError they are.
* `read_record` reads only the header: what a manifest records for a file found without one.

Only safetensors and JSON are read and written, never pickle.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import types

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy

from models.prompt_cache.atomic import write_atomic
from models.prompt_cache.encode import EncodedSchema
from models.prompt_cache.identity import CacheIdentity

__all__ = ["ARRAYS", "FORMAT", "CorruptFile", "FileRecord", "HeaderDigestMismatch", "load_encoded", "read_record",
           "save_encoded"]

FORMAT = "jax-prefix-attn prompt cache 3"
ARRAYS = ("k", "v", "positions", "token_ids", "keep", "offsets")
_MAX_HEADER = 100_000_000           # safetensors' own limit on the header's size
_DTYPES = types.MappingProxyType({
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_})


class CorruptFile(ValueError):
    """A cache file (schema file or manifest) that is damaged: `path` and `reason`."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class HeaderDigestMismatch(CorruptFile):
    """A schema file whose header digest differs from the one its manifest recorded (its
    structure checked, its tensor digests and metadata not yet): a changed or swapped file, or
    one replaced by a writer stopped before it wrote the manifest."""


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """What a manifest records of a schema file: its schema hash, size in bytes, tokens and
    header digest."""
    schema_hash: str
    bytes: int
    tokens: int
    digest: str


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).reshape(-1)).hexdigest()


def save_encoded(path: str, encoded: EncodedSchema, identity: CacheIdentity, schema_hash: str) -> int:
    """Write `encoded` to the safetensors file `path` atomically, with its identity, schema name
    and hash and the digest of every tensor as metadata; returns the file's size in bytes."""
    tensors = {a: np.ascontiguousarray(jax.device_get(getattr(encoded, a))) for a in ARRAYS}
    meta = {"format": FORMAT, **identity.as_dict(), "schema": encoded.schema, "schema_hash": schema_hash,
            "names": json.dumps(list(encoded.names)), "tokens": str(encoded.tokens),
            "digests": json.dumps({a: _digest(t) for a, t in tensors.items()}, sort_keys=True)}
    write_atomic(path, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata=meta))
    return os.path.getsize(path)


def _header(path: str, f, size: int) -> tuple[bytes, dict]:
    """`(header bytes, header JSON)` of an open safetensors file of `size` bytes."""
    if size == 0:
        raise CorruptFile(path, "empty file (0 bytes)")
    if size < 8:
        raise CorruptFile(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(_MAX_HEADER, size - 8):
        raise CorruptFile(path, f"header length {n} exceeds the file ({size} bytes): truncated or garbled")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFile(path, f"garbled header (not JSON: {e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptFile(path, "garbled header (no metadata)")
    return raw, header


def _tensor_layout(path: str, header: dict, data_bytes: int) -> dict:
    """`{name: (dtype, shape, start, end)}`, checked against the data section's size."""
    got = sorted(k for k in header if k != "__metadata__")
    if got != sorted(ARRAYS):
        raise CorruptFile(path, f"holds tensors {got}, expected {sorted(ARRAYS)}")
    out, ranges = {}, []
    for a in ARRAYS:
        t = header[a]
        try:
            dtype = np.dtype(_DTYPES[t["dtype"]])
            shape = tuple(int(d) for d in t["shape"])
            start, end = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(path, f"garbled header entry of tensor {a!r}: {t!r}") from None
        if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != int(np.prod(shape)) * dtype.itemsize:
            raise CorruptFile(path, f"tensor {a!r}: bytes {start}..{end} do not hold {dtype.name} {list(shape)}")
        out[a] = (dtype, shape, start, end)
        ranges.append((start, end))
    pos = 0
    for start, end in sorted(ranges):
        if start != pos:
            raise CorruptFile(path, f"tensor byte ranges overlap or leave gaps (at byte {pos})")
        pos = end
    if pos != data_bytes:
        what = "truncated" if pos > data_bytes else "trailing bytes"
        raise CorruptFile(path, f"{what}: the header describes {pos} data bytes, the file holds {data_bytes}")
    return out


def _check_meta(path: str, meta: dict, identity: CacheIdentity, schema: str, schema_hash: str | None) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    got = CacheIdentity(meta.get("model", ""), meta.get("dtype", ""), meta.get("tokenizer", ""))
    bad = identity.mismatches(got)
    if bad:
        raise ValueError(f"{path}: made for another model, dtype or tokenizer: {'; '.join(bad)}")
    if meta.get("schema") != schema or (schema_hash is not None and meta.get("schema_hash") != schema_hash):
        want = f"expected schema {schema!r}" + (f" hash {schema_hash[:12]}" if schema_hash is not None else "")
        raise ValueError(f"{path}: holds schema {meta.get('schema')!r} hash {str(meta.get('schema_hash'))[:12]}, "
                         f"{want} (other schema text or options)")


def load_encoded(path: str, identity: CacheIdentity, schema: str, schema_hash: str,
                 digest: str | None = None) -> EncodedSchema:
    """Read and verify an `EncodedSchema` (NumPy K/V) written by `save_encoded` (module
    docstring); `digest`: the header digest a manifest recorded for the file, or None."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw, header = _header(path, f, size)
        start = 8 + len(raw)
        data = bytearray(size - start)
        got = f.readinto(data)
    if got != len(data):
        raise CorruptFile(path, f"truncated while reading: {got} of {len(data)} data bytes")
    if digest is not None and hashlib.sha256(raw).hexdigest() != digest:
        raise HeaderDigestMismatch(path, "header digest differs from the manifest's (a changed or swapped file)")
    layout = _tensor_layout(path, header, len(data))
    meta = header["__metadata__"]
    try:
        digests = json.loads(meta["digests"])
        names = tuple(json.loads(meta["names"]))
    except (KeyError, TypeError, json.JSONDecodeError):
        raise CorruptFile(path, "no tensor digests or module names in the header") from None
    tensors = {}
    for a, (dtype, shape, lo, hi) in layout.items():
        t = np.frombuffer(data, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=lo).reshape(shape)
        if not isinstance(digests, dict) or _digest(t) != digests.get(a):
            raise CorruptFile(path, f"tensor {a!r} fails its SHA-256 digest (changed bytes)")
        tensors[a] = t
    _check_meta(path, meta, identity, schema, schema_hash)
    t = tensors
    return EncodedSchema(schema, names, t["k"], t["v"], t["positions"], t["token_ids"], t["keep"], t["offsets"])


def read_record(path: str, identity: CacheIdentity, schema: str) -> FileRecord:
    """The manifest record of the schema file `path` from its header alone (structure, format,
    identity and schema name checked; tensor digests are checked when the file is loaded)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw, header = _header(path, f, size)
    _tensor_layout(path, header, size - 8 - len(raw))
    meta = header["__metadata__"]
    _check_meta(path, meta, identity, schema, None)
    try:
        return FileRecord(str(meta["schema_hash"]), size, int(meta["tokens"]), hashlib.sha256(raw).hexdigest())
    except (KeyError, ValueError):
        raise CorruptFile(path, "no schema hash or token count in the header") from None
