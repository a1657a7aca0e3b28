"""Running a sequence in segments: a mixer's carried context from one segment to the next.

The contract: a resumable mixer (class attribute `resumable = True`; every mixer of the zoo)
takes `forward(x, resume=None)`. Given a `Resume`, it treats x as the positions that follow
those whose context `Resume.state` holds (None: the sequence starts here), and leaves in
`Resume.state` the context after x's last position. So two calls on [0, p) and [p, L), the
second resuming from the first's context, give the outputs of one call on [0, L). Models pass
contexts through `LanguageModel.resume_from(layer, residual, contexts) -> (logits, contexts)`;
the interchange grid restarts a patched forward at the patched position this way, instead of
recomputing the unchanged prefix. Nothing is set on a mixer from outside.

The context is a tuple of tensors with the batch axis first (or None entries), whatever the
mixer needs: the short convolutions' last inputs and the recurrent state for Mamba and
DeltaNet, the keys and values so far for attention and Based's linear attention, and every past
input of a long convolution (BaseConv, Hyena, H3's two SSMs, run as long convolutions), which
the resumed segment convolves again with its own inputs appended.

A mixer may also read its output out at one position per row alone (class attribute
`reads_out_at = True`): `forward(x, resume=None, at=None)` with `at` (B,) returns (B, 1, C),
the output at those positions, and still leaves the whole context. The last block of a model
asks for it when only the query's logits are wanted (and nobody looks at the mixer's output);
a long convolution then forms one output per row instead of every one. A mixer whose sites
after its sequence mixing are looked at computes every position and picks (`pick`).

A mixer may also say which of its sites hold its context (class attribute or property
`context_sites`, short names): from one run's values of them, every position of each (a
`state` site's: the states after the positions just before the resume points), its
`context_from(values, point, index)` gives the context after positions [0, point) (index: the
point's place among those read), the one a run of [0, point) leaves. The interchange grid then
runs its base once and takes the contexts at its resume points from that run
(`LanguageModel.context_sites`) instead of running it in segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Resume:
    """A mixer's context: in, the one to continue from; out, the one it leaves. `leave` False:
    the caller needs no context back, and a mixer may skip forming the costly parts of it
    (DeltaNet's state), leaving None there."""

    state: tuple[torch.Tensor | None, ...] | None = None
    leave: bool = True


def context_rows(context: tuple | None, rows: torch.Tensor) -> tuple | None:
    """A context for a selection of its batch rows."""
    if context is None:
        return None
    return tuple(None if t is None else t[rows] for t in context)


def conv_window(values: torch.Tensor, point: int, width: int) -> torch.Tensor:
    """A short convolution's context after positions [0, point) from its inputs at every
    position (B, L, C): the last width - 1 of them, (B, C, width - 1), zeros before position 0
    (the layout `kernels.causal_conv1d_fn` leaves as final states)."""
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
