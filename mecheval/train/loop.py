"""`train(config, run_dir)`: one training run, resumable after a kill at any instant.

The run folder holds
    config.yaml            the resolved config
    checkpoints/           safetensors checkpoints (see mecheval.train.checkpoint)
    metrics.jsonl          one JSON record per log or eval step (loss, lr, accuracy, steps/s)
    metrics.parquet        the same records as a table, rewritten at each checkpoint
    result.json            the final result; its presence marks the run finished

Rerunning `train` on the same folder resumes from the newest checkpoint (records past it are
dropped, so none is duplicated); on CPU a resumed run ends with bitwise the same weights as an
uninterrupted one. Rerunning a finished run returns its result without training.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm

import kernels
from mecheval.config import ConfigError, from_dict, to_dict
from mecheval.io import (
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
    exclusive_lock,
)
from mecheval.models import build_model
from mecheval.tasks import Batch, make_task
from mecheval.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mecheval.train.config import TrainConfig, identity
from mecheval.train.schedule import learning_rate

RESULT = "result.json"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
    return device


def build_task(config: TrainConfig):
    return make_task(config.task.name, **config.task.options)


def build_model_for(config: TrainConfig, task) -> torch.nn.Module:
    """The config's model, sized for the task's vocabulary and longest document."""
    return build_model(
        config.model.arch,
        vocab_size=task.vocab_size,
        d_model=config.model.d_model,
        n_layers=config.model.n_layers,
        max_len=task.max_document_length,
        **config.model.options,
    )


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
    """Fraction of documents whose answer is the argmax at the query position."""
    model.eval()
    correct = 0
    for start in range(0, len(data), 256):
        part = data[start : start + 256]
        width = int(part.lengths.max())
        with _autocast(config, device):
            logits = answer_logits(model, part.tokens[:, :width], part.positions["query"])
        correct += int((logits.argmax(-1) == part.answers).sum())
    model.train()
    return correct / len(data)


def _read_metrics(path: Path, up_to_step: int) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if record["step"] <= up_to_step:
            records.append(record)
    return records


def train(config: TrainConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train (or resume, or return the finished result of) the run in `run_dir`.

    Returns:
        the final result: config, dev and test accuracy, best tracked accuracy, steps, wall
        time, parameter count, checkpoint path.
    """
    run_dir = Path(run_dir)
    if (run_dir / RESULT).exists():
        return json.loads((run_dir / RESULT).read_text())
    with exclusive_lock(run_dir / ".lock"):
        return _train(config, run_dir)


