"""Stacked models: M models of one shape trained as one, with one forward, one backward and one
optimizer update per step.

The M models' weights are stacked along a new leading axis (`StackedModels.params`, leaf tensors);
one forward is `torch.vmap` over `torch.func.functional_call` of the model class, so every layer
runs its ordinary code, and each kernel op folds the model axis into an axis it already has
(mecheval_kernels.stacking). `StackedAdamW` is `torch.optim.AdamW` with a learning rate and a weight
decay per model. Model k of a stack computes what it computes alone, to float rounding (the tests
check weights after 100 steps to 1e-4 relative).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching"


class StackedModels:
    """M models of the same class and shape, stacked.

    Args:
        models: the models (the same architecture and sizes); their current weights are copied.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        if not models:
            raise ValueError("StackedModels needs at least one model")
        shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in models]
        if any(s != shapes[0] for s in shapes[1:]) or len({type(m) for m in models}) > 1:
            raise ValueError("stacked models must share their class and every weight's shape")
        self.size = len(models)
        self.params, self.buffers = stack_module_state(list(models))
        self.template = copy.deepcopy(models[0]).to("meta")
        self.template.train()

    def _one(self, params: dict, buffers: dict, tokens, at):
        return functional_call(
            self.template, (params, buffers), (tokens,), {"at": at}, tie_weights=True
        )

    def __call__(self, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Logits (M, B, V) at one position per row, every model on the same (B, L) tokens."""
        run = vmap(self._one, in_dims=(0, 0, None, None))
        with warnings.catch_warnings():
            # CPU attention (SDPA) has no batching rule: vmap loops over the models there, and
            # says so at every call.
            warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE, category=UserWarning)
            return run(self.params, self.buffers, tokens, at)

    def train(self, mode: bool = True) -> StackedModels:
        self.template.train(mode)
        return self

    @torch.no_grad()
    def write_to(self, k: int, model: nn.Module) -> None:
        """Copy model k's weights into `model` (one of the stacked models' shape)."""
        for name, p in model.named_parameters():
            p.copy_(self.params[name][k])
        for name, b in model.named_buffers():
            if name in self.buffers:
                b.copy_(self.buffers[name][k])


class StackedAdamW:
    """`torch.optim.AdamW` for stacked weights, with a learning rate and a weight decay per
    model; its update equals AdamW's run on each model alone (same operations, per-model scalars
    computed in double precision as AdamW computes them).

    Args:
        params: name -> stacked leaf tensor (M, ...).
        betas, eps: shared by every model.
        weight_decay: one per model.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        betas: tuple[float, float],
        eps: float,
        weight_decay: Sequence[float],
    ) -> None:
        self.params = params
        self.betas, self.eps = (float(betas[0]), float(betas[1])), float(eps)
        self.weight_decay = [float(w) for w in weight_decay]
        self.step_count = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in params.items()}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def _per_model(self, values: list[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=like.dtype, device=like.device).view(
            -1, *([1] * (like.dim() - 1))
        )

    @torch.no_grad()
    def step(self, lrs: Sequence[float]) -> None:
        """One update, model k at learning rate lrs[k]."""
        self.step_count += 1
        beta1, beta2 = self.betas
        correction1 = 1 - beta1**self.step_count
        root2 = math.sqrt(1 - beta2**self.step_count)
        decay = [1 - lr * wd for lr, wd in zip(lrs, self.weight_decay, strict=True)]
        step_size = [-lr / correction1 for lr in lrs]
        for name, p in self.params.items():
            grad = p.grad
            if grad is None:
                continue
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            p.mul_(self._per_model(decay, p))
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / root2).add_(self.eps)
            p.add_(m / denom * self._per_model(step_size, p))

    def state_of(self, k: int, names: Sequence[str]) -> dict:
        """Model k's state in `torch.optim.AdamW.state_dict()` form (parameters numbered in
        `names` order, the model's `parameters()` order)."""
        step = torch.tensor(float(self.step_count))
        return {
            i: {
                "step": step.clone(),
                "exp_avg": self.exp_avg[n][k].clone(),
                "exp_avg_sq": self.exp_avg_sq[n][k].clone(),
            }
            for i, n in enumerate(names)
        }

    @torch.no_grad()
    def load_state_of(self, k: int, names: Sequence[str], state: dict) -> None:
        """Model k's moments and step from a `torch.optim.AdamW.state_dict()["state"]`."""
        steps = set()
        for i, n in enumerate(names):
            entry = state.get(i)
            if entry is None:
                self.exp_avg[n][k].zero_()
                self.exp_avg_sq[n][k].zero_()
                steps.add(0)
                continue
            self.exp_avg[n][k].copy_(entry["exp_avg"])
            self.exp_avg_sq[n][k].copy_(entry["exp_avg_sq"])
            steps.add(int(entry["step"]))
        if len(steps) > 1:
            raise ValueError(f"model {k}'s optimizer state mixes steps {sorted(steps)}")
        self.step_count = steps.pop() if steps else 0
