"""`train_stacked(configs, run_dirs)`: several runs of one model shape trained as one stacked
model (mecheval.train.stacked), each still a run folder of its own.

Runs stack when they differ only in seed, learning rate, weight decay, schedule or warm-up
(`stack_key`): same task (so the same data in the same order), architecture, sizes, batch
size, step count and cadences. Every run gets the files a single run writes (config.yaml,
checkpoints in the same format, metrics, result.json), so `train`, `evaluate` and reports read
them as usual; a stacked run can even be resumed alone.

Resume: a stack checkpoints every run at the same steps and prunes old checkpoints only once
all of them wrote theirs, so after a kill every run holds the step the stack resumes from (the
newest step every run has); resumed in the same stack, the runs end with bitwise the weights of
an uninterrupted stacked run. A run whose loss stays non-finite fails alone (its error is
returned, no result written); the others go on.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import kernels
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    restore_newest,
    save_checkpoint,
)
from mecheval.tasks import Batch
from mecheval.train.config import TrainConfig, identity, resolve_device, validate_config
from mecheval.train.loop import (
    TrainingDiverged,
    _autocast,
    _kept,
    accuracy,
    cadence,
    fresh_model,
    prepare_folder,
    train_batch,
    write_result,
)
from mecheval.train.schedule import learning_rate
from mecheval.train.stacked import StackedAdamW, StackedModels

# What may differ between the runs of one stack.
PER_RUN = ("seed", "optim.lr", "optim.weight_decay", "optim.schedule", "optim.warmup_fraction")


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
    from mecheval.models import build_model

    task = validate_config(config)
    with torch.device("meta"):
        model = build_model(
            config.model.arch,
            task.vocab_size,
            config.model.d_model,
            config.model.n_layers,
            max_len=task.max_document_length,
            **config.model.options,
        )
    weights = sum(p.numel() for p in model.parameters())
    m = config.model
    tokens = config.batch_size * task.max_document_length
    return 4 * (4 * weights + 64 * tokens * m.d_model * m.n_layers)


@dataclass
class _Member:
    """One run of the stack: its folder, its own model and AdamW (the checkpoint format), its
    records and its divergence guard."""

    config: TrainConfig
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    eval_sets: dict[str, Batch]
    records: list[dict] = field(default_factory=list)
    best: float = 0.0
    elapsed: float = 0.0
    nonfinite: list[int] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / files.CHECKPOINTS

    def lr(self, step: int) -> float:
        o = self.config.optim
        return learning_rate(step, self.config.total_steps, o.lr, o.warmup_fraction, o.schedule)


def train_stacked(
    configs: list[TrainConfig], run_dirs: list[str | Path]
) -> list[dict[str, Any] | BaseException]:
    """Train (or resume, or return the finished results of) the runs as one stack.

    Returns:
        per run, its result (as `train` returns it) or the error that stopped it
        (TrainingDiverged, or a damaged file named by DamagedFileError).

    Raises:
        ConfigError: a config is invalid, a folder holds another config's run, or the runs do
            not stack (their `stack_key`s differ).
    """
    if len(configs) != len(run_dirs) or not configs:
        raise ValueError("train_stacked needs one run folder per config, and at least one")
    run_dirs = [Path(d) for d in run_dirs]
    if len(set(run_dirs)) != len(run_dirs):
        raise ValueError("train_stacked: two runs share a folder")
    keys = {stack_key(c) for c in configs}
    if len(keys) > 1:
        from mecheval.config import ConfigError

        raise ConfigError("these runs do not stack: they differ in more than " + ", ".join(PER_RUN))
    task = None
    for config in configs:
        task = validate_config(config)  # every config, before anything is written
    outcomes: list[Any] = [
        files.finished_result(c, d) for c, d in zip(configs, run_dirs, strict=True)
    ]
    with contextlib.ExitStack() as locks:
        for d, outcome in zip(run_dirs, outcomes, strict=True):
            if outcome is None:
                locks.enter_context(files.training_lock(d))
        todo = []
        for i, (c, d) in enumerate(zip(configs, run_dirs, strict=True)):
            if outcomes[i] is None:
                outcomes[i] = files.finished_result(c, d)  # finished meanwhile by another process
            if outcomes[i] is None:
                prepare_folder(c, d)
                todo.append(i)
        if todo:
            with kernels.use_backend(configs[0].backend):
                done = _run([configs[i] for i in todo], [run_dirs[i] for i in todo], task)
            for i, outcome in zip(todo, done, strict=True):
                outcomes[i] = outcome
    return outcomes


def _members(configs: list[TrainConfig], run_dirs: list[Path], task, device) -> list[_Member]:
    members = []
    for config, run_dir in zip(configs, run_dirs, strict=True):
        torch.manual_seed(config.seed)  # as a single run: its data, then its model
        eval_sets = {
            split: task.dataset(split, size=config.task.eval_size).to(device)
            for split in ("dev", "test")
        }
        model, optimizer = fresh_model(config, task, device)
        members.append(_Member(config, run_dir, model, optimizer, eval_sets))
    return members


def _restore(members: list[_Member], task, device) -> int:
    """Load every run's checkpoint of the newest step all of them hold (0: none); returns it."""
    while True:
        held = [{s for s, _ in list_checkpoints(m.checkpoints)} for m in members]
        common = max(set.intersection(*held) | {0})
        steps = set()
        for m in members:
            state = None
            if common:
                state, _ = restore_newest(m.checkpoints, m.model, m.optimizer, up_to=common)
            if state is None:
                torch.manual_seed(m.config.seed)
                m.model, m.optimizer = fresh_model(m.config, task, device)
            steps.add(state["step"] if state else 0)
            m.best = state.get("best_accuracy", 0.0) if state else 0.0
            m.elapsed = state.get("elapsed_s", 0.0) if state else 0.0
        if steps == {common}:  # else a damaged checkpoint was set aside: look again
            return common