def _train(config: TrainConfig, run_dir: Path) -> dict[str, Any]:
    saved = run_dir / "config.yaml"
    if saved.exists():
        previous = from_dict(TrainConfig, yaml.safe_load(saved.read_text()))
        if identity(previous) != identity(config):
            raise ConfigError(
                f"{run_dir} holds a run with a different config; use another folder or delete it"
            )
    atomic_write_text(saved, yaml.safe_dump(to_dict(config), sort_keys=False))

    device = resolve_device(config.device)
    kernels.set_backend(config.backend)
    torch.manual_seed(config.seed)
    task = build_task(config)
    train_data = task.dataset("train", size=config.task.train_size).to(device)
    eval_sets = {
        split: task.dataset(split, size=config.task.eval_size).to(device)
        for split in ("dev", "test")
    }
    model = build_model_for(config, task).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.optim.lr,
        betas=tuple(config.optim.betas),
        eps=config.optim.eps,
        weight_decay=config.optim.weight_decay,
        fused=device.type == "cuda",
    )
    step_fn = torch.compile(model) if config.compile else model

    total = config.total_steps
    checkpoints = run_dir / "checkpoints"
    metrics_path = run_dir / "metrics.jsonl"
    start_step, best, elapsed = 0, 0.0, 0.0
    latest = latest_checkpoint(checkpoints)
    if latest is not None:
        state = load_checkpoint(latest, model, optimizer)
        start_step, best, elapsed = state["step"], state["best_accuracy"], state["elapsed_s"]
    records = _read_metrics(metrics_path, start_step)
    atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def checkpoint(step: int) -> None:
        extra = {"best_accuracy": best, "elapsed_s": elapsed + time.perf_counter() - started}
        save_checkpoint(checkpoints, step, model, optimizer, extra, keep=config.keep_checkpoints)
        atomic_write_parquet(run_dir / "metrics.parquet", pd.DataFrame(records))

    num_docs = len(train_data)
    started = time.perf_counter()
    window_loss, window_start = [], time.perf_counter()
    bar = tqdm(
        total=total, initial=start_step, disable=not config.progress, desc=run_dir.name, unit="step"
    )
    with open(metrics_path, "a") as log:
        for step in range(start_step, total):
            lr = learning_rate(
                step, total, config.optim.lr, config.optim.warmup_fraction, config.optim.schedule
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            first = (step * config.batch_size) % num_docs
            index = torch.arange(first, first + config.batch_size, device=device) % num_docs
            batch = train_data[index].trim()
            with _autocast(config, device):
                logits = answer_logits(step_fn, batch.tokens, batch.positions["query"])
            loss = F.cross_entropy(logits.float(), batch.answers)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            window_loss.append(loss.detach())
            done = step + 1
            is_log = config.log_every and done % config.log_every == 0
            is_eval = (config.eval_every and done % config.eval_every == 0) or done == total
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
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    acc=f"{best:.3f}",
                    it_s=f"{record['steps_per_s']:.1f}",
                )
            bar.update(1)
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == total:
                log.flush()
                checkpoint(done)
    bar.close()

    final_ckpt = latest_checkpoint(checkpoints)
    result = {
        "run": run_dir.name,
        "config": to_dict(config),
        "steps": total,
        "dev_accuracy": accuracy(model, eval_sets["dev"], config, device),
        "test_accuracy": accuracy(model, eval_sets["test"], config, device),
        "best_accuracy": best,
        "num_params": sum(p.numel() for p in model.parameters()),
        "wall_time_s": round(elapsed + time.perf_counter() - started, 3),
        "checkpoint": str(final_ckpt) if final_ckpt else None,
        "device": str(device),
        "precision": config.precision,
    }
    atomic_write_json(run_dir / RESULT, result)
    return result


def load_trained_model(
    run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None
) -> tuple[torch.nn.Module, Any, TrainConfig]:
    """(model with the run's weights, its task, its config) from a run folder: the newest
    checkpoint's weights, or those of `checkpoint` (a checkpoint folder of the run)."""
    from mecheval.train.checkpoint import load_weights

    run_dir = Path(run_dir)
    config = from_dict(TrainConfig, yaml.safe_load((run_dir / "config.yaml").read_text()))
    task = build_task(config)
    model = build_model_for(config, task).to(device)
    chosen = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints")
    if chosen is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint")
    load_weights(chosen, model)
    model.eval()
    return model, task, config


def measure_step_time(config: TrainConfig, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per training step (forward, backward, AdamW) of `config`'s model on its device,
    timed on a few freshly sampled batches; used to estimate a sweep's wall time."""
    device = resolve_device(config.device)
    kernels.set_backend(config.backend)
    task = build_task(config)
    model = build_model_for(config, task).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optim.lr, fused=device.type == "cuda"
    )
    step_fn = torch.compile(model) if config.compile else model
    data = task.sample(config.batch_size * (steps + warmup), seed=0).to(device)
    started = 0.0
    for i in range(steps + warmup):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        batch = data[i * config.batch_size : (i + 1) * config.batch_size].trim()
        with _autocast(config, device):
            logits = answer_logits(step_fn, batch.tokens, batch.positions["query"])
        loss = F.cross_entropy(logits.float(), batch.answers)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps
