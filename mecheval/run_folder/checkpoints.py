"""A run folder's checkpoints: written so that they survive a kill at any instant, and checked
for damage on disk when read.

A checkpoint is a folder `checkpoints/step_000123/` holding
    model.safetensors      the model weights
    optimizer.safetensors  every tensor of the optimiser state (AdamW moments, step counts)
    rng.safetensors        the torch RNG states (CPU, and CUDA when used)
    state.json             step, optimiser param-group scalars, anything else JSON-able, the
                           sha256 of each .safetensors file ("checksums") and of its own
                           content ("state_sha256"); written last
It is written into a temporary folder and renamed into place; `checkpoints/latest` (written
atomically afterwards) names the newest complete one. A kill leaves either the previous
checkpoint or the new one, and stray temporary folders are ignored and cleaned up.

The newest checkpoint is the complete folder with the highest step: the `latest` pointer is for
people and tools, and a missing or dangling one is rewritten from the folders. Loading verifies
the checksums first, so a truncated or overwritten file is refused by name instead of loading
garbage; `restore_newest` falls back to the newest intact checkpoint, warns about each one it
skipped (and why) and moves those aside (`.damaged-step_...`). Pruning never deletes the
checkpoint just written. A checkpoint without checksums (written before they were recorded)
is checked for its files only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from mecheval.io import DamagedFileError, atomic_write_text, current_umask, remove_temporaries

POINTER = "latest"
STATE = "state.json"
WEIGHTS = "model.safetensors"  # all that evaluation loads of a checkpoint
TENSOR_FILES = (WEIGHTS, "optimizer.safetensors", "rng.safetensors")
DAMAGED_PREFIX = ".damaged-"


class CheckpointError(DamagedFileError):
    """A checkpoint cannot be used: a file is missing, truncated, altered or unreadable."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _state_digest(state: dict) -> str:
    """sha256 of a state's canonical JSON (without its own digest)."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"state.{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write checkpoint `step` under `root` atomically, then prune to the newest `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # save_model stores a tensor shared by several modules (Hyena's one set of Sin
    # frequencies) once; save_file would refuse it.
    save_model(model, str(tmp / WEIGHTS))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    save_file(rng, tmp / "rng.safetensors")
    checksums = {f: _sha256(tmp / f) for f in TENSOR_FILES}
    # Canonical form (as read back) so that the digest checks what a reader sees.
    state = json.loads(
        json.dumps(
            {"step": step, "optimizer": opt_meta, **extra, "checksums": checksums}, default=str
        )
    )
    state["state_sha256"] = _state_digest(state)
    (tmp / STATE).write_text(json.dumps(state))
    mode = 0o666 & ~current_umask()  # safetensors writes 0600 files
    for f in tmp.iterdir():
        os.chmod(f, mode)
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # a checkpoint of this step from a killed attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / POINTER, name + "\n")
    prune_checkpoints(root, keep, step)
    return final


def prune_checkpoints(root: Path, keep: int, newest: int) -> None:
    """Keep checkpoint `newest` and the `keep - 1` before it; drop the older ones and any past
    `newest` (a history the run left when it fell back to an older checkpoint)."""
    complete = list_checkpoints(root)
    older = [path for step, path in complete if step < newest]
    stale = [path for step, path in complete if step > newest]
    for old in [*older[: max(0, len(older) - (keep - 1))], *stale]:
        shutil.rmtree(old, ignore_errors=True)
    remove_temporaries(root)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under `root` (highest step), or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under `root` as (step, folder), oldest first."""
    found = []
    for path in root.glob("step_*"):
        step = _step_of(path)
        if step is not None and (path / STATE).is_file():
            found.append((step, path))
    return sorted(found)


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's state.json, checked against its own digest; CheckpointError names it."""
    file = path / STATE
    try:
        state = json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or "optimizer" not in state:
        raise CheckpointError(f"{file}: lacks an integer 'step' or the 'optimizer' state")
    if "state_sha256" in state and state["state_sha256"] != _state_digest(state):
        raise CheckpointError(f"{file}: its content does not match its checksum (altered)")
    return state


