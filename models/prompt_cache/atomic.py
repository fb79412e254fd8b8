"""File operations of a Prompt Cache directory that never leave a half-written or silently
replaced file, and the lock that serializes the processes sharing the directory.

* `write_atomic(path, write)`: `write(tmp)` fills a temporary file in `path`'s directory
  (`.NAME.<random>.tmp`), which is flushed to disk (`fsync`) and renamed over `path`
  (`os.replace`); the directory entry is synced too. A crash leaves either the old file or the
  new one, never a mix; an error removes the temporary file.
* `keep_aside(path)`: renames a damaged file to `NAME.corrupt-<UTC time>` (a further `-N` when
  that name exists), so that nothing a user stored is deleted or overwritten; call it while
  holding the `DirectoryLock`.
* `remove_temporaries(directory)`: deletes the temporary files that writers killed part-way left
  behind; call it only while holding the `DirectoryLock`, under which no writer is active.
* `DirectoryLock(directory)`: an exclusive `fcntl.flock` on the directory itself (no lock file),
  re-entrant within one holder. `PromptCache` holds it across every read-modify-write of the
  directory. The kernel drops the lock when its holder dies, so a killed process never leaves
  the directory locked.
"""
from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from typing import Callable

__all__ = ["DirectoryLock", "keep_aside", "remove_temporaries", "write_atomic"]

_TEMPORARY = re.compile(r"\..+\.tmp\Z")


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """Create `path` by `write(tmp)` on a temporary file of the same directory, fsync it and
    rename it over `path` (module docstring)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)                # mkstemp makes 0600; cache files are readable like others
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_directory(directory)


def keep_aside(path: str) -> str:
    """Rename `path` to `path.corrupt-<UTC time>[-N]` without replacing any file; returns the
    new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base, n = f"{path}.corrupt-{stamp}", 0
    while True:
        aside = base if n == 0 else f"{base}-{n}"
        try:
            os.link(path, aside)            # fails if `aside` exists: nothing is replaced
        except FileExistsError:
            n += 1
            continue
        except FileNotFoundError:
            raise
        except OSError:                     # no hard links here (or `path` is a directory)
            if os.path.lexists(aside):
                n += 1
                continue
            os.rename(path, aside)          # the directory lock keeps `aside` free meanwhile
        else:
            os.remove(path)
        _sync_directory(os.path.dirname(os.path.abspath(path)))
        return aside


def remove_temporaries(directory: str) -> list[str]:
    """Delete `.NAME.<random>.tmp` files of killed writers in `directory`; returns their names."""
    gone = []
    for name in os.listdir(directory):
        if _TEMPORARY.match(name):
            try:
                os.remove(os.path.join(directory, name))
                gone.append(name)
            except FileNotFoundError:
                pass
    return gone


class DirectoryLock:
    """Exclusive lock of a cache directory (`fcntl.flock` on the directory), used as
    `with lock: ...`; nested `with` blocks of one holder take it once."""

    def __init__(self, directory: str):
        self.path = os.fspath(directory)
        self._fd: int | None = None
        self._depth = 0

    def __enter__(self) -> "DirectoryLock":
        if self._depth == 0:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
