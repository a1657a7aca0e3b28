"""Each drop-in takes exactly its peer's parameters, in the peer's order, plus `backend`
(keyword-only) and, for the selective scan, `initial_state` (ours) at the end; it returns what
the peer returns; the peer arguments it does not implement (packed sequences) are refused by
name, never ignored.

The peers' parameter lists, from their sources: causal-conv1d 1.5
(causal_conv1d_interface.py), mamba-ssm 2.2 (selective_scan_interface.py, ssd_combined.py),
flash-linear-attention 0.3 (ops/delta_rule/chunk.py, ops/gated_delta_rule/chunk.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

import mecheval_kernels

PEERS = {
    "causal_conv1d_fn": (
        "x",
        "weight",
        "bias",
        "seq_idx",
        "initial_states",
        "return_final_states",
        "final_states_out",
        "activation",
    ),
    "selective_scan_fn": (
        "u",
        "delta",
        "A",
        "B",
        "C",
        "D",
        "z",
        "delta_bias",
        "delta_softplus",
        "return_last_state",
    ),
    "chunk_delta_rule": (
        "q",
        "k",
        "v",
        "beta",
        "scale",
        "initial_state",
        "output_final_state",
        "use_qk_l2norm_in_kernel",
        "cu_seqlens",
        "head_first",
    ),
    "chunk_gated_delta_rule": (
        "q",
        "k",
        "v",
        "g",
        "beta",
        "scale",
        "initial_state",
        "output_final_state",
        "use_qk_l2norm_in_kernel",
        "cu_seqlens",
        "head_first",
    ),
    "mamba2_scan": (
        "x",
        "dt",
        "A",
        "B",
        "C",
        "chunk_size",
        "D",
        "z",
        "dt_bias",
        "initial_states",
        "seq_idx",
        "cu_seqlens",
        "dt_softplus",
        "dt_limit",
        "return_final_states",
        "return_varlen_states",
    ),
}
OURS = {"selective_scan_fn": ("initial_state",)}


@pytest.mark.parametrize("name", list(PEERS))
def test_parameters_are_the_peers(name):
    parameters = inspect.signature(getattr(mecheval_kernels, name)).parameters.values()
    kinds = inspect.Parameter
    positional = [p.name for p in parameters if p.kind is kinds.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in parameters if p.kind is kinds.KEYWORD_ONLY]
    assert tuple(positional) == PEERS[name] + OURS.get(name, ())
    assert keyword_only == ["backend"]


def _conv():
    return torch.randn(2, 4, 7), torch.randn(4, 3)


def _scan():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, 7, generator=g),
        torch.randn(2, 4, 7, generator=g),
        -torch.rand(4, 3, generator=g),
        torch.randn(2, 3, 7, generator=g),
        torch.randn(2, 3, 7, generator=g),
    )


def _delta(gated: bool):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 7, 1, 4, generator=g) for _ in range(3))
    beta = torch.rand(2, 7, 1, generator=g)
    return (q, k, v, -torch.rand(2, 7, 1, generator=g), beta) if gated else (q, k, v, beta)


def _mamba2():
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(2, 7, 2, 3, generator=g),
        torch.randn(2, 7, 2, generator=g),
        -torch.rand(2, generator=g),
        torch.randn(2, 7, 1, 4, generator=g),
        torch.randn(2, 7, 1, 4, generator=g),
    )


def test_returns_are_the_peers():
    x, weight = _conv()
    assert isinstance(mecheval_kernels.causal_conv1d_fn(x, weight), torch.Tensor)
    y, final = mecheval_kernels.causal_conv1d_fn(x, weight, return_final_states=True)
    assert final.shape == (2, 4, 2)
    assert isinstance(mecheval_kernels.selective_scan_fn(*_scan()), torch.Tensor)
    out, last = mecheval_kernels.selective_scan_fn(*_scan(), return_last_state=True)
    assert last.shape == (2, 4, 3)
    o, final = mecheval_kernels.chunk_delta_rule(*_delta(False))
    assert o.shape == (2, 7, 1, 4) and final is None
    o, final = mecheval_kernels.chunk_gated_delta_rule(*_delta(True), output_final_state=True)
    assert final.shape == (2, 1, 4, 4)
    assert isinstance(mecheval_kernels.mamba2_scan(*_mamba2(), 4), torch.Tensor)
    out, final = mecheval_kernels.mamba2_scan(*_mamba2(), 4, return_final_states=True)
    assert final.shape == (2, 2, 3, 4)


def test_final_states_out_is_written_and_returned():
    x, weight = _conv()
    into = torch.full((2, 4, 2), float("nan"))
    _, final = mecheval_kernels.causal_conv1d_fn(
        x, weight, return_final_states=True, final_states_out=into
    )
    assert final is into
    torch.testing.assert_close(into, x[:, :, -2:])
    with pytest.raises(ValueError, match=r"final_states_out must be a tensor of shape \(2, 4, 2\)"):
        mecheval_kernels.causal_conv1d_fn(
            x, weight, return_final_states=True, final_states_out=torch.zeros(2, 4, 3)
        )


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: mecheval_kernels.causal_conv1d_fn(*_conv(), seq_idx=torch.zeros(2, 7)), "seq_idx"),
        (
            lambda: mecheval_kernels.chunk_delta_rule(
                *_delta(False), cu_seqlens=torch.tensor([0, 7])
            ),
            "cu_seqlens",
        ),
        (lambda: mecheval_kernels.chunk_delta_rule(*_delta(False), head_first=True), "head_first"),
        (
            lambda: mecheval_kernels.chunk_gated_delta_rule(
                *_delta(True), cu_seqlens=torch.tensor([0, 7])
            ),
            "cu_seqlens",
        ),
        (
            lambda: mecheval_kernels.chunk_gated_delta_rule(*_delta(True), head_first=True),
            "head_first",
        ),
        (lambda: mecheval_kernels.mamba2_scan(*_mamba2(), seq_idx=torch.zeros(2, 7)), "seq_idx"),
    ],
)
def test_unsupported_peer_arguments_are_refused_by_name(call, argument):
    with pytest.raises(ValueError, match=f"{argument}=.* is not supported"):
        call()
