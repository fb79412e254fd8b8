"""Where ``jpa-sample --output`` writes its JSONL records, so that no record is lost and no file
is overwritten by accident (:func:`open_records`).

* ``--output FILE``: an exclusive lock (``fcntl.flock`` on ``FILE.lock``, held for the whole
  run) keeps a second run off the same path: it fails at once with a one-line error instead of
  racing the first. Under the lock an existing ``FILE`` is refused unless the mode is
  ``"overwrite"`` (replace it) or ``"append"`` (the run's records are added after its lines).
  Each record is written as its sequence finishes to ``FILE.partial-PID`` (one ``os.write`` of a
  whole line; a short write, e.g. on a full disk, is cut back to the last whole line), so a run
  that is interrupted, fails or is killed keeps every record it finished there. Only a run that
  ends writes ``FILE``: a temporary file in the same directory (the final records in order,
  after the old lines when appending) is flushed to disk and renamed onto ``FILE``, and the
  partial file is removed. Until then ``FILE`` is the previous run's, untouched.
* ``--output -``: each record goes to standard output as its sequence finishes (one write and a
  flush per line); there is nothing to rename.

Every problem is a :class:`~models.cli.args.UsageError` (one line) that says where the records
written so far are.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
from typing import Sequence

from models.cli.args import PROG, STDIN, UsageError

__all__ = ["OUTPUT_MODES", "FileRecords", "StdoutRecords", "kept_on_error", "open_records", "record_line"]

OUTPUT_MODES = ("new", "overwrite", "append")


def record_line(record: dict) -> bytes:
    """One JSONL line (UTF-8, newline-terminated) of a record."""
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def open_records(path: str, mode: str) -> "FileRecords | StdoutRecords":
    """The record writer of ``--output path`` (``-``: standard output) in ``mode`` (one of
    :data:`OUTPUT_MODES`; ignored for standard output)."""
    if mode not in OUTPUT_MODES:
        raise ValueError(f"mode: expected one of {OUTPUT_MODES}, got {mode!r}")
    if path == STDIN:
        return StdoutRecords()
    return FileRecords.open(path, mode)


@contextlib.contextmanager
def kept_on_error(records: "FileRecords | StdoutRecords | None"):
    """On an exception (Ctrl-C included) in the block: ``records`` are abandoned (the partial
    file kept when it holds a record) and, when some were written and the exception is not a
    UsageError (whose message says it), where they are is said on stderr."""
    try:
        yield records
    except BaseException as e:
        if records is not None:
            kept = records.abandon()
            if records.count and not isinstance(e, UsageError):
                print(f"{PROG}: {kept}", file=sys.stderr)
        raise


class StdoutRecords:
    """Records on standard output, each written whole and flushed as its sequence finishes."""

    def __init__(self):
        self.path, self.count = STDIN, 0

    def write(self, record: dict) -> None:
        """Writes one record as one UTF-8 line (to ``sys.stdout.buffer`` when there is one, so
        the stream's encoding does not matter) and flushes it; a closed or failing standard
        output is a UsageError."""
        line = record_line(record)
        try:
            sys.stdout.flush()                 # text written before goes out first
            out = getattr(sys.stdout, "buffer", None)
            if out is None:                    # a text-only stream: it takes str
                sys.stdout.write(line.decode("utf-8"))
                sys.stdout.flush()
            else:
                out.write(line)
                out.flush()
        except OSError as e:  # e.g. the reading end of a pipe has exited
            raise UsageError(f"cannot write --output - (standard output): {e.strerror or e}; "
                             f"{self.abandon()}") from None
        self.count += 1

    def commit(self, records: Sequence[dict]) -> None:
        """Nothing to do: every record went out as it finished."""

    def abandon(self) -> str:
        """Where the records are: already on standard output."""
        return f"{_records(self.count)} written to standard output"


class FileRecords:
    """The records of one run for ``--output FILE`` (module docstring). Use :meth:`open`, then
    :meth:`write` each record as it finishes, and end with :meth:`commit` (the run ended) or
    :meth:`abandon` (it did not: the partial file is kept when it holds a record)."""

    def __init__(self, path: str, mode: str, lock_fd: int, partial: str, fd: int):
        self.path, self.mode, self.partial = path, mode, partial
        self._target = os.path.realpath(path)     # a symbolic link keeps pointing at the file
        self._lock_fd, self._fd = lock_fd, fd
        self.count, self.committed = 0, False

    @classmethod
    def open(cls, path: str, mode: str) -> "FileRecords":
        """Takes the lock of ``path``, checks ``mode`` against an existing file and creates the
        partial file; a UsageError for another run on the path, an existing file in mode
        ``"new"`` or a directory that cannot be written."""
        target = os.path.realpath(path)
        lock_fd = _lock(path, target + ".lock")
        try:
            if mode == "new" and os.path.lexists(path):
                raise UsageError(f"--output {path} exists; give --overwrite to replace it or --append to add this "
                                 f"run's records to it")
            try:
                partial, fd = _new_file(f"{target}.partial-{os.getpid()}")
            except OSError as e:
                raise UsageError(f"cannot write --output {path}: cannot create a file next to it: "
                                 f"{e.strerror or e}") from None
        except BaseException:
            _unlock(target + ".lock", lock_fd)
            raise
        return cls(path, mode, lock_fd, partial, fd)

    def write(self, record: dict) -> None:
        """Appends one record to the partial file with one write call. A failed or short write
        is cut back to the last whole line and reported (UsageError). Whether the line was
        written is read from the file's size, so an exception anywhere in the call (Ctrl-C
        included, re-raised) leaves whole lines in the file and :attr:`count` exact."""
        line = record_line(record)
        before, start = self.count, None
        try:
            start = os.fstat(self._fd).st_size
            done = os.write(self._fd, line)
            if done != len(line):
                raise OSError(f"wrote {done} of {len(line)} bytes (disk full or file size limit)")
            self.count = before + 1
        except BaseException as e:
            if self._settle(start, len(line)):
                self.count = before + 1
            if not isinstance(e, OSError):
                raise
            self.abandon()
            raise UsageError(f"cannot write --output {self.path}: {e.strerror or e}; {self._kept()}") from None

    def _settle(self, start: int | None, length: int) -> bool:
        """After a write of ``length`` bytes at offset ``start`` (None: unknown) did not return
        normally: True when the file holds the whole line, else the file is cut back to
        ``start`` (best effort) and False."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = None
        if start is None:
            return False
        if size == start + length:
            return True
        if size != start:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
        return False

    def commit(self, records: Sequence[dict]) -> None:
        """Writes ``records`` (the run's final records, in their order) to ``FILE`` by a
        flushed temporary file and a rename, after the old lines in mode ``"append"``; removes
        the partial file and the lock. On an error ``FILE`` is unchanged (UsageError). Any other
        exception (Ctrl-C included) is re-raised after the temporary file is removed; when it
        came after the rename, the records are in ``FILE`` and the end is completed first."""
        tmp = None
        try:
            head = b""
            if self.mode == "append" and os.path.exists(self._target):
                with open(self._target, "rb") as f:
                    head = f.read()
                if head and not head.endswith(b"\n"):
                    head += b"\n"
            tmp, fd = _new_file(f"{self._target}.tmp-{os.getpid()}")
            try:
                _write_all(fd, head + b"".join(record_line(r) for r in records))
                if os.path.exists(self._target):
                    os.fchmod(fd, stat.S_IMODE(os.stat(self._target).st_mode))
                os.fsync(fd)
            finally:
                os.close(fd)
            _rename(tmp, self._target, replace=self.mode != "new")
            tmp = None
        except BaseException as e:
            if tmp is not None and _renamed(tmp, self._target):
                _remove(tmp)
                self._end_committed()
                raise
            if tmp is not None:
                _remove(tmp)
            if not isinstance(e, OSError):
                raise
            self.abandon()
            raise UsageError(f"cannot write --output {self.path}: {e.strerror or e}; {self._kept()}") from None
        self._end_committed()

    def _end_committed(self) -> None:
        """``FILE`` holds the records: the rename is flushed to disk, the partial file removed,
        the lock released."""
        self.committed = True
        _fsync_dir(os.path.dirname(self._target))
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _remove(self.partial)
        self._release()

    def abandon(self) -> str:
        """Ends without writing ``FILE``: the partial file is closed and kept unless it is empty
        (it holds whole records only), the lock released. Returns where the records are (one
        phrase)."""
        if self._fd is not None:
            try:
                empty = os.fstat(self._fd).st_size == 0
            except OSError:
                empty = False
            os.close(self._fd)
            self._fd = None
            if empty:
                _remove(self.partial)
        self._release()
        return self._kept()

    def _kept(self) -> str:
        if self.committed:
            return f"{_records(self.count)} written to {self.path}"
        if self.count == 0:
            return f"no record was written; {self.path} is unchanged"
        return f"{_records(self.count)} kept in {self.partial} (whole lines); {self.path} is unchanged"

    def _release(self) -> None:
        if self._lock_fd is not None:
            _unlock(self._target + ".lock", self._lock_fd)
            self._lock_fd = None


