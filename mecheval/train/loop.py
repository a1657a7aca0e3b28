"""The training loop: `train(config, run_dir)` for one run, `train_stacked(configs, run_dirs)`
for K runs trained as one stack; the same loop, locking, cadence, logging, checkpoints and
divergence guard for both, only the step differs (mecheval.train.steps).

Each run keeps a run folder of its own (its files: mecheval.run_folder): config.yaml,
checkpoints, metrics and, last, result.json, in the same formats whether it trained alone or
in a stack, so a stacked run can be resumed alone, and evaluated and reported as any other.

- The whole config (device, task, model) is checked before anything is written to a folder,
  so a typo leaves no trace. A folder holding another config's run, finished or not, is
  refused by name; a finished run of the same config is returned without training.
- Rerunning resumes from the newest checkpoint every run of the stack holds (records past it
  are dropped, so none is duplicated; damaged checkpoints are skipped with a warning and set
  aside); on CPU a resumed run ends with bitwise the weights of an uninterrupted one. A stack
  checkpoints every run at the same steps and prunes old checkpoints only once all of them
  wrote theirs, so a kill never leaves the runs without a common step.
- A run whose loss stays NaN or infinite for `max_nonfinite_steps` consecutive steps, or
  whose weights are non-finite when a checkpoint is due, stops with `TrainingDiverged`,
  keeping its last good checkpoint and writing no result; in a stack it fails alone (its
  error is returned) and the others go on.

Runs stack when they differ only in seed, learning rate, weight decay, schedule or warm-up
(`stack_key`): the same task (so the same data in the same order), architecture, sizes, batch
size, step count and cadences.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import mecheval_kernels
from mecheval.config import ConfigError
from mecheval.models.provenance import architecture_code
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    restore_newest,
    save_checkpoint,
)
from mecheval.run_folder.environment import environment
from mecheval.tasks import Batch
from mecheval.train.config import (
    TrainConfig,
    build_model_for,
    identity,
    resolve_device,
    validate_config,
)
from mecheval.train.schedule import learning_rate
from mecheval.train.steps import accuracy, fresh_model, make_step

# What may differ between the runs of one stack.
PER_RUN = ("seed", "optim.lr", "optim.weight_decay", "optim.schedule", "optim.warmup_fraction")


class TrainingDiverged(RuntimeError):
    """The loss stayed NaN or infinite (or the weights became so): the run stopped, keeping its
    last good checkpoint and writing no result."""


def stack_key(config: TrainConfig) -> str:
    """Runs with equal keys can train as one stack."""
    fields = identity(config)
    fields.pop("seed")
    for name in PER_RUN[1:]:
        fields["optim"].pop(name.split(".")[1])
    fields["total_steps"] = config.total_steps
    return json.dumps(fields, sort_keys=True)


def training_bytes(config: TrainConfig) -> int:
    """A rough estimate of one model's training memory in a stack: weights, gradients and two
    AdamW moments (float32), and activations kept for the backward (about 64 floats per
    token, channel and layer)."""
    task = validate_config(config)
    with torch.device("meta"):
        model = build_model_for(config, task)
    weights = sum(p.numel() for p in model.parameters())
    m = config.model
    tokens = config.batch_size * task.max_document_length
    return 4 * (4 * weights + 64 * tokens * m.d_model * m.n_layers)


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
    (outcome,) = _train([config], [Path(run_dir)])
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def train_stacked(
    configs: list[TrainConfig], run_dirs: list[str | Path]
) -> list[dict[str, Any] | BaseException]:
    """Train (or resume, or return the finished results of) the runs as one stack.

    Returns:
        per run, its result (as `train` returns it, with `stack_size`) or the error that
        stopped it (TrainingDiverged).

    Raises:
        ConfigError: a config is invalid, a folder holds another config's run, or the runs do
            not stack (their `stack_key`s differ).
        DamagedFileError: a file of a folder cannot be read (named).
    """
    if len(configs) != len(run_dirs) or not configs:
        raise ValueError("train_stacked needs one run folder per config, and at least one")
    folders = [Path(d) for d in run_dirs]
    if len(set(folders)) != len(folders):
        raise ValueError("train_stacked: two runs share a folder")
    if len({stack_key(c) for c in configs}) > 1:
        raise ConfigError("these runs do not stack: they differ in more than " + ", ".join(PER_RUN))
    return _train(configs, folders)


def _train(configs: list[TrainConfig], folders: list[Path]) -> list[Any]:
    """Every run's result: a finished one's as saved, the others trained together under their
    folders' locks."""
    for config in configs:
        task = validate_config(config)  # every config, before anything is written
    pairs = list(zip(configs, folders, strict=True))
    outcomes: list[Any] = [files.finished_result(config, folder) for config, folder in pairs]
    with contextlib.ExitStack() as locks:
        for folder, outcome in zip(folders, outcomes, strict=True):
            if outcome is None:
                locks.enter_context(files.training_lock(folder))
        todo = []
        for i, (config, folder) in enumerate(pairs):
            if outcomes[i] is None:
                outcomes[i] = files.finished_result(config, folder)  # finished meanwhile
            if outcomes[i] is None:
                files.refuse_other_config(folder, config)
                files.clear_temporaries(folder)
                files.write_run_config(folder, config)
                todo.append(i)
        if todo:
            with mecheval_kernels.use_backend(
                configs[0].backend
            ):  # the process default is restored after
                done = _run([configs[i] for i in todo], [folders[i] for i in todo], task)
            for i, outcome in zip(todo, done, strict=True):
                outcomes[i] = outcome
    return outcomes


