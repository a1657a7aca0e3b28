"""On-disk cache of task datasets: one safetensors file per (task configuration, split, size).

Files live in `cache_dir/tasks/` where `cache_dir` defaults to `$MECHEVAL_CACHE`, else
`~/.cache/mecheval`. A file is written to a temporary name in the same folder and then moved
into place with `os.replace`, so a reader never sees a half-written file and concurrent writers
of the same dataset simply race to an identical result.

Tokens (and targets, for tasks that have them) are stored packed (each row's first `length`
tokens, concatenated) in the smallest integer dtype that holds them: ATR documents vary from a
few to 1,000+ tokens, so a padded int64 matrix would be mostly padding.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mecheval.io import atomic_write
from mecheval.tasks.batch import IGNORE, Batch

CACHE_ENV_VAR = "MECHEVAL_CACHE"
CACHE_FORMAT = "packed-1"
"""Stored in each file's metadata; files of another format are regenerated."""


def default_cache_dir() -> Path:
    """`$MECHEVAL_CACHE` if set and non-empty, else `~/.cache/mecheval`.

    Raises:
        NotADirectoryError: that path, or a folder above it, is a file (named, with the
            variable).
    """
    configured = os.environ.get(CACHE_ENV_VAR)
    path = Path(configured) if configured else Path.home() / ".cache" / "mecheval"
    for above in [path, *path.parents]:
        if above.exists():
            if not above.is_dir():
                where = "is a file" if above == path else f"lies under {above}, which is a file"
                named = (
                    f"{CACHE_ENV_VAR}={configured}" if configured else f"the dataset cache {path}"
                )
                raise NotADirectoryError(
                    f"{named} {where}; the dataset cache needs a folder "
                    f"(set {CACHE_ENV_VAR} to one)"
                )
            break
    return path


def _compact_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The smallest signed integer dtype holding every value (ids are small; saves disk)."""
    if tensor.numel() == 0:
        return torch.int16
    low, high = int(tensor.min()), int(tensor.max())
    for dtype in (torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    return torch.int64


def save_batch(path: Path, batch: Batch, metadata: dict[str, str]) -> None:
    """Write `batch` to `path` atomically (temporary file in the same folder, then `os.replace`).

    Args:
        path: destination `.safetensors` file; its folder is created if missing.
        batch: the documents; stored on CPU, tokens packed (padding dropped) in the smallest
            integer dtype that holds them. Padding columns beyond the longest document are not
            kept: the batch reads back trimmed.
        metadata: string key/values stored in the file header (e.g. the task configuration).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    inside = torch.arange(batch.width, device=batch.device) < batch.lengths[:, None]
    tensors = {
        "packed_tokens": batch.tokens[inside],
        "answers": batch.answers,
        "lengths": batch.lengths,
        **{f"positions.{role}": tensor for role, tensor in batch.positions.items()},
        **{f"spans.{role}": tensor for role, tensor in batch.spans.items()},
    }
    if batch.document is not None:
        tensors["document"] = batch.document
    if batch.targets is not None:
        tensors["packed_targets"] = batch.targets[inside]
    tensors = {
        name: tensor.detach().cpu().to(_compact_dtype(tensor)).contiguous()
        for name, tensor in tensors.items()
    }
    # Atomic, and with the user's umask (mkstemp alone would leave the file 0600).
    atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=metadata))


def load_batch(path: Path, roles: tuple[str, ...] = ()) -> tuple[Batch, dict[str, str]] | None:
    """Read a batch written by `save_batch`; None if the file is missing or unreadable.

    Args:
        roles: the order of the roles (`Task.roles`); others follow in the file's order.

    Returns:
        `(batch, metadata)` with every tensor converted back to int64 on CPU.
    """
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        lengths = tensors["lengths"].long()
        width = int(lengths.max()) if len(lengths) else 0
        inside = torch.arange(width) < lengths[:, None]

        def unpacked(name: str, fill: int) -> torch.Tensor:
            out = torch.full((len(lengths), width), fill, dtype=torch.long)
            out[inside] = tensors[name].long()
            return out

        def named(prefix: str) -> dict[str, torch.Tensor]:
            found = [name[len(prefix) :] for name in tensors if name.startswith(prefix)]
            order = [r for r in roles if r in found] + [r for r in found if r not in roles]
            return {role: tensors[prefix + role].long() for role in order}

        batch = Batch(
            tokens=unpacked("packed_tokens", 0),
            answers=tensors["answers"].long(),
            lengths=lengths,
            positions=named("positions."),
            document=tensors["document"].long() if "document" in tensors else None,
            spans=named("spans."),
            targets=unpacked("packed_targets", IGNORE) if "packed_targets" in tensors else None,
        )
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, SafetensorError):
        return None
    return batch, metadata
