"""Stacked training (mecheval.train.stacked) vs one model at a time: K = 7 models (the study's
seven learning rates) of every architecture at the study's AR shape (batch 32, L = 37, vocab
8195, 2 layers, d_model 64, and 256 on a GPU), one training step each (forward, loss,
backward, AdamW).

"stacked" is one vmapped step of the K stacked models with StackedAdamW; "one at a time" is K
ordinary steps with torch.optim.AdamW. Both groups train the same K models; compare their
times side by side (models x steps per second in `benchmark.extra_info`). On the GPU the stack
also runs K = 1, 8 and 64.

Run: pytest benchmarks/bench_stacked.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mecheval_kernels
from benchmarks.common import DEVICE, sync
from mecheval.models import ARCHITECTURES, build_model
from mecheval.train.stacked import StackedAdamW, StackedModels

BATCH, LENGTH, VOCAB, N_LAYERS = 32, 37, 8195, 2
WIDTHS = (64,) if DEVICE.type != "cuda" else (64, 256)
ARCHS = [a for a in ARCHITECTURES if not a.endswith("_long") and a != "deltanet_noconv"]
SIZES = (7,) if DEVICE.type != "cuda" else (1, 7, 8, 64)
LR = 1e-3


def _models(arch: str, d_model: int, k: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        build_model(arch, VOCAB, d_model, N_LAYERS, max_len=LENGTH).to(DEVICE) for _ in range(k)
    ]


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g).to(DEVICE)
    query = torch.full((BATCH,), LENGTH - 1, device=DEVICE)
    answers = torch.randint(0, VOCAB, (BATCH,), generator=g).to(DEVICE)
    return tokens, query, answers


def _one_at_a_time(models):
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    tokens, query, answers = _batch()

    def step():
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(tokens, at=query), answers).backward()
            optimizer.step()
        sync()

    return step


def _stacked(models):
    stack = StackedModels(models)
    optimizer = StackedAdamW(stack.params, (0.9, 0.999), 1e-8, [0.01] * len(models))
    tokens, query, answers = _batch()
    k = len(models)

    def step():
        optimizer.zero_grad()
        logits = stack(tokens, query)
        losses = F.cross_entropy(logits.flatten(0, 1), answers.repeat(k), reduction="none")
        losses.view(k, -1).mean(1).sum().backward()
        optimizer.step([LR] * k)
        sync()

    return step


@pytest.mark.parametrize("k", SIZES)
@pytest.mark.parametrize("impl", ["ours (stacked)", "one at a time"])
@pytest.mark.parametrize("d_model", WIDTHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_step(benchmark, arch, d_model, impl, k):
    backend = "triton" if DEVICE.type == "cuda" else "torch"
    with mecheval_kernels.use_backend(backend):
        models = _models(arch, d_model, k)
        step = (_stacked if impl == "ours (stacked)" else _one_at_a_time)(models)
        benchmark.group = f"training step of {k} models, {arch} d{d_model}"
        benchmark.pedantic(step, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        arch=arch,
        d_model=d_model,
        impl=impl,
        models=k,
        device=str(DEVICE),
        **{"models x steps/s": k / benchmark.stats.stats.median},
    )