@dataclass
class _Run:
    """One run in the loop: its folder, its own model and AdamW (the checkpoint format), its
    evaluation documents, records and divergence guard."""

    config: TrainConfig
    folder: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    eval_sets: dict[str, Batch]
    records: list[dict] = field(default_factory=list)
    best: float = 0.0
    elapsed: float = 0.0
    nonfinite: list[int] = field(default_factory=list)  # the current run of non-finite losses
    error: TrainingDiverged | None = None
    code: dict = field(default_factory=dict)  # its architecture's (mecheval.models.provenance)

    @property
    def checkpoints(self) -> Path:
        return self.folder / files.CHECKPOINTS

    def lr(self, step: int) -> float:
        o = self.config.optim
        return learning_rate(step, self.config.total_steps, o.lr, o.warmup_fraction, o.schedule)

    def _stopped(self, why: str, advice: str = "") -> None:
        last = latest_checkpoint(self.checkpoints)
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was kept"
        message = f"{self.folder}: {why}. Stopped: {kept}; no result written."
        self.error = TrainingDiverged(message + (f" {advice}" if advice else ""))

    def check_loss(self, step: int, finite: bool, loss: torch.Tensor) -> None:
        """The divergence guard, after step `step` (0-based) computed `loss` (finite or not)."""
        if finite:
            self.nonfinite.clear()
            return
        self.nonfinite.append(step + 1)
        limit = self.config.max_nonfinite_steps
        if len(self.nonfinite) >= limit:
            first, last = self.nonfinite[0], self.nonfinite[-1]
            value, n = float(loss.detach()), len(self.nonfinite)
            self._stopped(
                f"the loss was {value} for {n} consecutive steps ({first}..{last}; a non-finite "
                f"loss stops a run after max_nonfinite_steps={limit})",
                "Try a lower optim.lr.",
            )

    def check_weights(self, step: int) -> bool:
        """Whether the weights are finite after `step`; if not, the run stops there."""
        bad = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            names = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
            self._stopped(f"the weights are non-finite after step {step} ({names}); not saved")
        return not bad

    def check_end(self) -> None:
        """A run that ends inside a run of non-finite losses stops without a result."""
        if self.error is None and self.nonfinite:
            first, last, n = self.nonfinite[0], self.nonfinite[-1], len(self.nonfinite)
            self._stopped(f"the loss was non-finite at the last {n} step(s) ({first}..{last})")


