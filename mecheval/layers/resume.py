"""Running a sequence in segments: the context a resumable mixer carries from one segment to
the next (`Resume`), and helpers to form contexts. What resuming means is part of the mixer
contract (mecheval.layers.mixer); models pass contexts through
`LanguageModel.resume_from(layer, residual, contexts) -> (logits, contexts)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Resume:
    """A mixer's context: in, the one to continue from; out, the one it leaves. `leave` False:
    the caller needs no context back, and a mixer may skip forming the costly parts of it
    (DeltaNet's state), leaving None there."""

    context: tuple[torch.Tensor | None, ...] | None = None
    leave: bool = True


def resumed_from(resume: Resume | None, entries: int) -> tuple:
    """The context a run continues from: `resume.context`, or `entries` None for a sequence that
    starts here (no resume, or one without a state)."""
    if resume is None or resume.context is None:
        return (None,) * entries
    return resume.context


def leave_context(resume: Resume | None, *context: torch.Tensor | None) -> None:
    """Leave `context` in `resume` for the next segment (nothing to do without a resume)."""
    if resume is not None:
        resume.context = context


def context_rows(context: tuple | None, rows: torch.Tensor) -> tuple | None:
    """A context for a selection of its batch rows."""
    if context is None:
        return None
    return tuple(None if t is None else t[rows] for t in context)


def conv_window(values: torch.Tensor, point: int, width: int) -> torch.Tensor:
    """A short convolution's context after positions [0, point) from its inputs at every
    position (B, L, C): the last width - 1 of them, (B, C, width - 1), zeros before position 0
    (the layout `mecheval_kernels.causal_conv1d_fn` leaves as final states)."""
    kept = values[:, max(0, point - width + 1) : point].transpose(1, 2)
    missing = width - 1 - kept.shape[-1]
    if missing:
        kept = torch.cat([kept.new_zeros(*kept.shape[:2], missing), kept], dim=-1)
    return kept.contiguous()


def pick(x: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """x (B, L, C) at one position per row, (B, 1, C); x itself for `at` None."""
    if at is None:
        return x
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, at.to(x.device)][:, None]
