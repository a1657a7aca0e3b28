"""Training checkpoints that survive a kill at any instant.

A checkpoint is a folder `checkpoints/step_000123/` holding
    model.safetensors      the model weights
    optimizer.safetensors  every tensor of the optimiser state (AdamW moments, step counts)
    rng.safetensors        the torch RNG states (CPU, and CUDA when used)
    state.json             step, optimiser param-group scalars, and anything else JSON-able
It is written into a temporary folder and renamed into place; `checkpoints/latest` (written
atomically afterwards) names the newest complete one. A kill leaves either the previous
checkpoint or the new one, and stray temporary folders are ignored and cleaned up.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from mecheval.io import atomic_write_text

LATEST = "latest"


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
    name = f"step_{step:09d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # save_model stores a tensor shared by several modules (Hyena's one set of Sin
    # frequencies) once; save_file would refuse it.
    save_model(model, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda{i}"] = s
    save_file(rng, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(
        json.dumps({"step": step, "optimizer": opt_meta, **extra}, default=str)
    )
    for f in tmp.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # a checkpoint of this step from an earlier, killed attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, name + "\n")
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stray in root.glob(".tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under `root`, or None."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under `root` as (step, folder), oldest first."""
    found = []
    for path in root.glob("step_*"):
        if (path / "state.json").exists():
            found.append((int(path.name.removeprefix("step_")), path))
    return sorted(found)


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore weights (and optimiser and RNG state) from `path`; returns its state.json."""
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    state = json.loads((path / "state.json").read_text())
    if optimizer is not None:
        tensors = load_file(path / "optimizer.safetensors")
        optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
        rng = load_file(path / "rng.safetensors")
        torch.set_rng_state(rng["cpu"])
        cuda_states = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states)
    return state


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Weights only (for evaluation)."""
    load_checkpoint(path, model, optimizer=None)
