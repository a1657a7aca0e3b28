"""The training step, from a batch to updated weights: one model's (`ModelStep`, torch's AdamW)
or K stacked models' (`StackedStep`: one forward, one backward and one StackedAdamW update for
all K, mecheval.train.stacked). `make_step` picks the one for the runs at hand; the training
loop (mecheval.train.loop) and the step timings (mecheval.train.timing) run either alike.

The loss is the cross-entropy of each answer at its query position (the study's masking), or,
for a task that trains on more (`Batch.targets`), of every target token; in float32 even under
bf16 autocast. A step calls `check(losses)` after the forward and before
any update, so that a divergence guard sees every loss first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mecheval.tasks import IGNORE, Batch
from mecheval.train.config import TrainConfig, build_model_for
from mecheval.train.stacked import StackedAdamW, StackedModels

Check = Callable[[torch.Tensor], None]


def answer_logits(model: Callable, batch: Batch) -> torch.Tensor:
    """Logits (..., n, V) at each row's query position; `model(tokens, at)` runs the
    documents once each (its leading axes, a stack's models, are kept)."""
    query = batch.positions["query"]
    if batch.document is None:
        return model(batch.tokens, query)
    document, slot, first = _answer_slots(batch)
    grid = query.new_zeros(len(first), int(slot.max()) + 1)
    grid[document, slot] = query
    return model(batch.tokens[first], grid)[..., document, slot, :]


def _answer_slots(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's document among the batch's, its place among that document's rows, the first
    row of each document)."""
    starts = batch.document_starts
    first, count = starts[:-1], starts[1:] - starts[:-1]
    document = torch.repeat_interleave(torch.arange(len(first), device=batch.device), count)
    slot = torch.arange(len(batch), device=batch.device) - first[document]
    return document, slot, first


def loss_logits(model: Callable, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (..., m, V), targets (m,)): what the loss compares, each answer at its query,
    or every target token of the documents where the task gives `targets`."""
    if batch.targets is None:
        return answer_logits(model, batch), batch.answers
    first = _answer_slots(batch)[2]
    targets = batch.targets[first]
    trained = targets != IGNORE
    return model(batch.tokens[first], None)[..., trained, :], targets[trained]


def autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast when the config asks for it, else nothing."""
    if config.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fresh_model(
    config: TrainConfig, task, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The config's model, freshly initialised (from the current RNG state), on `device`, and
    its AdamW."""
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


@torch.no_grad()
def accuracy(
    model: torch.nn.Module, data: Batch, config: TrainConfig, device: torch.device
) -> float:
    """Fraction of answers (rows) whose answer is the argmax at the query position (in eval mode;
    the model's mode is restored after)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(data), 256):
        part = data[start : start + 256]
        with autocast(config, device):
            logits = answer_logits(model, part.trim())
        correct += int((logits.argmax(-1) == part.answers).sum())
    model.train(was_training)
    return correct / len(data)


class ModelStep:
    """One model's step: its forward (compiled with `config.compile`), the loss, `check`, the
    backward and its own AdamW at the learning rate given.

    Args:
        model, optimizer: the run's model and AdamW (trained in place).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        device: torch.device,
    ) -> None:
        self.optimizer, self.config, self.device = optimizer, config, device
        self.forward = torch.compile(model) if config.compile else model

    def __call__(self, batch: Batch, lrs: Sequence[float], check: Check | None = None):
        """The loss as a (1,) tensor, after the update at learning rate lrs[0]."""
        for group in self.optimizer.param_groups:
            group["lr"] = lrs[0]
        with autocast(self.config, self.device):
            logits, targets = loss_logits(self.forward, batch)
        loss = F.cross_entropy(logits.float(), targets)
        losses = loss.reshape(1)
        if check is not None:
            check(losses)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return losses

    def write_to(
        self, k: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Nothing to copy: the run's model and AdamW are the ones trained."""


class StackedStep:
    """K models' step as one: one forward of the stack (compiled with `config.compile`, on a
    GPU as CUDA graphs), the K losses (each its model's mean over the batch), `check`, one
    backward of their sum and one StackedAdamW update, model k at learning rate lrs[k].

    Args:
        models, optimizers: the runs' models and AdamWs, whose weights and moments the stack
            starts from (`write_to` copies them back).
        configs: the runs' configs (betas and eps shared, a weight decay each).
    """

    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        configs: Sequence[TrainConfig],
        device: torch.device,
    ) -> None:
        config = configs[0]
        self.config, self.device = config, device
        self.names = [name for name, _ in models[0].named_parameters()]
        self.stack = StackedModels(models)
        self.optimizer = StackedAdamW(
            self.stack.params,
            tuple(config.optim.betas),
            config.optim.eps,
            [c.optim.weight_decay for c in configs],
        )
        for k, optimizer in enumerate(optimizers):
            self.optimizer.load_state_of(k, self.names, optimizer.state_dict()["state"])
        self.forward = self.stack
        if config.compile:
            mode = "reduce-overhead" if device.type == "cuda" else None
            self.forward = torch.compile(self.stack.__call__, mode=mode)

    def __call__(self, batch: Batch, lrs: Sequence[float], check: Check | None = None):
        """The K losses, (K,), after the update."""
        size = self.stack.size
        with autocast(self.config, self.device):
            logits, targets = loss_logits(self.forward, batch)
        losses = (
            F.cross_entropy(logits.float().flatten(0, 1), targets.repeat(size), reduction="none")
            .view(size, -1)
            .mean(1)
        )
        if check is not None:
            check(losses)
        self.optimizer.zero_grad()
        losses.sum().backward()
        self.optimizer.step(lrs)
        return losses

    def write_to(
        self, k: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Copy model k's weights into `model` and, when given, its moments and step into
        `optimizer` (a torch AdamW of that model: the checkpoint format)."""
        self.stack.write_to(k, model)
        if optimizer is not None:
            groups = optimizer.state_dict()["param_groups"]
            optimizer.load_state_dict(
                {"state": self.optimizer.state_of(k, self.names), "param_groups": groups}
            )


def make_step(
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    configs: Sequence[TrainConfig],
    device: torch.device,
) -> ModelStep | StackedStep:
    """The step for these runs: one model's own, or the stack's for several."""
    if len(models) == 1:
        return ModelStep(models[0], optimizers[0], configs[0], device)
    return StackedStep(models, optimizers, configs, device)
