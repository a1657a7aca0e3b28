"""The inputs every op refuses alike (mecheval_kernels.validation; docs/kernels.md, "Inputs
every op refuses"): an empty batch, in each of the five ops and on both backends, with one
message; a complex A, B or C of the selective scan, by name. And mamba2_scan's default dt_limit,
which clamps as mamba-ssm's kernel does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mecheval_kernels
from mecheval_kernels.ssd import mamba2_scan_ref


def _empty_batch_calls():
    """Each op called with batch 0 (and otherwise well-formed inputs)."""
    rand, pos = torch.randn, torch.rand
    yield (
        "causal_conv1d_fn",
        "x",
        lambda be: mecheval_kernels.causal_conv1d_fn(rand(0, 4, 5), rand(4, 3), backend=be),
    )
    yield (
        "selective_scan_fn",
        "u",
        lambda be: mecheval_kernels.selective_scan_fn(
            rand(0, 4, 5), pos(0, 4, 5), -pos(4, 3), rand(4, 3), rand(4, 3), backend=be
        ),
    )
    qkv = lambda: rand(0, 5, 1, 4)  # noqa: E731
    yield (
        "chunk_delta_rule",
        "q",
        lambda be: mecheval_kernels.chunk_delta_rule(qkv(), qkv(), qkv(), pos(0, 5, 1), backend=be),
    )
    yield (
        "chunk_gated_delta_rule",
        "q",
        lambda be: mecheval_kernels.chunk_gated_delta_rule(
            qkv(), qkv(), qkv(), -pos(0, 5, 1), pos(0, 5, 1), backend=be
        ),
    )
    yield (
        "mamba2_scan",
        "x",
        lambda be: mecheval_kernels.mamba2_scan(
            rand(0, 5, 2, 4), pos(0, 5, 2), -pos(2), rand(0, 5, 1, 3), rand(0, 5, 1, 3), backend=be
        ),
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "op, tensor, call",
    list(_empty_batch_calls()),
    ids=[op for op, _, _ in _empty_batch_calls()],  # stable across xdist's workers
)
def test_every_op_refuses_an_empty_batch_with_one_message(op, tensor, call, backend):
    message = f"{op}: {tensor} must have at least one sequence (batch B >= 1), got B = 0"
    with pytest.raises(ValueError) as caught:
        call(backend)
    assert str(caught.value) == message


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_the_selective_scan_refuses_complex_inputs_by_name(name):
    args = dict(
        u=torch.randn(1, 4, 5),
        delta=torch.rand(1, 4, 5),
        A=-torch.rand(4, 3),
        B=torch.randn(4, 3),
        C=torch.randn(4, 3),
    )
    args[name] = args[name].to(torch.complex64)
    with pytest.raises(TypeError, match=rf"selective_scan_fn: {name} is complex \(complex64\)"):
        mecheval_kernels.selective_scan_fn(**args, backend="torch")


def _mamba2_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 2, 3, generator=g)
    dt = torch.randn(2, 7, 2, generator=g)  # negative steps among them
    A = -torch.rand(2, generator=g)
    B, C = (torch.randn(2, 7, 1, 4, generator=g) for _ in range(2))
    return x, dt, A, B, C


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mamba2_scan_clamps_to_the_default_dt_limit_as_mamba_ssm_does(backend):
    """mamba-ssm's Triton kernel clamps dt + dt_bias (after the optional softplus) to dt_limit
    always, the default (0, inf) included: negative steps become 0."""
    x, dt, A, B, C = _mamba2_inputs()
    bias = torch.full((2,), -0.2)
    assert (dt + bias < 0).any() and (dt + bias > 0).any()
    out = mecheval_kernels.mamba2_scan(x, dt, A, B, C, dt_bias=bias, backend=backend)
    want = mamba2_scan_ref(x, (dt + bias).clamp(min=0), A, B, C)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    unclamped = mamba2_scan_ref(x, dt + bias, A, B, C)
    assert not torch.allclose(out, unclamped, atol=1e-3)  # the clamp matters here
    # With softplus the steps are positive: the default clamp leaves them as they are.
    soft = mecheval_kernels.mamba2_scan(x, dt, A, B, C, dt_softplus=True, backend=backend)
    torch.testing.assert_close(soft, mamba2_scan_ref(x, F.softplus(dt), A, B, C))
    # And at positions too (the scan's selective-scan form).
    at = mecheval_kernels.at_positions(
        mecheval_kernels.mamba2_scan, x, dt, A, B, C, dt_bias=bias, backend=backend,
        out_at=torch.tensor([6, 3]),
    )  # fmt: skip
    torch.testing.assert_close(at.out[:, 0], want[torch.arange(2), torch.tensor([6, 3])])
