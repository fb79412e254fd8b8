"""`manifest.json` of a Prompt Cache directory: the cache identity and, per stored schema, its
file's `FileRecord` (schema hash, bytes, tokens, header digest), least recently used first.

The manifest carries `digest`: the SHA-256 of its other fields as canonical JSON (sorted keys,
no whitespace), so a manifest that was changed, truncated or replaced by other bytes fails
`read_manifest` with `CorruptFile`, as does one of another format. The identity is checked
before the digest: a manifest that names another model, dtype or tokenizer raises a plain
ValueError naming what differs, whatever else it holds, because that directory belongs to
another cache and is refused, never repaired. `write_manifest` writes atomically
(`write_atomic`).
"""
from __future__ import annotations

import hashlib
import json
import os

from models.prompt_cache.atomic import write_atomic
from models.prompt_cache.identity import CacheIdentity
from models.prompt_cache.schema_file import FORMAT, CorruptFile, FileRecord, read_record

__all__ = ["MANIFEST", "read_manifest", "schema_file", "unlisted_records", "write_manifest"]

MANIFEST = "manifest.json"


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def schema_file(name: str) -> str:
    """The file name of schema `name` in a cache directory."""
    return f"{name}.safetensors"


def write_manifest(directory: str, identity: CacheIdentity, records: dict) -> None:
    """Write `directory/manifest.json` for `records` (schema name -> `FileRecord`, least
    recently used first) atomically, with its digest."""
    schemas = {name: {"file": schema_file(name), "schema_hash": r.schema_hash, "bytes": r.bytes, "tokens": r.tokens,
                      "digest": r.digest, "used": i} for i, (name, r) in enumerate(records.items())}
    body = {"format": FORMAT, "identity": identity.as_dict(), "schemas": schemas}
    text = json.dumps({**body, "digest": _digest(body)}, indent=1)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    write_atomic(os.path.join(directory, MANIFEST), write)


def read_manifest(directory: str, identity: CacheIdentity) -> dict:
    """The records of `directory/manifest.json` (schema name -> `FileRecord`, least recently used
    first). `CorruptFile` for a manifest that is not this format or fails its digest; ValueError
    for one of another model, dtype or tokenizer; FileNotFoundError when there is none."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise CorruptFile(path, "empty file (0 bytes)")
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFile(path, f"not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CorruptFile(path, f"not a prompt cache manifest (a JSON {type(manifest).__name__})")
    if manifest.get("format") != FORMAT:
        raise CorruptFile(path, f"format {manifest.get('format')!r}, expected {FORMAT!r}")
    ident = manifest.get("identity")
    fields = ("model", "dtype", "tokenizer")
    if not isinstance(ident, dict) or not all(isinstance(ident.get(k), str) for k in fields):
        raise CorruptFile(path, f"garbled identity {ident!r}")
    bad = identity.mismatches(CacheIdentity(*(ident[k] for k in fields)))
    if bad:
        raise ValueError(f"cache directory {directory}: made for another model, dtype or tokenizer: {'; '.join(bad)}")
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if manifest.get("digest") != _digest(body):
        raise CorruptFile(path, "fails its SHA-256 digest (changed bytes)")
    try:
        items = sorted(manifest["schemas"].items(), key=lambda kv: kv[1]["used"])
        return {name: FileRecord(str(r["schema_hash"]), int(r["bytes"]), int(r["tokens"]), str(r["digest"]))
                for name, r in items}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptFile(path, f"garbled schema records ({type(e).__name__}: {e})") from None


def unlisted_records(directory: str, identity: CacheIdentity, listed) -> dict:
    """Records of the schema files in `directory` that `listed` (names) leaves out and whose
    headers verify (`read_record`), by name; other files are not this cache's and are left as
    they are."""
    found = {}
    for fname in sorted(os.listdir(directory)):
        name = fname.removesuffix(".safetensors")
        if name == fname or name in listed:
            continue
        try:
            found[name] = read_record(os.path.join(directory, fname), identity, name)
        except (ValueError, OSError):
            continue
    return found
