"""Atomic file writes: a file is either its old content or its new content, never half.

Every result, table and checkpoint the package writes goes through here: write to a temporary
file in the same folder (`.tmp-<name>-<random>`), flush it to disk, then rename over the target
(atomic on POSIX). The file gets the mode a plain `open()` would give it (0666 less the
process's umask), not the temporary file's private 0600. A kill between the two steps leaves
the temporary behind: `remove_temporaries` clears them (a resumed run does).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TEMPORARY_PREFIX = ".tmp-"


class DamagedFileError(ValueError):
    """A file the package reads is empty, truncated, not UTF-8 or lacks a field it needs; the
    message names the file."""


class FolderInUseError(RuntimeError):
    """Another process holds a folder's lock (`exclusive_lock`); the message names the folder."""


def current_umask() -> int:
    """The process's umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no other way to read it: set and restore at once
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)` to produce the file, then move it into place atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{path.name}-", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        os.chmod(tmp_path, 0o666 & ~current_umask())
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


def read_parquet(path: str | Path, fix: str = "", data: bytes | None = None):
    """A Parquet table as a pandas DataFrame (from `data`, the file's bytes already read, when
    given); DamagedFileError names a file that cannot be read (truncated, not Parquet), with
    `fix` (how to write it anew) appended."""
    import io

    import pandas as pd
    import pyarrow

    try:
        return pd.read_parquet(path if data is None else io.BytesIO(data))
    except (pyarrow.ArrowException, OSError, ValueError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        # pyarrow's first line names the file too: keep what follows its name.
        reason = (str(error).splitlines() or [type(error).__name__])[0].split("': ")[-1]
        raise DamagedFileError(
            f"{path}: cannot be read as Parquet ({reason}){'; ' + fix if fix else ''}"
        ) from None


def remove_temporaries(folder: str | Path) -> list[Path]:
    """Delete the temporaries (files or folders named `.tmp-*`, and `.*.tmp` files) that a
    killed writer left directly in `folder`; returns them. Call it only while no other process
    writes there (e.g. under the folder's `exclusive_lock`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stray = [*folder.glob(f"{TEMPORARY_PREFIX}*"), *folder.glob(".*.tmp")]
    for path in stray:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stray


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
            raise FolderInUseError(f"{path.parent} is in use by another process") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
