"""The disk tier of a `PromptCache`: a directory of schema files (`models.prompt_cache.schema_file`)
and their `manifest.json` (`models.prompt_cache.manifest`), which verifies itself.

`DiskTier` holds this process's view of the directory (`records`: schema name -> `FileRecord`,
least recently used first). Every read-modify-write of the directory runs under `lock` (an
exclusive `DirectoryLock`) and starts with `sync()`, which reads the manifest again, so records
written by other processes are merged, never lost.

Verification and repair (every file is written atomically, `models.prompt_cache.atomic`):

* `load(name, schema_hash)` verifies a schema file completely (structure, header digest against
  the manifest, every tensor's digest, identity, schema). A file that fails, is truncated or
  empty (`CorruptFile`), or belongs to another model, dtype, tokenizer or schema (ValueError) is
  logged in one line (logger `models.prompt_cache`, WARNING), renamed to
  `NAME.corrupt-<UTC time>` (`keep_aside`), counted in `failures` and dropped: the lookup is a
  miss.
* A file whose header digest alone differs from the manifest's is what a writer stopped between
  replacing a listed file and writing the manifest leaves: it is checked completely without
  that digest (tensor digests, identity, schema name and hash) and, if it passes, adopted (its
  record replaces the manifest's, logged at INFO); a file of another schema or with damaged
  tensors is kept aside as above, the log line naming both failures.
* An error of the system rather than of the file's bytes (no permission, too many open files,
  an I/O error, no memory) is raised as an OSError of one line naming the file; the file and its
  record stay as they are.
* A manifest that fails its digest or is not JSON is kept aside the same way and rebuilt from
  the schema files whose headers verify. A file the manifest does not list is adopted by
  `sync(adopt=True)` (when the directory is opened) if its header verifies (a writer stopped
  between the file's rename and the manifest's), else kept aside before a write of that name.
"""
from __future__ import annotations

import collections
import logging
import os

from models.prompt_cache.atomic import DirectoryLock, keep_aside, remove_temporaries
from models.prompt_cache.encode import EncodedSchema
from models.prompt_cache.identity import CacheIdentity
from models.prompt_cache.manifest import MANIFEST, read_manifest, schema_file, unlisted_records, write_manifest
from models.prompt_cache.schema_file import CorruptFile, HeaderDigestMismatch, load_encoded, read_record, save_encoded

__all__ = ["DiskTier", "read_error"]

_log = logging.getLogger("models.prompt_cache")


def _reason(path: str, error: Exception) -> str:
    """What `error` (of the file `path`) says, without the path."""
    if isinstance(error, CorruptFile):
        return error.reason
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return str(error).removeprefix(f"{path}: ")


def read_error(path: str, error: OSError) -> OSError:
    """`error` (raised reading `path`) as an OSError of the same errno whose one-line message
    names the file and says that it was left in place."""
    text = f"cannot read prompt cache file {path}: {error.strerror or error} (left in place, not treated as damage)"
    return OSError(error.errno, text) if error.errno is not None else OSError(text)


