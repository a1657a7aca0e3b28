"""Step times, for estimating a sweep's wall time: a training step of one run
(`measure_step_time`) or of runs trained as one stack (`measure_stacked_step_time`), each
timed on a few freshly sampled batches of its task."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import kernels
from mecheval.train import loop
from mecheval.train.config import TrainConfig, build_task, resolve_device, validate_config
from mecheval.train.stacked import StackedAdamW, StackedModels
from mecheval.train.stacked_loop import _Loop


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


def measure_step_time(config: TrainConfig, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per training step (forward, backward, AdamW) of `config`'s model on its device,
    timed on a few freshly sampled batches; used to estimate a sweep's wall time."""
    device = resolve_device(config.device)
    task = build_task(config)
    with kernels.use_backend(config.backend):
        model, optimizer = loop.fresh_model(config, task, device)
        step_fn = torch.compile(model) if config.compile else model
        return time_steps(
            config,
            task,
            device,
            lambda batch: loop.train_step(step_fn, optimizer, batch, config, device),
            steps,
            warmup,
        )


def measure_stacked_step_time(configs: list[TrainConfig], steps: int = 3, warmup: int = 1) -> float:
    """Seconds per step of the runs trained as one stack (all M models, forward, backward,
    StackedAdamW), on their device, timed on a few sampled batches; for sweep estimates."""
    config = configs[0]
    device = resolve_device(config.device)
    task = validate_config(config)
    with kernels.use_backend(config.backend):
        models = []
        for c in configs:
            torch.manual_seed(c.seed)
            models.append(loop.fresh_model(c, task, device)[0])
        stack = StackedModels(models)
        optimizer = StackedAdamW(
            stack.params,
            tuple(config.optim.betas),
            config.optim.eps,
            [c.optim.weight_decay for c in configs],
        )
        stacked = _Loop(config, [], stack, optimizer, None, device, 0, 0.0)
        lrs = [c.optim.lr for c in configs]
        return time_steps(
            config, task, device, lambda batch: stacked.train_step(batch, lrs), steps, warmup
        )