def _restored_runs(configs, folders, task, device) -> tuple[list[_Run], int]:
    """Every run with its model and AdamW at the newest step all of them hold, and that step
    (0: none; every model then freshly initialised from its run's seed, as when alone)."""
    eval_sets = [
        {split: task.dataset(split, size=c.task.eval_size).to(device) for split in ("dev", "test")}
        for c in configs
    ]
    while True:
        held = [{s for s, _ in list_checkpoints(f / files.CHECKPOINTS)} for f in folders]
        common = max(set.intersection(*held) | {0})
        runs, steps = [], set()
        for config, folder, documents in zip(configs, folders, eval_sets, strict=True):
            torch.manual_seed(config.seed)
            model, optimizer = fresh_model(config, task, device)
            run = _Run(config, folder, model, optimizer, documents)
            state = None
            if common:
                state, _ = restore_newest(run.checkpoints, model, optimizer, up_to=common)
            if state is not None:
                run.best = state.get("best_accuracy", 0.0)
                run.elapsed = state.get("elapsed_s", 0.0)
            steps.add(state["step"] if state else 0)
            runs.append(run)
        if steps == {common}:
            return runs, common
        # A damaged checkpoint was set aside (its model may be half loaded): look again.


def _run(configs: list[TrainConfig], folders: list[Path], task) -> list[Any]:
    device = resolve_device(configs[0].device)
    if configs[0].threads is not None:  # a stack shares everything but seeds and optimisers
        torch.set_num_threads(configs[0].threads)
    torch.manual_seed(configs[0].seed)
    train_data = task.dataset("train", size=configs[0].task.train_size).to(device)
    runs, start = _restored_runs(configs, folders, task, device)
    for r in runs:
        r.records = files.keep_metrics(r.folder, start)
        r.code = architecture_code(r.model.config)  # the code these steps train with
    step = make_step([r.model for r in runs], [r.optimizer for r in runs], configs, device)
    loop = _Loop(runs, step, train_data, device, start)
    loop.run()
    wall_time = loop.elapsed()
    extra = {"stack_size": len(runs)} if len(runs) > 1 else {}
    outcomes: list[Any] = []
    for k, r in enumerate(runs):
        if r.error is not None:  # recorded as a sweep records it, however it was started
            error = f"{type(r.error).__name__}: {r.error}"
            files.write_error(r.folder, {"status": "failed", "error": error, "traceback": ""})
            outcomes.append(r.error)
            continue
        step.write_to(k, r.model)
        outcomes.append(_write_result(r, device, wall_time, extra))
    return outcomes


def _write_result(r: _Run, device: torch.device, wall_time: float, extra: dict) -> dict:
    """Write (atomically) and return a finished run's result.json."""
    config = r.config
    return files.write_result(
        r.folder,
        config,
        steps=config.total_steps,
        dev_accuracy=accuracy(r.model, r.eval_sets["dev"], config, device),
        test_accuracy=accuracy(r.model, r.eval_sets["test"], config, device),
        best_accuracy=r.best,
        num_params=sum(p.numel() for p in r.model.parameters()),
        wall_time_s=round(wall_time, 3),
        device=str(device),
        precision=config.precision,
        environment=environment(device),
        code=r.code,
        **extra,
    )


def train_batch(train_data: Batch, step: int, batch_size: int) -> Batch:
    """Step `step`'s batch: the next `batch_size` documents of the fixed training set, in
    order, wrapping around (trimmed to its longest document)."""
    documents = train_data.num_documents
    first = (step * batch_size) % documents
    index = torch.arange(first, first + batch_size, device=train_data.tokens.device)
    return train_data.take_documents(index % documents).trim()


def cadence(config: TrainConfig, done: int) -> tuple[bool, bool, bool]:
    """Whether `done` steps call for a log record, an evaluation, a checkpoint (the last step
    evaluates and checkpoints)."""
    last = done == config.total_steps

    def every(n: int) -> bool:
        return bool(n) and done % n == 0

    return (
        every(config.log_every),
        every(config.eval_every) or last,
        every(config.checkpoint_every) or last,
    )