class DiskTier:
    """The schema files and manifest of `directory` for a cache of `identity` (module
    docstring); `budget`: bytes of schema files kept (None = unlimited). Opening it creates the
    directory, removes temporary files of killed writers and adopts unlisted files that verify."""

    def __init__(self, directory: str, identity: CacheIdentity, budget: int | None):
        self.directory, self.identity, self.budget = os.fspath(directory), identity, budget
        self.records: collections.OrderedDict = collections.OrderedDict()   # name -> FileRecord, LRU first
        self.failures = 0           # files and manifests kept aside
        self._touched: list[str] = []    # records used since the manifest was written
        os.makedirs(self.directory, exist_ok=True)
        self.lock = DirectoryLock(self.directory)
        with self.lock:
            remove_temporaries(self.directory)
            self.sync(adopt=True)

    def path(self, name: str) -> str:
        """The file of schema `name`."""
        return os.path.join(self.directory, schema_file(name))

    def touch(self, name: str) -> None:
        """Mark `name` as the most recently used record (kept so by later `sync`s)."""
        if name in self.records:
            self.records.move_to_end(name)
            self._touched.append(name)

    def sync(self, adopt: bool = False) -> None:
        """Read the manifest again (other processes may have written it) into `records`, keeping
        this process's uses since its last write as the most recent; the caller holds the lock.
        A damaged manifest is kept aside and rebuilt; with `adopt`, or when rebuilding, schema
        files the manifest does not list are adopted if their headers verify."""
        try:
            records = read_manifest(self.directory, self.identity)
        except FileNotFoundError:
            records, adopt = None, True
        except CorruptFile as e:
            self.set_aside(None, e, "rebuilding it from the schema files that verify")
            records, adopt = None, True
        disk = collections.OrderedDict((n, r) for n, r in (records or {}).items() if os.path.exists(self.path(n)))
        changed = records is None or len(disk) != len(records)
        if adopt:
            found = unlisted_records(self.directory, self.identity, disk)
            changed |= bool(found)
            disk = collections.OrderedDict([*found.items(), *disk.items()])
        for name in self._touched:
            if name in disk:
                disk.move_to_end(name)
        self.records = disk
        if changed:
            self.write_manifest()

    def load(self, name: str, schema_hash: str) -> EncodedSchema | None:
        """The verified encoding in schema `name`'s listed file (NumPy K/V), or None when the
        file failed verification and was kept aside; adopts a file whose header digest alone
        differs from the manifest's (module docstring). The caller holds the lock and synced."""
        path = self.path(name)
        try:
            try:
                return load_encoded(path, self.identity, name, schema_hash, digest=self.records[name].digest)
            except HeaderDigestMismatch as changed:
                try:
                    enc = load_encoded(path, self.identity, name, schema_hash)
                except ValueError as e:
                    raise CorruptFile(path, f"{changed.reason}; {_reason(path, e)}") from None
            self.records[name] = read_record(path, self.identity, name)
            _log.info("prompt cache: %s: header digest differs from the manifest's, the file verifies (a write "
                      "stopped before the manifest's); adopted", path)
            self.write_manifest()
            return enc
        except (ValueError, FileNotFoundError) as e:
            self.set_aside(name, e, f"encoding schema {name!r} again")
            return None
        except OSError as e:
            raise read_error(path, e) from e

    def write(self, name: str, encoded: EncodedSchema, schema_hash: str, nbytes: int) -> int:
        """Store `encoded` (`nbytes` in memory) as schema `name`'s file, replacing the one there
        (dropped instead when it exceeds the budget), then evict files beyond the budget, least
        recently used first; returns how many were evicted."""
        evicted = 0
        with self.lock:
            self.sync()
            if self.budget is not None and nbytes > self.budget:
                if name in self.records:
                    self.delete(name)
                return evicted
            path = self.path(name)
            if name not in self.records and os.path.lexists(path):
                self.set_aside(name, CorruptFile(path, "not listed in the manifest"), "writing a new one")
            size = save_encoded(path, encoded, self.identity, schema_hash)
            self.records[name] = read_record(path, self.identity, name)
            if self.budget is not None and size > self.budget:   # the file (K/V plus header) alone exceeds it
                self.delete(name)
                return evicted
            self.records.move_to_end(name)
            while (self.budget is not None and len(self.records) > 1
                   and sum(r.bytes for r in self.records.values()) > self.budget):
                evicted += 1
                self.delete(next(iter(self.records)), write=False)
            self.write_manifest()
        return evicted

    def delete(self, name: str, write: bool = True) -> None:
        """Drop `name`'s record and file (and write the manifest with `write`); the caller holds
        the lock and synced."""
        self.records.pop(name, None)
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass
        if write:
            self.write_manifest()

    def set_aside(self, name: str | None, error: Exception, then: str) -> None:
        """Report `error` of a damaged file in one line, keep the file aside and count it; `name`:
        the schema whose file it is (its record is dropped), None for the manifest."""
        path = os.path.join(self.directory, MANIFEST) if name is None else self.path(name)
        self.failures += 1
        try:
            aside = f"kept as {os.path.basename(keep_aside(path))}"
        except FileNotFoundError:
            aside = "already gone"
        _log.warning("prompt cache: %s: %s; %s; %s", path, _reason(path, error), aside, then)
        if name is not None:
            self.records.pop(name, None)
            self.write_manifest()

    def write_manifest(self) -> None:
        """Write the manifest of `records`."""
        write_manifest(self.directory, self.identity, self.records)
        self._touched = []
