"""Step times, for estimating a sweep's wall time: a training step of one run
(`measure_step_time`) or of runs trained as one stack (`measure_stacked_step_time`), each
timed on a few freshly sampled batches of its task, with the step the training loop runs
(mecheval.train.steps)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import mecheval_kernels
from mecheval.train.config import TrainConfig, resolve_device, validate_config
from mecheval.train.steps import fresh_model, make_step


def time_steps(
    config: TrainConfig, task, device: torch.device, step: Callable, steps: int, warmup: int
) -> float:
    """Seconds per call of step(batch) on freshly sampled batches of `config`'s task, after
    `warmup` untimed calls (synchronised on CUDA)."""
    data = task.sample(config.batch_size * (steps + warmup), seed=0).to(device)
    started = 0.0
    for i in range(steps + warmup):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        step(data[i * config.batch_size : (i + 1) * config.batch_size].trim())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def _measure(configs: list[TrainConfig], steps: int, warmup: int) -> float:
    """Seconds per training step of the runs of `configs` (one model, or a stack), on their
    device, at their peak learning rates."""
    config = configs[0]
    device = resolve_device(config.device)
    task = validate_config(config)
    with mecheval_kernels.use_backend(config.backend):
        models, optimizers = [], []
        for c in configs:
            torch.manual_seed(c.seed)
            model, optimizer = fresh_model(c, task, device)
            models.append(model)
            optimizers.append(optimizer)
        step = make_step(models, optimizers, configs, device)
        lrs = [c.optim.lr for c in configs]
        return time_steps(config, task, device, lambda batch: step(batch, lrs), steps, warmup)


def measure_step_time(config: TrainConfig, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per training step (forward, backward, AdamW) of `config`'s model on its device,
    timed on a few freshly sampled batches; used to estimate a sweep's wall time."""
    return _measure([config], steps, warmup)


def measure_stacked_step_time(configs: list[TrainConfig], steps: int = 3, warmup: int = 1) -> float:
    """Seconds per step of the runs trained as one stack (all K models, forward, backward,
    StackedAdamW), on their device, timed on a few sampled batches; for sweep estimates."""
    return _measure(configs, steps, warmup)
