"""The ops under torch.vmap (stacked models, mecheval_kernels.stacking): the model axis folded
into the channels or heads gives what each model computes alone, outputs and gradients, on both
backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from mecheval_kernels import causal_conv1d_fn, chunk_delta_rule, selective_scan_fn

M, B, D, L, N, W = 3, 2, 8, 11, 4, 4
H, K, V = 2, 4, 4


def _check(fn, batched, shared=(), backend="torch"):
    """vmap of fn over `batched` (model axis first) equals a loop over the models, outputs and
    gradients of every batched input."""
    ins = [t.clone().requires_grad_() for t in batched]
    dims = (0,) * len(ins) + (None,) * len(shared)
    out = vmap(lambda *a: fn(*a, backend=backend), in_dims=dims)(*ins, *shared)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in batched]
    ref = torch.stack([fn(*[t[k] for t in ref_ins], *shared, backend=backend) for k in range(M)])
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(ins, ref_ins, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def _conv(x, w, b=None, backend="torch"):
    return causal_conv1d_fn(x, w, b, activation="silu", backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_short_conv_folds_models_into_channels(backend):
    torch.manual_seed(0)
    x = torch.randn(M, B, L, D).transpose(2, 3)  # (B, L, D) activations, as the models pass
    _check(_conv, [x, torch.randn(M, D, W), torch.randn(M, D)], backend=backend)
    _check(_conv, [x], [torch.randn(D, W)], backend=backend)  # weights shared by the models


@pytest.mark.parametrize("layout", ["B N L", "B G N L", "D N"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_selective_scan_folds_models_into_channels(backend, layout):
    torch.manual_seed(0)
    shape = {"B N L": (M, B, N, L), "B G N L": (M, B, 2, N, L), "D N": (M, D, N)}[layout]
    u, delta, z = (torch.randn(M, B, D, L) for _ in range(3))
    A = -torch.rand(M, D, N)
    Bm, Cm = torch.randn(shape), torch.randn(shape)
    skip, bias = torch.randn(M, D), torch.randn(M, D)

    def scan(u, delta, A, Bm, Cm, skip, z, bias, backend):
        out, last = selective_scan_fn(
            u, delta, A, Bm, Cm, skip, z, bias, True, True, backend=backend
        )
        return out + last.sum()

    _check(scan, [u, delta, A, Bm, Cm, skip, z, bias], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_delta_rule_folds_models_into_heads(backend):
    torch.manual_seed(0)
    T = 9
    q = torch.randn(M, B, T, H, K)
    k = F.normalize(torch.randn(M, B, T, H, K), dim=-1)
    v, beta = torch.randn(M, B, T, H, V), torch.rand(M, B, T, H)
    state = torch.randn(M, B, H, K, V)

    def delta(q, k, v, beta, state, backend):
        o, final = chunk_delta_rule(
            q, k, v, beta, initial_state=state, output_final_state=True, backend=backend
        )
        return o.sum() + final

    _check(delta, [q, k, v, beta, state], backend=backend)
