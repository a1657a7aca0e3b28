"""The training config: one typed dataclass whose defaults are the study's recipe
(docs/study.md, "Training"): AdamW (0.9, 0.999, eps 1e-8, no weight decay), warm-up from 0
over int(0.1 T) steps then cosine decay to 0 (linear for the generalisation grids), batch 32,
16 epochs over the fixed 100,032-document AR training set, fp32, seed 42.

Load with `load_train_config(path, overrides)`; short aliases (`arch=mamba lr=1e-3`) expand to
their dotted keys (`model.arch`, `optim.lr`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mecheval.config import ConfigError, load_config, to_dict
from mecheval.train.schedule import Schedule

ALIASES = {
    "task": "task.name",
    "arch": "model.arch",
    "d_model": "model.d_model",
    "n_layers": "model.n_layers",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "train_size": "task.train_size",
}


@dataclass
class TaskSection:
    """Which task to train on. `options` go to `make_task(name, **options)`, which checks them."""

    name: str = "ar"
    options: dict = field(default_factory=dict)
    train_size: int = 100_032
    eval_size: int = 320


@dataclass
class ModelSection:
    """Which model. vocab_size and max_len come from the task; `options` go to `build_model`.
    `arch` is a registered name (the zoo's: mecheval.models.ARCHITECTURES), an import path
    (`package.module:Name`) or a hybrid of them by layer (`mamba+attention`)."""

    arch: str = "attention"
    d_model: int = 64
    n_layers: int = 2
    options: dict = field(default_factory=dict)


@dataclass
class OptimSection:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_fraction: float = 0.1
    schedule: Schedule = "cosine"


@dataclass
class TrainConfig:
    """Everything a training run depends on. Fields:

    epochs / steps: run length; `steps` (if set) wins over `epochs` x documents / batch.
    eval_every / checkpoint_every / log_every: cadences in steps (0 = only at the end).
    eval_split: the split whose accuracy is tracked during training ("dev"); the final result
        reports dev and test.
    device: "auto" (CUDA if present), "cpu", "cuda", "cuda:1", ...
    backend: kernel backend, "auto" | "triton" | "torch" (see mecheval_kernels.backend).
    precision: "fp32" (the study's) or "bf16" (autocast, an explicit speed option on GPUs);
        the result records it.
    compile: torch.compile the model.
    threads: PyTorch's CPU threads for the run (None: its default, the machine's cores or
        OMP_NUM_THREADS). On CPU a run's result is a function of its config, the machine's kind
        and this count: with another count, reductions add in another order and the weights
        part after the first step (docs/reproduction.md, "Same config, same result"). The
        result records the count used.
    keep_checkpoints: how many of the most recent checkpoints to keep on disk.
    max_nonfinite_steps: stop with an error (keeping the last good checkpoint, writing no
        result) once the loss has been NaN or infinite for this many consecutive steps.
    progress: show a progress bar.
    The last two change nothing a finished run computes: they are not part of its identity
    (`identity`, hence of its folder name).
    """

    task: TaskSection = field(default_factory=TaskSection)
    model: ModelSection = field(default_factory=ModelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    batch_size: int = 32
    epochs: int = 16
    steps: int | None = None
    eval_every: int = 1000
    eval_split: Literal["dev", "test"] = "dev"
    checkpoint_every: int = 1000
    keep_checkpoints: int = 1
    log_every: int = 50
    seed: int = 42
    device: str = "auto"
    backend: Literal["auto", "triton", "torch"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    compile: bool = False
    threads: int | None = None
    max_nonfinite_steps: int = 3
    progress: bool = True

    def __post_init__(self) -> None:
        positive = {
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "task.train_size": self.task.train_size,
            "task.eval_size": self.task.eval_size,
            "model.d_model": self.model.d_model,
            "model.n_layers": self.model.n_layers,
            "keep_checkpoints": self.keep_checkpoints,
            "max_nonfinite_steps": self.max_nonfinite_steps,
        }
        for name in ("steps", "threads"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        for name in ("eval_every", "checkpoint_every", "log_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.optim.warmup_fraction < 1.0:
            raise ConfigError(
                f"optim.warmup_fraction must be in [0, 1), got {self.optim.warmup_fraction}"
            )
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.optim.lr}")

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * self.task.train_size // self.batch_size

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def load_train_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """A TrainConfig from defaults, an optional YAML file and `key=value` overrides."""
    return load_config(TrainConfig, path, overrides, aliases=ALIASES)


# Fields that do not change what a finished run computes: left out of its identity, so that
# changing them neither renames a run's folder nor refuses to resume it.
NOT_IDENTITY = ("progress", "max_nonfinite_steps")


def identity(config: TrainConfig) -> dict:
    """The config fields that decide what a run computes (display-only fields and the
    divergence guard left out): two configs with equal identities are the same run."""
    fields = to_dict(config)
    for name in NOT_IDENTITY:
        fields.pop(name)
    if fields["threads"] is None:  # unset: the runs named before the field existed keep their names
        fields.pop("threads")
    return fields


# The functions below import torch, the models and the tasks when called: loading and checking
# a config (the command line, sweep files) imports none of them.


def resolve_device(name: str):
    """The torch device a config's `device` names; ConfigError if it is not one, or absent."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(
            f"device {name!r} is not a device: use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigError(f"device {name!r} asked for, but there are {count} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"device {name!r} asked for, but MPS is not available")
    elif device.type != "cpu":
        raise ConfigError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
    return device


def build_task(config: TrainConfig):
    """The config's task (its options checked by `make_task`); a ConfigError names what is
    wrong (an unknown task, an import path that does not import, a bad option)."""
    from mecheval.tasks import make_task

    try:
        return make_task(config.task.name, **config.task.options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"task: {str(error).removeprefix('task ')}") from None


def build_model_for(config: TrainConfig, task):
    """The config's model (an nn.Module), sized for the task's vocabulary and longest
    document."""
    from mecheval.models import build_model

    return build_model(
        config.model.arch,
        vocab_size=task.vocab_size,
        d_model=config.model.d_model,
        n_layers=config.model.n_layers,
        max_len=task.max_document_length,
        **config.model.options,
    )


def validate_config(config: TrainConfig):
    """Check what `train` will need, before it writes anything: the device, the task and its
    options, the architecture and its options; returns the task. Raises ConfigError naming the
    section."""
    from mecheval.models import model_config

    resolve_device(config.device)
    task = build_task(config)
    m = config.model
    try:
        model = model_config(
            m.arch,
            task.vocab_size,
            m.d_model,
            m.n_layers,
            max_len=task.max_document_length,
            **m.options,
        )
    except ConfigError:  # the architecture's own (unknown here, or its code failing)
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model: {error}") from None
    _refuse_broken_mixers(model)
    return task


def _refuse_broken_mixers(model) -> None:
    """ConfigError for a mixer that check_mixer would fail on structure (its output, a site
    forward never reaches): it would train, and then no evaluation could patch it."""
    import torch

    from mecheval.testing import structure_problems

    for layer in range(model.n_layers):
        with torch.random.fork_rng(devices=[]):
            mixer = model.mixer(layer)
        problems = structure_problems(mixer, model.d_model)
        if problems:
            raise ConfigError(
                f"model: layer {layer}'s mixer ({type(mixer).__name__}) breaks the mixer "
                f"contract: {'; '.join(problems)} (mecheval.testing.check_mixer checks it all)"
            )