def verify_checkpoint(path: Path, files: tuple[str, ...] = TENSOR_FILES) -> dict[str, Any]:
    """The state of checkpoint `path` once each of `files` matches its recorded checksum;
    raises CheckpointError naming the first that does not (checkpoints without checksums are
    only checked for their files)."""
    state = read_state(path)
    checksums = state.get("checksums")
    for name in files:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if checksums is not None:
            expected = checksums.get(name) if isinstance(checksums, dict) else None
            if expected is None:
                raise CheckpointError(f"{path / STATE}: records no checksum of {name}")
            if _sha256(file) != expected:
                size = file.stat().st_size
                raise CheckpointError(
                    f"{file}: sha256 does not match the one recorded in state.json "
                    f"(truncated or overwritten; {size} bytes)"
                )
    return state


def _read(file: Path, read):
    try:
        return read()
    except Exception as error:  # safetensors raises its own, unnamed errors
        raise CheckpointError(
            f"{file}: cannot be loaded ({type(error).__name__}: {error})"
        ) from None


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore weights (and optimiser and RNG state) from `path`; returns its state.json.

    Raises:
        CheckpointError: naming the file that is missing, damaged or does not fit the model.
    """
    path = Path(path)
    state = verify_checkpoint(path, TENSOR_FILES if optimizer is not None else TENSOR_FILES[:1])
    device = next(model.parameters()).device
    weights = path / WEIGHTS
    _read(weights, lambda: load_model(model, str(weights), strict=True, device=str(device)))
    if optimizer is not None:
        file = path / "optimizer.safetensors"
        tensors = _read(file, lambda: load_file(file))
        _read(
            file,
            lambda: optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"])),
        )
        file = path / "rng.safetensors"
        rng = _read(file, lambda: load_file(file))
        _read(file, lambda: torch.set_rng_state(rng["cpu"]))
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states)
    return state


def weights_sha256(state: dict[str, Any]) -> str | None:
    """The sha256 a checkpoint's state.json records of its weights (None: not recorded)."""
    checksums = state.get("checksums")
    return checksums.get(WEIGHTS) if isinstance(checksums, dict) else None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Weights only (for evaluation)."""
    load_checkpoint(path, model, optimizer=None)


def restore_newest(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    up_to: int | None = None,
) -> tuple[dict[str, Any] | None, list[str]]:
    """Load the newest checkpoint under `root` that is intact (and of step <= `up_to`, when
    given), trying them newest first.

    Each one skipped (a file missing, truncated or altered, state.json broken) is moved aside
    to `.damaged-<name>` (so that it is neither loaded nor counted again) with a warning naming
    it and why. The `latest` pointer is rewritten when it does not name the checkpoint loaded.

    Returns:
        (the loaded checkpoint's state, or None when none could be loaded; the reasons of the
        skipped ones). When one was skipped and none loaded, `model` and `optimizer` may hold
        part of a damaged checkpoint: rebuild them before training from scratch.
    """
    candidates = sorted(
        (step, path)
        for path in root.glob("step_*")
        if path.is_dir() and (step := _step_of(path)) is not None
    )
    candidates = [(s, p) for s, p in candidates if up_to is None or s <= up_to]
    skipped = []
    for _, path in reversed(candidates):
        try:
            state = load_checkpoint(path, model, optimizer)
        except CheckpointError as error:
            aside = root / f"{DAMAGED_PREFIX}{path.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            reason = f"skipped checkpoint {path} ({error}); moved it to {aside}"
            warnings.warn(reason, RuntimeWarning, stacklevel=2)
            skipped.append(reason)
            continue
        pointer = root / POINTER
        try:
            named = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = None
        if named != path.name:
            atomic_write_text(pointer, path.name + "\n")
        return state, skipped
    if skipped:
        (root / POINTER).unlink(missing_ok=True)
    return None, skipped
