"""`train(config, run_dir)`: one training run, resumable after a kill at any instant.

It writes the run folder's config.yaml, checkpoints, metrics and, last, result.json (their
names and formats: mecheval.run_folder).

Rerunning `train` on the same folder resumes from the newest intact checkpoint (records past it
are dropped, so none is duplicated; damaged checkpoints are skipped with a warning, see
mecheval.run_folder.checkpoints); on CPU a resumed run ends with bitwise the same weights as an
uninterrupted one. Rerunning a finished run returns its result without training, when its saved
config is the one asked for; a folder holding another config, finished or not, is refused by
name. The whole config (device, task, model) is checked before anything is written to the
folder, so a typo leaves no trace. A run whose loss stays NaN or infinite for
`max_nonfinite_steps` consecutive steps stops with `TrainingDiverged`, keeping its last good
checkpoint and writing no result. Every file read from the folder is named in its error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import kernels
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import latest_checkpoint, restore_newest, save_checkpoint
from mecheval.tasks import Batch
from mecheval.train.config import (
    TrainConfig,
    build_model_for,
    resolve_device,
    validate_config,
)
from mecheval.train.schedule import learning_rate


class TrainingDiverged(RuntimeError):
    """The loss stayed NaN or infinite (or the weights became so): the run stopped, keeping its
    last good checkpoint and writing no result."""


def answer_logits(
    model: torch.nn.Module, tokens: torch.Tensor, query: torch.Tensor
) -> torch.Tensor:
    """Logits (B, V) at each row's query position, the only position the loss looks at."""
    return model(tokens, positions=query)


def _autocast(config: TrainConfig, device: torch.device):
    if config.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def accuracy(
    model: torch.nn.Module, data: Batch, config: TrainConfig, device: torch.device
) -> float:
    """Fraction of documents whose answer is the argmax at the query position (in eval mode;
    the model's mode is restored after)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(data), 256):
        part = data[start : start + 256]
        width = int(part.lengths.max())
        with _autocast(config, device):
            logits = answer_logits(model, part.tokens[:, :width], part.positions["query"])
        correct += int((logits.argmax(-1) == part.answers).sum())
    model.train(was_training)
    return correct / len(data)


def train_batch(train_data: Batch, step: int, batch_size: int) -> Batch:
    """Step `step`'s batch: the next `batch_size` documents of the fixed training set, in
    order, wrapping around (trimmed to its longest document)."""
    first = (step * batch_size) % len(train_data)
    index = torch.arange(first, first + batch_size, device=train_data.tokens.device)
    return train_data[index % len(train_data)].trim()


def cadence(config: TrainConfig, done: int) -> tuple[bool, bool, bool]:
    """Whether `done` steps call for a log record, an evaluation, a checkpoint (the last step
    evaluates and checkpoints)."""
    last = done == config.total_steps

    def every(n: int) -> bool:
        return bool(n) and done % n == 0

    return (
        every(config.log_every),
        every(config.eval_every) or last,
        (every(config.checkpoint_every) or last),
    )


def train_step(
    model_fn: Callable,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    config: TrainConfig,
    device: torch.device,
    check: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """One training step: the loss on the answer, its backward and the optimizer's update;
    `check(loss)` runs before the update (it may raise to stop the run there). Returns the loss.
    """
    with _autocast(config, device):
        logits = answer_logits(model_fn, batch.tokens, batch.positions["query"])
    loss = F.cross_entropy(logits.float(), batch.answers)
    if check is not None:
        check(loss)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def train(config: TrainConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train (or resume, or return the finished result of) the run in `run_dir`.

    Returns:
        the final result: config, dev and test accuracy, best tracked accuracy, steps, wall
        time, parameter count, checkpoint path.

    Raises:
        ConfigError: the config is invalid, or the folder holds a run of another config.
        DamagedFileError: a file of the folder cannot be read (named).
        TrainingDiverged: the loss stayed non-finite (see `max_nonfinite_steps`).
    """
    run_dir = Path(run_dir)
    task = validate_config(config)  # before anything is written
    result = files.finished_result(config, run_dir)
    if result is not None:
        return result
    with files.training_lock(run_dir):
        result = files.finished_result(config, run_dir)  # finished by another process meanwhile
        if result is not None:
            return result
        return _train(config, run_dir, task)


def fresh_model(config: TrainConfig, task, device: torch.device):
    """The config's model, freshly initialised, on `device`, and its AdamW."""
    model = build_model_for(config, task).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.optim.lr,
        betas=tuple(config.optim.betas),
        eps=config.optim.eps,
        weight_decay=config.optim.weight_decay,
        fused=device.type == "cuda",
    )
    return model, optimizer


def _check_weights(model: torch.nn.Module, step: int, last_good: Path | None) -> None:
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise TrainingDiverged(
            f"the weights are non-finite after step {step} ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); not saved. {_kept(last_good)}"
        )


def _kept(last_good: Path | None) -> str:
    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was kept"
    return f"Stopped: {where}; no result written."


