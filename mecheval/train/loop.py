"""`train(config, run_dir)`: one training run, resumable after a kill at any instant.

The run folder holds
    config.yaml            the resolved config
    checkpoints/           safetensors checkpoints (see mecheval.train.checkpoint)
    metrics.jsonl          one JSON record per log or eval step (loss, lr, accuracy, steps/s)
    metrics.parquet        the same records as a table, rewritten at each checkpoint
    result.json            the final result; its presence marks the run finished

Rerunning `train` on the same folder resumes from the newest intact checkpoint (records past it
are dropped, so none is duplicated; damaged checkpoints are skipped with a warning, see
mecheval.train.checkpoint); on CPU a resumed run ends with bitwise the same weights as an
uninterrupted one. Rerunning a finished run returns its result without training, when its saved
config is the one asked for; a folder holding another config, finished or not, is refused by
name. The whole config (device, task, model) is checked before anything is written to the
folder, so a typo leaves no trace. A run whose loss stays NaN or infinite for
`max_nonfinite_steps` consecutive steps stops with `TrainingDiverged`, keeping its last good
checkpoint and writing no result. Every file read from the folder is named in its error.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm

import kernels
from mecheval.config import ConfigError, from_dict, to_dict
from mecheval.evaluation.config import LATEST
from mecheval.io import (
    DamagedFileError,
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
    exclusive_lock,
    remove_temporaries,
)
from mecheval.models import build_model
from mecheval.tasks import Batch, make_task
from mecheval.train.checkpoint import (
    TENSOR_FILES,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    restore_newest,
    save_checkpoint,
    verify_checkpoint,
)
from mecheval.train.config import TrainConfig, identity, resolve_device, validate_config
from mecheval.train.schedule import learning_rate

RESULT = "result.json"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
WEIGHTS = TENSOR_FILES[0]  # model.safetensors: all that evaluation loads of a checkpoint
RESULT_KEYS = (
    "config",
    "steps",
    "dev_accuracy",
    "test_accuracy",
    "best_accuracy",
    "wall_time_s",
    "num_params",
    "checkpoint",
)


class TrainingDiverged(RuntimeError):
    """The loss stayed NaN or infinite (or the weights became so): the run stopped, keeping its
    last good checkpoint and writing no result."""


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


def read_metrics(path: Path, up_to_step: int) -> list[dict]:
    """The records of `path` up to `up_to_step`; malformed lines (not UTF-8, not JSON, no
    integer `step`) are skipped with a warning naming the file and line, except a last line cut
    short by a kill, skipped silently."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.splitlines()
    records, bad = [], []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append(f"{number} (not UTF-8)")
            continue
        except json.JSONDecodeError:
            if number == len(lines) and not data.endswith(b"\n"):
                continue  # a line cut short by a kill
            bad.append(f"{number} (not JSON)")
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            bad.append(f"{number} (no integer 'step')")
            continue
        if step <= up_to_step:
            records.append(record)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(f"{path}: skipped malformed line(s) {shown}", RuntimeWarning, stacklevel=3)
    return records


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DamagedFileError(f"{path}: the {what} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise DamagedFileError(f"{path}: the {what} is not valid JSON ({error})") from None


def read_result(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's result.json; DamagedFileError names it when it is unreadable."""
    path = Path(run_dir) / RESULT
    result = _read_json(path, "run's result")
    if not isinstance(result, dict) or any(k not in result for k in RESULT_KEYS):
        missing = [k for k in RESULT_KEYS if not isinstance(result, dict) or k not in result]
        raise DamagedFileError(f"{path}: not a run result (lacks {', '.join(missing)})")
    return result


def read_run_config(run_dir: str | Path) -> TrainConfig:
    """The config a run folder records (config.yaml), every error naming the file."""
    path = Path(run_dir) / CONFIG
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DamagedFileError(f"{path}: the run config is not UTF-8 text") from None
    except yaml.YAMLError as error:
        raise DamagedFileError(f"{path}: the run config is not valid YAML ({error})") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise DamagedFileError(f"{path}: the run config is {what}")
    try:
        return from_dict(TrainConfig, data)
    except ConfigError as error:
        raise DamagedFileError(f"{path}: {error}") from None


def _differences(saved: TrainConfig, asked: TrainConfig) -> str:
    def flat(value: Any, prefix: str = "") -> dict:
        if isinstance(value, dict) and value:
            out = {}
            for k, v in value.items():
                out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
            return out
        return {prefix: value}

    a, b = flat(identity(saved)), flat(identity(asked))
    keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    return "; ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} asked" for k in keys[:5])


def _refuse_other_config(run_dir: Path, saved: TrainConfig, config: TrainConfig, what: str):
    if identity(saved) != identity(config):
        raise ConfigError(
            f"{run_dir} holds {what} with a different config ({_differences(saved, config)}); "
            "use another folder or delete it"
        )


def finished_result(config: TrainConfig, run_dir: Path) -> dict[str, Any] | None:
    """The saved result when the folder holds this config's finished run; None when the run is
    not finished; ConfigError when the folder holds another config's run."""
    if not (run_dir / RESULT).exists():
        return None
    result = read_result(run_dir)
    if (run_dir / CONFIG).exists():
        saved = read_run_config(run_dir)
    else:
        try:
            saved = from_dict(TrainConfig, result["config"])
        except (ConfigError, TypeError) as error:
            raise DamagedFileError(f"{run_dir / RESULT}: its config: {error}") from None
    _refuse_other_config(run_dir, saved, config, "a finished run")
    return result


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
    result = finished_result(config, run_dir)
    if result is not None:
        return result
    with exclusive_lock(run_dir / ".lock"):
        result = finished_result(config, run_dir)  # finished by another process meanwhile
        if result is not None:
            return result
        return _train(config, run_dir, task)


def fresh_model(config: TrainConfig, task, device: torch.device):
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
    saved = run_dir / CONFIG
    if saved.exists():
        _refuse_other_config(run_dir, read_run_config(run_dir), config, "a run")
    for folder in (run_dir, run_dir / "checkpoints"):
        remove_temporaries(folder)
    atomic_write_text(saved, yaml.safe_dump(to_dict(config), sort_keys=False))


def _train(config: TrainConfig, run_dir: Path, task) -> dict[str, Any]:
    prepare_folder(config, run_dir)
    with kernels.use_backend(config.backend):  # the process default is restored after
        return _run(config, run_dir, task)


def _run(config: TrainConfig, run_dir: Path, task) -> dict[str, Any]:
    checkpoints = run_dir / "checkpoints"
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
    metrics_path = run_dir / METRICS
    start_step, best, elapsed = 0, 0.0, 0.0
    state, skipped = restore_newest(checkpoints, model, optimizer)
    if state is not None:
        start_step = state["step"]
        best, elapsed = state.get("best_accuracy", 0.0), state.get("elapsed_s", 0.0)
    elif skipped:  # a damaged checkpoint may have been half loaded: start afresh
        torch.set_rng_state(init_rng)
        model, optimizer = fresh_model(config, task, device)
    step_fn = torch.compile(model) if config.compile else model
    records = read_metrics(metrics_path, start_step)
    atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def checkpoint(step: int) -> None:
        _check_weights(model, step, latest_checkpoint(checkpoints))
        extra = {"best_accuracy": best, "elapsed_s": elapsed + time.perf_counter() - started}
        save_checkpoint(checkpoints, step, model, optimizer, extra, keep=config.keep_checkpoints)
        atomic_write_parquet(run_dir / "metrics.parquet", pd.DataFrame(records))

    started = time.perf_counter()
    window_loss, window_start = [], time.perf_counter()
    nonfinite: list[int] = []  # the current run of steps with a non-finite loss
    bar = tqdm(
        total=total, initial=start_step, disable=not config.progress, desc=run_dir.name, unit="step"
    )
    with open(metrics_path, "a") as log, contextlib.closing(bar):
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
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    acc=f"{best:.3f}",
                    it_s=f"{record['steps_per_s']:.1f}",
                )
            bar.update(1)
            if is_checkpoint:
                log.flush()
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
    """Write (atomically) and return a finished run's result.json. It names the final
    checkpoint by path, step and the sha256 of its weights (what evaluation loads)."""
    final_ckpt = latest_checkpoint(run_dir / "checkpoints")
    state = read_state(final_ckpt) if final_ckpt else {}
    result = {
        "run": run_dir.name,
        "config": to_dict(config),
        "steps": config.total_steps,
        "dev_accuracy": accuracy(model, eval_sets["dev"], config, device),
        "test_accuracy": accuracy(model, eval_sets["test"], config, device),
        "best_accuracy": best,
        "num_params": sum(p.numel() for p in model.parameters()),
        "wall_time_s": round(wall_time, 3),
        "checkpoint": str(final_ckpt) if final_ckpt else None,
        "checkpoint_step": state.get("step"),
        "checkpoint_sha256": state.get("checksums", {}).get(WEIGHTS),
        "device": str(device),
        "precision": config.precision,
        **extra,
    }
    atomic_write_json(run_dir / RESULT, result)
    return result


