"""Outputs that never overwrite an input and never look complete when they are not.

Every command-line output of caper_jax (annotate, evaluate ex, verify, convert) goes through this
module:

* ``check_output(path, inputs=..., flag="--output")`` runs before any work and refuses, with one
  line (``OutputError``), an output that is, or resolves to (symlink, hard link, ``..``), one of
  the command's inputs; an existing SQLite database; a directory; or a file whose directory is
  missing or cannot be written (checked by creating and removing a probe file there, which is what
  counts for root, read-only mounts and immutable directories alike).
* ``AtomicWriter(path)`` (or ``with atomic_output(path) as f``) writes to a temporary file in the
  same directory (``.<name>.<random>.tmp``) and, when the work is done, flushes, fsyncs and
  renames it over ``path`` (``os.replace``, atomic on POSIX). On any exception, KeyboardInterrupt
  included, the temporary file is removed and ``path`` is left exactly as it was. A reader sees
  the previous file or the complete new one, never a half-written one.
* ``check_output_dir`` / ``check_writable_dir`` do the same checks for an output directory.

An existing output that is not a regular file (``/dev/stdout``, ``/dev/null``, a named pipe) is
written in place: it cannot be replaced by a rename, and must not be.

No JAX here: the annotation command line imports this module.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import stat
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

SQLITE_MAGIC = b"SQLite format 3\x00"

PathLike = str | os.PathLike


class OutputError(ValueError):
    """An output path that would lose data or cannot be written; the message is one line."""


def is_sqlite_file(path: PathLike) -> bool:
    """Whether the file starts with SQLite's 16-byte header."""
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def check_sqlite_database(path: PathLike, flag: str = "--db") -> pathlib.Path:
    """The path of an existing SQLite database file, or OutputError-style ValueError in one line."""
    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a SQLite database")
    if p.stat().st_size == 0:
        raise ValueError(f"{flag} {path} is an empty file, not a SQLite database")
    if not is_sqlite_file(p):
        raise ValueError(f"{flag} {path} is not a SQLite database (no 'SQLite format 3' header)")
    return p


def is_special_file(path: PathLike) -> bool:
    """Whether ``path`` exists (links followed) and is not a regular file or directory: a device, a pipe."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)   # hard links, bind mounts
    except OSError:
        return False


def check_writable_dir(directory: PathLike, what: str) -> None:
    """Raises OutputError unless ``directory`` is an existing directory a new file can be made in."""
    d = pathlib.Path(directory)
    if not d.exists():
        raise OutputError(f"{what}: directory {d} does not exist")
    if not d.is_dir():
        raise OutputError(f"{what}: {d} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".caper-write-probe-")
    except OSError as error:
        raise OutputError(f"{what}: cannot write in directory {d} ({error.strerror or error})") from None
    os.close(fd)
    os.unlink(probe)


def check_output(path: PathLike, inputs: Iterable[PathLike | None] = (), *, flag: str = "--output") -> pathlib.Path:
    """Checks an output file before any work (module docstring); returns its resolved path."""
    given = pathlib.Path(path)
    if is_special_file(given):        # /dev/stdout, /dev/null, a FIFO: written in place
        return given
    target = given.resolve()          # follows symlinks: a link to an input is that input
    what = f"{flag} {path}"
    for source in inputs:
        if source is None:
            continue
        if _same_file(target, pathlib.Path(source).resolve()):
            raise OutputError(f"{what} is the input {source}: it would be overwritten; write to another file")
    if target.is_dir():
        raise OutputError(f"{what} is a directory; give a file name")
    if target.exists() and is_sqlite_file(target):
        raise OutputError(f"{what} is a SQLite database; refusing to overwrite it")
    check_writable_dir(target.parent, what)
    return target


def check_output_dir(path: PathLike, inputs: Iterable[PathLike | None] = (), *, flag: str = "--output_dir",
                     must_be_empty: bool = False) -> pathlib.Path:
    """Checks an output directory (created later if missing) before any work; returns it resolved.

    Refused: a path that is or resolves to an input (or contains one, when ``must_be_empty``: the
    directory would be replaced), an existing file, a non-empty directory when ``must_be_empty``,
    and a path whose nearest existing ancestor is not a writable directory.
    """
    target = pathlib.Path(path).resolve()
    what = f"{flag} {path}"
    for source in inputs:
        if source is None:
            continue
        source_path = pathlib.Path(source).resolve()
        if _same_file(target, source_path) or (must_be_empty and target in source_path.parents):
            raise OutputError(f"{what} is (or holds) the input {source}: it would be overwritten")
    if target.exists() and not target.is_dir():
        raise OutputError(f"{what} is a file, not a directory")
    if must_be_empty and target.is_dir() and any(target.iterdir()):
        raise OutputError(f"{what} exists and is not empty; choose a new directory")
    existing = target
    while not existing.exists():
        existing = existing.parent
    check_writable_dir(existing, what)
    return target


def _new_file_mode(existing: pathlib.Path) -> int:
    try:
        return existing.stat().st_mode & 0o7777       # replacing a file keeps its permissions
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class AtomicWriter:
    """A text (or binary) file written under a temporary name and renamed into place on ``close``.

    ``discard()`` (or leaving a ``with`` block by an exception) removes the temporary file and
    leaves the target untouched. A symlink target is followed: the file it points to is replaced.
    """

    def __init__(self, path: PathLike, mode: str = "w", encoding: str | None = "utf-8"):
        if mode not in ("w", "wb"):
            raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
        self._done = False
        self.direct = is_special_file(path)   # a device or pipe: written in place, nothing to rename
        if self.direct:
            self.path, self.tmp_path = pathlib.Path(path), None
            self.file = open(path, mode, encoding=None if mode == "wb" else encoding)
            return
        self.path = pathlib.Path(path).resolve()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.tmp_path = pathlib.Path(tmp)
        self._done = False
        try:
            self.file: IO = os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding)
        except BaseException:
            os.close(fd)
            self.tmp_path.unlink(missing_ok=True)
            raise

    def write(self, data) -> int:
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def commit(self) -> pathlib.Path:
        """Flushes, fsyncs and renames the temporary file over the target."""
        if self._done:
            return self.path
        if self.direct:
            self._done = True
            self.file.close()
            return self.path
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.chmod(self.tmp_path, _new_file_mode(self.path))
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.discard()
            raise
        self._done = True
        return self.path

    def discard(self) -> None:
        """Removes the temporary file; the target keeps its previous content (or stays absent)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self.file.close()
        if self.tmp_path is not None:
            with contextlib.suppress(OSError):
                self.tmp_path.unlink()

    close = commit

    def __enter__(self) -> AtomicWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


@contextlib.contextmanager
def atomic_output(path: PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """``with atomic_output(p) as f: f.write(...)``: ``p`` appears, complete, only on success."""
    writer = AtomicWriter(path, mode, encoding)
    try:
        yield writer.file
    except BaseException:
        writer.discard()
        raise
    writer.commit()


def write_text_atomic(path: PathLike, text: str) -> pathlib.Path:
    with atomic_output(path) as f:
        f.write(text)
    return pathlib.Path(path)


__all__ = ["AtomicWriter", "OutputError", "atomic_output", "check_output", "check_output_dir",
           "check_sqlite_database", "check_writable_dir", "is_sqlite_file", "write_text_atomic"]