def prepare_folder(config: TrainConfig, run_dir: Path) -> None:
    """Before training in a folder we hold the lock of: refuse another config's run, clear the
    temporaries a kill left, write config.yaml."""
    files.refuse_other_config(run_dir, config)
    files.clear_temporaries(run_dir)
    files.write_run_config(run_dir, config)


def _train(config: TrainConfig, run_dir: Path, task) -> dict[str, Any]:
    prepare_folder(config, run_dir)
    with kernels.use_backend(config.backend):  # the process default is restored after
        return _run(config, run_dir, task)


def _run(config: TrainConfig, run_dir: Path, task) -> dict[str, Any]:
    checkpoints = run_dir / files.CHECKPOINTS
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    train_data = task.dataset("train", size=config.task.train_size).to(device)
    eval_sets = {
        split: task.dataset(split, size=config.task.eval_size).to(device)
        for split in ("dev", "test")
    }
    init_rng = torch.get_rng_state()
    model, optimizer = fresh_model(config, task, device)

    total = config.total_steps
    start_step, best, elapsed = 0, 0.0, 0.0
    state, skipped = restore_newest(checkpoints, model, optimizer)
    if state is not None:
        start_step = state["step"]
        best, elapsed = state.get("best_accuracy", 0.0), state.get("elapsed_s", 0.0)
    elif skipped:  # a damaged checkpoint may have been half loaded: start afresh
        torch.set_rng_state(init_rng)
        model, optimizer = fresh_model(config, task, device)
    step_fn = torch.compile(model) if config.compile else model
    records = files.keep_metrics(run_dir, start_step)

    def checkpoint(step: int) -> None:
        _check_weights(model, step, latest_checkpoint(checkpoints))
        extra = {"best_accuracy": best, "elapsed_s": elapsed + time.perf_counter() - started}
        save_checkpoint(checkpoints, step, model, optimizer, extra, keep=config.keep_checkpoints)
        files.write_metrics_table(run_dir, records)

    started = time.perf_counter()
    window_loss, window_start = [], time.perf_counter()
    nonfinite: list[int] = []  # the current run of steps with a non-finite loss
    bar = tqdm(
        total=total, initial=start_step, disable=not config.progress, desc=run_dir.name, unit="step"
    )
    log = files.MetricsLog(run_dir)
    with contextlib.closing(log), contextlib.closing(bar):
        for step in range(start_step, total):
            lr = learning_rate(
                step, total, config.optim.lr, config.optim.warmup_fraction, config.optim.schedule
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = train_batch(train_data, step, config.batch_size)

            def check(loss: torch.Tensor, step: int = step) -> None:
                if bool(torch.isfinite(loss)):
                    nonfinite.clear()
                    return
                nonfinite.append(step + 1)
                if len(nonfinite) >= config.max_nonfinite_steps:
                    raise TrainingDiverged(
                        f"{run_dir}: the loss was {float(loss.detach())} for {len(nonfinite)} "
                        f"consecutive steps ({nonfinite[0]}..{nonfinite[-1]}; "
                        f"max_nonfinite_steps={config.max_nonfinite_steps}). "
                        f"{_kept(latest_checkpoint(checkpoints))} Try a lower optim.lr."
                    )

            loss = train_step(step_fn, optimizer, batch, config, device, check)
            window_loss.append(loss.detach())
            done = step + 1
            is_log, is_eval, is_checkpoint = cadence(config, done)
            if is_log or is_eval:
                now = time.perf_counter()
                record: dict[str, Any] = {
                    "step": done,
                    "loss": float(torch.stack(window_loss).mean()),
                    "lr": lr,
                    "steps_per_s": len(window_loss) / (now - window_start),
                }
                window_loss, window_start = [], now
                if is_eval:
                    record[f"{config.eval_split}_accuracy"] = acc = accuracy(
                        model, eval_sets[config.eval_split], config, device
                    )
                    best = max(best, acc)
                records.append(record)
                log.write(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    acc=f"{best:.3f}",
                    it_s=f"{record['steps_per_s']:.1f}",
                )
            bar.update(1)
            if is_checkpoint:
                checkpoint(done)
    if nonfinite:  # the run ended inside a run of non-finite losses
        raise TrainingDiverged(
            f"{run_dir}: the loss was non-finite at the last {len(nonfinite)} step(s) "
            f"({nonfinite[0]}..{nonfinite[-1]}). {_kept(latest_checkpoint(checkpoints))}"
        )

    wall_time = elapsed + time.perf_counter() - started
    return write_result(config, run_dir, model, eval_sets, device, best, wall_time)


def write_result(
    config: TrainConfig,
    run_dir: Path,
    model: torch.nn.Module,
    eval_sets: dict[str, Batch],
    device: torch.device,
    best: float,
    wall_time: float,
    **extra: Any,
) -> dict[str, Any]:
    """Write (atomically) and return a finished run's result.json."""
    return files.write_result(
        run_dir,
        config,
        steps=config.total_steps,
        dev_accuracy=accuracy(model, eval_sets["dev"], config, device),
        test_accuracy=accuracy(model, eval_sets["test"], config, device),
        best_accuracy=best,
        num_params=sum(p.numel() for p in model.parameters()),
        wall_time_s=round(wall_time, 3),
        device=str(device),
        precision=config.precision,
        **extra,
    )
