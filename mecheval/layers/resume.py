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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Resume:
    """A mixer's context: in, the one to continue from; out, the one it leaves."""

    state: tuple[torch.Tensor | None, ...] | None = None


def context_rows(context: tuple | None, rows: torch.Tensor) -> tuple | None:
    """A context for a selection of its batch rows."""
    if context is None:
        return None
    return tuple(None if t is None else t[rows] for t in context)
