"""Which checkpoint of a run evaluation loads, checked, and the model with those weights.

    run_checkpoint(run_dir, step)      (checkpoint folder, step): None, the one result.json
                                       names; a step number; or "latest", the newest intact one
    load_trained_model(run_dir, ...)   (model, task, config) with that checkpoint's weights

Nothing falls back silently: another checkpoint than the one asked for is never used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mecheval.run_folder import LATEST
from mecheval.run_folder.checkpoints import (
    WEIGHTS,
    CheckpointError,
    checkpoint_name,
    list_checkpoints,
    load_weights,
    verify_checkpoint,
    weights_sha256,
)
from mecheval.run_folder.files import CHECKPOINTS, RESULT, read_result, read_run_config
from mecheval.train.config import TrainConfig, build_model_for, build_task


def _weights_problem(path: Path, sha256: str | None = None) -> str | None:
    """Why checkpoint `path` cannot give a run's weights (missing, damaged, or, when `sha256`
    is given, other weights than those), or None when it can."""
    if not path.is_dir():
        return f"{path}: missing"
    try:
        state = verify_checkpoint(path, (WEIGHTS,))
    except CheckpointError as error:
        return str(error)
    if sha256 is not None and weights_sha256(state) != sha256:
        return f"{path / WEIGHTS}: not the weights the run's result names (another sha256)"
    return None


def _kept_steps(root: Path) -> str:
    steps = [step for step, _ in list_checkpoints(root)]
    return f"kept: steps {', '.join(map(str, steps))}" if steps else "no checkpoint is kept"


def _result_step(result: dict[str, Any]) -> int:
    """The step of the checkpoint a result names (results without `checkpoint_step` name it
    by its folder, step_<step>)."""
    if result.get("checkpoint_step") is not None:
        return int(result["checkpoint_step"])
    return int(Path(result["checkpoint"]).name.removeprefix("step_"))


def _result_checkpoint(run_dir: Path, ask: str) -> tuple[Path, int]:
    """The checkpoint result.json names, checked against its step and weights' sha256."""
    if not (run_dir / RESULT).exists():
        raise FileNotFoundError(f"{run_dir / RESULT}: missing (the run is not finished); {ask}")
    result = read_result(run_dir)
    if result["checkpoint"] is None:
        raise CheckpointError(f"{run_dir / RESULT}: names no checkpoint; {ask}")
    named = _result_step(result)
    root = run_dir / CHECKPOINTS
    path = root / checkpoint_name(named)
    problem = _weights_problem(path, result.get("checkpoint_sha256"))
    if problem:
        raise CheckpointError(
            f"{problem}; it is the checkpoint {run_dir / RESULT} names (step {named}); "
            f"{_kept_steps(root)}; {ask}"
        )
    return path, named


def run_checkpoint(run_dir: str | Path, step: int | str | None = None) -> tuple[Path, int]:
    """(folder, step) of the checkpoint of a run to evaluate, checked: with `step` None, the
    one its result.json names (the weights the result's accuracies are of: its step, and the
    sha256 of its weights); with a step number, that step's; with "latest", the newest intact
    one.

    Raises:
        CheckpointError: the checkpoint is missing or damaged (named, with the steps kept).
        FileNotFoundError: `step` None, and the run has no result.json (it is not finished).
        DamagedFileError: result.json is unreadable.
    """
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    if step is None:
        ask = "evaluate another step explicitly with --step N or --step latest"
        return _result_checkpoint(run_dir, ask)
    if step == LATEST:
        problems = []
        for kept, path in reversed(list_checkpoints(root)):
            problem = _weights_problem(path)
            if problem is None:
                return path, kept
            problems.append(problem)
        raise CheckpointError(f"{root}: no intact checkpoint ({'; '.join(problems) or 'none'})")
    path = root / checkpoint_name(step)
    problem = _weights_problem(path)
    if problem:
        raise CheckpointError(f"{problem}; step {step} was asked for; {_kept_steps(root)}")
    return path, step


def load_trained_model(
    run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None
) -> tuple[torch.nn.Module, Any, TrainConfig]:
    """(model with the run's weights, its task, its config) from a run folder: the weights of
    the checkpoint its result.json names (`run_checkpoint`), or those of `checkpoint` (a
    checkpoint folder of the run)."""
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    task = build_task(config)
    model = build_model_for(config, task).to(device)
    chosen = Path(checkpoint) if checkpoint else run_checkpoint(run_dir)[0]
    load_weights(chosen, model)
    model.eval()
    return model, task, config