def _run(configs: list[TrainConfig], run_dirs: list[Path], task) -> list[Any]:
    device = resolve_device(configs[0].device)
    torch.manual_seed(configs[0].seed)
    train_data = task.dataset("train", size=configs[0].task.train_size).to(device)
    members = _members(configs, run_dirs, task, device)
    start = _restore(members, task, device)
    elapsed = max(m.elapsed for m in members)
    names = [n for n, _ in members[0].model.named_parameters()]
    stack = StackedModels([m.model for m in members])
    optimizer = StackedAdamW(
        stack.params,
        tuple(configs[0].optim.betas),
        configs[0].optim.eps,
        [c.optim.weight_decay for c in configs],
    )
    for k, m in enumerate(members):
        optimizer.load_state_of(k, names, m.optimizer.state_dict()["state"])
        m.records = files.keep_metrics(m.run_dir, start)
    loop = _Loop(configs[0], members, stack, optimizer, train_data, device, start, elapsed)
    loop.run()
    results: list[Any] = []
    for k, m in enumerate(members):
        if m.error is not None:
            results.append(m.error)
            continue
        stack.write_to(k, m.model)
        wall = loop.elapsed()
        results.append(
            write_result(
                m.config,
                m.run_dir,
                m.model,
                m.eval_sets,
                device,
                m.best,
                wall,
                stack_size=len(members),
            )
        )
    return results