class _Loop:
    """The step loop over the runs (their shared cadence from the first config): a step,
    then by the cadence a record, an evaluation, a checkpoint."""

    def __init__(self, runs: list[_Run], step, train_data: Batch, device, start: int) -> None:
        self.runs, self.step, self.train_data = runs, step, train_data
        self.config, self.device, self.start = runs[0].config, device, start
        self.started = time.perf_counter()
        self.elapsed_before = max(r.elapsed for r in runs)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def run(self) -> None:
        config = self.config
        window: list[torch.Tensor] = []
        window_start = time.perf_counter()
        name = self.runs[0].folder.name if len(self.runs) == 1 else f"stack of {len(self.runs)}"
        bar = tqdm(
            total=config.total_steps,
            initial=self.start,
            disable=not config.progress,
            desc=name,
            unit="step",
        )
        with contextlib.ExitStack() as closing:
            logs = [files.MetricsLog(r.folder) for r in self.runs]
            for log in [*logs, bar]:
                closing.enter_context(contextlib.closing(log))
            for step in range(self.start, config.total_steps):
                lrs = [0.0 if r.error else r.lr(step) for r in self.runs]
                batch = train_batch(self.train_data, step, config.batch_size)
                window.append(self._step(batch, lrs, step).detach())
                done = step + 1
                is_log, is_eval, is_checkpoint = cadence(config, done)
                if is_log or is_eval:
                    now = time.perf_counter()
                    rate = len(window) / (now - window_start)
                    self._record(done, torch.stack(window), lrs, rate, is_eval, logs, bar)
                    window, window_start = [], now
                bar.update(1)
                if is_checkpoint:
                    self._checkpoint(done)
                if all(r.error is not None for r in self.runs):
                    break
        for r in self.runs:
            r.check_end()

    def _step(self, batch: Batch, lrs: list[float], step: int) -> torch.Tensor:
        """One step of every run, its losses seen by the divergence guard; returns them."""
        return self.step(batch, lrs, lambda losses: self._guard(losses, step))

    def _guard(self, losses: torch.Tensor, step: int) -> None:
        finite = torch.isfinite(losses).tolist()
        for k, (r, ok) in enumerate(zip(self.runs, finite, strict=True)):
            if r.error is None:
                r.check_loss(step, ok, losses[k])

    def _record(self, done, window, lrs, rate, is_eval, logs, bar) -> None:
        """Every live run's record of step `done` (and its accuracy, at an evaluation)."""
        means = window.mean(0).tolist()
        for k, (r, log) in enumerate(zip(self.runs, logs, strict=True)):
            if r.error is not None:
                continue
            record: dict[str, Any] = {"step": done, "loss": means[k], "lr": lrs[k]}
            record["steps_per_s"] = rate
            if is_eval:
                self.step.write_to(k, r.model)
                split = r.config.eval_split
                record[f"{split}_accuracy"] = acc = accuracy(
                    r.model, r.eval_sets[split], r.config, self.device
                )
                r.best = max(r.best, acc)
            r.records.append(record)
            log.write(record)
        live = [k for k, r in enumerate(self.runs) if r.error is None]
        if live:
            loss = sum(means[k] for k in live) / len(live)
            best = max(self.runs[k].best for k in live)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{best:.3f}", it_s=f"{rate:.1f}")

    def _checkpoint(self, done: int) -> None:
        """Every live run's checkpoint of step `done`; old ones pruned once all are written."""
        saved = []
        for k, r in enumerate(self.runs):
            if r.error is not None:
                continue
            self.step.write_to(k, r.model, r.optimizer)
            if not r.check_weights(done):
                continue
            extra = {"best_accuracy": r.best, "elapsed_s": self.elapsed()}
            keep = r.config.keep_checkpoints + 1  # the previous one stays until all are saved
            save_checkpoint(r.checkpoints, done, r.model, r.optimizer, extra, keep=keep)
            files.write_metrics_table(r.folder, r.records)
            saved.append(r)
        for r in saved:
            prune_checkpoints(r.checkpoints, r.config.keep_checkpoints, done)