def _weights_problem(path: Path, sha256: str | None = None) -> str | None:
    """Why checkpoint `path` cannot give a run's weights (missing, damaged, or, when `sha256`
    is given, other weights than those), or None when it can."""
    if not path.is_dir():
        return f"{path}: missing"
    try:
        state = verify_checkpoint(path, (WEIGHTS,))
    except CheckpointError as error:
        return str(error)
    recorded = (state.get("checksums") or {}).get(WEIGHTS)
    if sha256 is not None and recorded != sha256:
        return f"{path / WEIGHTS}: not the weights the run's result names (another sha256)"
    return None


def _kept_steps(root: Path) -> str:
    steps = [step for step, _ in list_checkpoints(root)]
    return f"kept: steps {', '.join(map(str, steps))}" if steps else "no checkpoint is kept"


def _result_step(result: dict[str, Any]) -> int:
    """The step of the checkpoint a result names (results before `checkpoint_step` name it by
    its folder, step_<step>)."""
    if result.get("checkpoint_step") is not None:
        return int(result["checkpoint_step"])
    return int(Path(result["checkpoint"]).name.removeprefix("step_"))


def run_checkpoint(run_dir: str | Path, step: int | str | None = None) -> tuple[Path, int]:
    """(folder, step) of the checkpoint of a run to evaluate, checked: with `step` None, the
    one its result.json names (the weights the result's accuracies are of: its step, and the
    sha256 of its weights); with a step number, that step's; with "latest", the newest intact
    one. Nothing falls back silently: another checkpoint is used only when asked for.

    Raises:
        CheckpointError: the checkpoint is missing or damaged (named, with the steps kept).
        FileNotFoundError: `step` None, and the run has no result.json (it is not finished).
        DamagedFileError: result.json is unreadable.
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    ask = "evaluate another step explicitly with --step N or --step latest"
    if step is None:
        if not (run_dir / RESULT).exists():
            raise FileNotFoundError(f"{run_dir / RESULT}: missing (the run is not finished); {ask}")
        result = read_result(run_dir)
        if result["checkpoint"] is None:
            raise CheckpointError(f"{run_dir / RESULT}: names no checkpoint; {ask}")
        named = _result_step(result)
        path = root / checkpoint_name(named)
        problem = _weights_problem(path, result.get("checkpoint_sha256"))
        if problem:
            raise CheckpointError(
                f"{problem}; it is the checkpoint {run_dir / RESULT} names (step {named}); "
                f"{_kept_steps(root)}; {ask}"
            )
        return path, named
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
    from mecheval.train.checkpoint import load_weights

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    task = build_task(config)
    model = build_model_for(config, task).to(device)
    chosen = Path(checkpoint) if checkpoint else run_checkpoint(run_dir)[0]
    load_weights(chosen, model)
    model.eval()
    return model, task, config