def _records(k: int) -> str:
    return f"{k} record{'' if k == 1 else 's'}"


def _lock(path: str, lock_path: str) -> int:
    """An exclusive ``flock`` of ``lock_path`` (created when missing); a UsageError when
    another process holds it. The lock file is removed on release, so a lock taken on a file
    that was removed meanwhile is taken again on the new one."""
    for _ in range(8):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(f"cannot write --output {path}: cannot create its lock file {lock_path}: "
                             f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"cannot write --output {path}: another run is writing it (it holds {lock_path}); "
                             f"wait for it to end or choose another path") from None
        try:
            now = os.stat(lock_path)
            held = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise UsageError(f"cannot write --output {path}: its lock file {lock_path} keeps being replaced")


def _unlock(lock_path: str, fd: int) -> None:
    _remove(lock_path)
    os.close(fd)     # closing releases the flock


def _new_file(base: str) -> tuple[str, int]:
    """A file that did not exist, ``base`` (or ``base-K`` when a killed run of a process with
    the same id left one of that name), opened for appending: ``(name, fd)``."""
    for k in range(100):
        name = base if k == 0 else f"{base}-{k}"
        try:
            return name, os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"{base} and 99 files named {base}-K exist already")


def _rename(src: str, dst: str, *, replace: bool) -> None:
    """``os.replace``; without ``replace`` a file that appeared at ``dst`` meanwhile (written by
    something other than a run of this CLI, which the lock keeps out) is never replaced: a hard
    link fails when ``dst`` exists, where links are not supported the check is made just before."""
    if replace:
        os.replace(src, dst)
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        raise OSError(f"{dst} was created by something else during the run") from None
    except OSError:   # no hard links on this file system
        if os.path.lexists(dst):
            raise OSError(f"{dst} was created by something else during the run") from None
        os.replace(src, dst)
        return
    try:
        os.unlink(src)
    except OSError:   # dst holds the records: src is only a second name of the same file
        pass


def _renamed(src: str, dst: str) -> bool:
    """Whether :func:`_rename` of ``src`` onto ``dst`` was made: ``src`` is gone or is ``dst``."""
    try:
        return not os.path.lexists(src) or os.path.samefile(src, dst)
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:
            raise OSError(f"wrote 0 of {len(view)} bytes (disk full or file size limit)")
        view = view[written:]


def _fsync_dir(directory: str) -> None:
    """Flushes a directory entry (the rename) to disk where the system allows it."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