class _Loop:
    """The stack's training loop: the single run's loop (mecheval.train.loop) for M runs."""

    def __init__(self, config, members, stack, optimizer, train_data, device, start, elapsed):
        self.config, self.members, self.stack, self.optimizer = config, members, stack, optimizer
        self.train_data, self.device, self.start = train_data, device, start
        self.started, self.elapsed_before = time.perf_counter(), elapsed
        self.forward = stack
        if config.compile:  # on a GPU: the step's forward and backward as CUDA graphs
            mode = "reduce-overhead" if device.type == "cuda" else None
            self.forward = torch.compile(stack.__call__, mode=mode)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def run(self) -> None:
        config, total = self.config, self.config.total_steps
        size = len(self.members)
        window: list[torch.Tensor] = []
        window_start = time.perf_counter()
        bar = tqdm(
            total=total,
            initial=self.start,
            disable=not config.progress,
            desc=f"stack of {size}",
            unit="step",
        )
        with contextlib.ExitStack() as closing:
            logs = [files.MetricsLog(m.run_dir) for m in self.members]
            for log in logs:
                closing.enter_context(contextlib.closing(log))
            closing.enter_context(contextlib.closing(bar))
            for step in range(self.start, total):
                lrs = [0.0 if m.error else m.lr(step) for m in self.members]
                batch = train_batch(self.train_data, step, config.batch_size)
                losses = self._step(batch, lrs, step)
                window.append(losses.detach())
                done = step + 1
                is_log, is_eval, is_checkpoint = cadence(config, done)
                if is_log or is_eval:
                    now = time.perf_counter()
                    self._record(
                        done,
                        torch.stack(window),
                        lrs,
                        len(window) / (now - window_start),
                        is_eval,
                        logs,
                    )
                    window, window_start = [], now
                bar.update(1)
                if is_checkpoint:
                    self._checkpoint(done)
        for m in self.members:
            if m.error is None and m.nonfinite:
                m.error = TrainingDiverged(
                    f"{m.run_dir}: the loss was non-finite at the last {len(m.nonfinite)} "
                    f"step(s) ({m.nonfinite[0]}..{m.nonfinite[-1]}). "
                    f"{_kept(latest_checkpoint(m.checkpoints))}"
                )

    def _step(self, batch: Batch, lrs: list[float], step: int) -> torch.Tensor:
        """One stacked step, its losses checked by the divergence guard; returns the M losses."""
        return self.train_step(batch, lrs, lambda losses: self._guard(losses, step))

    def train_step(self, batch: Batch, lrs: list[float], check=None) -> torch.Tensor:
        """Forward, the M losses (each its model's mean over the batch), `check(losses)`, one
        backward of their sum and one StackedAdamW update; returns the losses."""
        size = self.stack.size
        with _autocast(self.config, self.device):
            logits = self.forward(batch.tokens, batch.positions["query"])
        losses = (
            F.cross_entropy(
                logits.float().flatten(0, 1), batch.answers.repeat(size), reduction="none"
            )
            .view(size, -1)
            .mean(1)
        )
        if check is not None:
            check(losses)
        self.optimizer.zero_grad()
        losses.sum().backward()
        self.optimizer.step(lrs)
        return losses

    def _guard(self, losses: torch.Tensor, step: int) -> None:
        finite = torch.isfinite(losses).tolist()
        for m, ok in zip(self.members, finite, strict=True):
            if m.error is not None:
                continue
            if ok:
                m.nonfinite.clear()
                continue
            m.nonfinite.append(step + 1)
            if len(m.nonfinite) >= m.config.max_nonfinite_steps:
                m.error = TrainingDiverged(
                    f"{m.run_dir}: the loss was non-finite for {len(m.nonfinite)} consecutive "
                    f"steps ({m.nonfinite[0]}..{m.nonfinite[-1]}; max_nonfinite_steps="
                    f"{m.config.max_nonfinite_steps}). {_kept(latest_checkpoint(m.checkpoints))} "
                    "Try a lower optim.lr."
                )

    def _record(self, done, window, lrs, rate, is_eval, logs) -> None:
        means = window.mean(0).tolist()
        for k, (m, log) in enumerate(zip(self.members, logs, strict=True)):
            if m.error is not None:
                continue
            record: dict[str, Any] = {
                "step": done,
                "loss": means[k],
                "lr": lrs[k],
                "steps_per_s": rate,
            }
            if is_eval:
                self.stack.write_to(k, m.model)
                split = self.config.eval_split
                acc = accuracy(m.model, m.eval_sets[split], m.config, self.device)
                record[f"{split}_accuracy"] = acc
                m.best = max(m.best, acc)
            m.records.append(record)
            log.write(record)

    def _checkpoint(self, done: int) -> None:
        """Every live run's checkpoint of step `done`; old ones pruned once all are written."""
        names = [n for n, _ in self.members[0].model.named_parameters()]
        saved = []
        for k, m in enumerate(self.members):
            if m.error is not None:
                continue
            self.stack.write_to(k, m.model)
            if not all(bool(torch.isfinite(p).all()) for p in m.model.parameters()):
                m.error = TrainingDiverged(
                    f"the weights of {m.run_dir} are non-finite after step {done}; not saved. "
                    f"{_kept(latest_checkpoint(m.checkpoints))}"
                )
                continue
            groups = m.optimizer.state_dict()["param_groups"]
            m.optimizer.load_state_dict(
                {"state": self.optimizer.state_of(k, names), "param_groups": groups}
            )
            extra = {"best_accuracy": m.best, "elapsed_s": self.elapsed()}
            keep = m.config.keep_checkpoints + 1  # the previous one stays until all are saved
            save_checkpoint(m.checkpoints, done, m.model, m.optimizer, extra, keep=keep)
            files.write_metrics_table(m.run_dir, m.records)
            saved.append(m)
        for m in saved:
            prune_checkpoints(m.checkpoints, m.config.keep_checkpoints, done)
