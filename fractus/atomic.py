"""Atomic file writes: a crash at any moment leaves the previous file or the new one, never a mix."""
from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs):
    """Open a temporary file beside ``path`` (``.<name>.<random>.tmp``) for writing; on a clean
    exit it is flushed, fsynced and renamed onto ``path``, and the folder is fsynced; on an error
    it is removed. The file gets the mode ``open()`` would give it (0o666 less the umask).
    ``mode``: "w" or "wb"; ``kwargs`` go to :func:`open` (e.g. ``newline=""``)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: no folder {path.parent}")
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
