"""Atomic file writes: a file is either its old content or its new content, never half.

Every result, table and checkpoint the package writes goes through here: write to a temporary
file in the same folder, flush it to disk, then rename over the target (atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)` to produce the file, then move it into place atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


def atomic_write_parquet(path: str | Path, frame) -> None:
    """A pandas DataFrame as Parquet, atomically."""
    atomic_write(path, lambda p: frame.to_parquet(p, index=False))


@contextlib.contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) or fail at once.

    The operating system releases it when the holder exits, even when killed, so a stale
    lock never blocks a resumed run.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{path.parent} is in use by another process") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
