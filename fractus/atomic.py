"""Atomic file writes: a crash at any moment leaves the previous file or the new one, never a mix."""
from __future__ import annotations

import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path


def temp_name(path: Path) -> Path:
    """A fresh name for a temporary file beside ``path``: ``.<name>.<12 hex digits>.tmp``."""
    return path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"


def leftover_temps(path: str | Path) -> list[Path]:
    """The temporary files of :func:`atomic_open` beside ``path`` (left by a process killed while
    writing it; only its caller knows that no write is under way)."""
    path = Path(path)
    own = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{12}}\.tmp")
    return sorted(p for p in path.parent.glob(f".{path.name}.*.tmp") if own.fullmatch(p.name))


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs):
    """Open a temporary file beside ``path`` (:func:`temp_name`) for writing; on a clean exit it
    is flushed, fsynced and renamed onto ``path``, and the folder is fsynced; on an error it is
    removed, and an OSError that names no file (a full disk), raised by the writer or underneath
    its own error (``torch.save``'s RuntimeError), is raised again naming ``path``.
    The file gets the mode ``open()`` would give it (0o666 less the umask).
    ``mode``: "w" or "wb"; ``kwargs`` go to :func:`open` (e.g. ``newline=""``)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: no folder {path.parent}")
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        err = underlying_os_error(e)
        if err is None or err.filename is not None:
            raise
        named = OSError(f"cannot write {path}: {err.strerror or err}")  # str(): the message alone
        named.errno = err.errno
        raise named from e
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def underlying_os_error(e: BaseException) -> OSError | None:
    """``e`` if it is an OSError, else the OSError it was raised from or while handling (a library
    that wraps a failed write in its own error: ``torch.save`` on a full disk), else None."""
    seen = set()
    while isinstance(e, Exception) and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
