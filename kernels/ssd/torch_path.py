"""The PyTorch path of Mamba-2's scan (mecheval_kernels.ssd.op): the chunked SSD form
(mecheval_kernels.ssd.chunked) forward; the backward takes the vector-Jacobian product of the
recomputed forward (only the inputs are kept), as Mamba-3's core does."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mecheval_kernels.ssd.chunked import Inputs, ssd_chunked

TENSORS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def forward(a: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, L, H, P) in x's dtype, contiguous, the final state (B, H, P, N) in the compute
    dtype, an empty placeholder: nothing is kept for the backward, which recomputes)."""
    out, final = ssd_chunked(a)
    return out.contiguous(), final, out.new_empty(0, dtype=final.dtype)


def backward(a: Inputs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    return backward_by_recompute(lambda b: ssd_chunked(b), a, grads)


def backward_by_recompute(
    forward_fn: Callable[[Inputs], tuple], a: Inputs, grads: tuple
) -> list[torch.Tensor | None]:
    """The gradients of the inputs in TENSORS' order (None for absent ones): `forward_fn`
    (out, final state) recomputed on them and differentiated against `grads` (None or empty:
    zero). By autograd where it records a graph here (an eager backward); inside a custom op's
    backward (under torch.compile or torch.vmap), where it does not, by torch.func.vjp."""
    present = [f for f in TENSORS if getattr(a, f) is not None]
    leaves = [getattr(a, f).detach().requires_grad_() for f in present]
    with torch.enable_grad():
        outputs = forward_fn(a._replace(**dict(zip(present, leaves, strict=True))))
        if outputs[0].grad_fn is not None:
            pairs = [(t, g) for t, g in zip(outputs, grads, strict=True) if _given(g)]
            found = torch.autograd.grad(
                [t for t, _ in pairs], leaves, [g.to(t.dtype) for t, g in pairs],
                allow_unused=True,
            )  # fmt: skip
        else:
            found = _vjp(forward_fn, a, present, grads)
    by_name = dict(zip(present, found, strict=True))
    return [by_name.get(f) for f in TENSORS]


def _given(g: torch.Tensor | None) -> bool:
    return g is not None and g.numel() > 0


def _vjp(forward_fn, a: Inputs, present: list[str], grads: tuple) -> tuple:
    def outputs(*tensors):
        return forward_fn(a._replace(**dict(zip(present, tensors, strict=True))))

    primal, vjp = torch.func.vjp(outputs, *(getattr(a, f) for f in present))
    cotangents = tuple(
        g.to(t.dtype) if _given(g) else torch.zeros_like(t)
        for t, g in zip(primal, grads, strict=True)
    )
    return vjp(cotangents)
