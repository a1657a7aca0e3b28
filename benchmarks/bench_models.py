"""Training-step time of every architecture at the study's shape.

One step = forward, cross-entropy on one answer position per row (the only position the loss
reads; the tied head runs only there, `model(tokens, at=query)`), backward and an AdamW
step; batch 32, L = 37, vocab 8195, 2 layers, d_model 64 and 256. On CPU: the
PyTorch backend in float32. On a GPU: both kernel backends under bf16 autocast, and the Triton
backend under torch.compile (d_model 256 only, to keep compile time inside a GPU check).
Steps per second land in `benchmark.extra_info["steps/s"]`.

Run: pytest benchmarks/bench_models.py --benchmark-only
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

import mecheval_kernels
from benchmarks.common import DEVICE, sync
from mecheval.layers import attention
from mecheval.models import ARCHITECTURES, build_model

BATCH, LENGTH, VOCAB, N_LAYERS = 32, 37, 8195, 2
WIDTHS = (64, 256)
# (kernel backend, torch.compile)
IMPLS = {
    "ours (torch)": ("torch", False),
    "ours (triton)": ("triton", False),
    "ours (triton, compiled)": ("triton", True),
    "ours (triton, SDPA not flash-attn)": ("triton", False),
}
SDPA_ONLY = "ours (triton, SDPA not flash-attn)"


def _skip_reason(impl: str, d_model: int, arch: str) -> str | None:
    backend, compiled = IMPLS[impl]
    if impl == SDPA_ONLY and (arch != "attention" or attention.flash_attn_func() is None):
        return "SDPA vs flash-attn: attention with flash-attn installed only"
    if DEVICE.type != "cuda" and (backend == "triton" or compiled):
        return "Triton kernels and torch.compile are benchmarked on a GPU only"
    if compiled and d_model != max(WIDTHS):
        return "compiled only at the largest width (compile time)"
    return None


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("d_model", WIDTHS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_training_step(benchmark, arch, d_model, impl):
    reason = _skip_reason(impl, d_model, arch)
    if reason:
        pytest.skip(reason)
    backend, compiled = IMPLS[impl]
    torch.manual_seed(0)
    model = build_model(arch, VOCAB, d_model, N_LAYERS, max_len=LENGTH).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    tokens = torch.randint(3, VOCAB, (BATCH, LENGTH), device=DEVICE)
    query = torch.full((BATCH,), LENGTH - 2, device=DEVICE)
    answer = tokens[:, -2].clone()
    forward = model
    if compiled:
        torch._dynamo.reset()  # one compiled model per test: no recompile-limit carry-over
        forward = torch.compile(model, fullgraph=True)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if DEVICE.type == "cuda"
        else contextlib.nullcontext()
    )

    sdpa_only = (
        unittest.mock.patch.object(attention, "uses_flash_attn", lambda q: False)
        if impl == SDPA_ONLY
        else contextlib.nullcontext()
    )

    def step():
        with mecheval_kernels.use_backend(backend), autocast, sdpa_only:
            logits = forward(tokens, at=query)
            loss = F.cross_entropy(logits.float(), answer)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return loss

    step()  # warm-up: compilation and autotuning stay out of the figures
    benchmark.group = f"train step d{d_model}"
    benchmark(step)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        arch=arch,
        d_model=d_model,
        impl=impl,
        backend=backend,
        compiled=compiled,
        batch=BATCH,
        length=LENGTH,
        vocab=VOCAB,
        n_layers=N_LAYERS,
        params=model.num_params(),
        device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        attention_kernel=(
            "flash-attn"
            if arch == "attention"
            and impl != SDPA_ONLY
            and attention.uses_flash_attn(torch.empty(1, device=DEVICE, dtype=torch.bfloat16))
            else "SDPA"
        ),
        dtype="bf16 autocast" if DEVICE.type == "cuda" else "fp32",
    )
    benchmark.extra_info["steps/s"] = round(1 / median, 2)
