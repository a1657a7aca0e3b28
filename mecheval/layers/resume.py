"""Running a sequence in segments: a mixer's carried context from one segment to the next.

A resumable mixer (class attribute `resumable = True`) has a `resume` attribute, None unless a
caller runs the sequence in segments. Set to a `Resume`, the mixer treats its input as the
positions that follow the segment whose context `Resume.state` holds (None: the sequence starts
here), and when its forward pass returns, `Resume.state` holds the context after its last
position. So two calls on [0, p) and [p, L), the second resuming from the first's context, give
the outputs of one call on [0, L): the interchange grid restarts a patched forward at the
patched position this way, instead of recomputing the unchanged prefix.

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
    state: tuple[torch.Tensor | None, ...] | None = None

    def rows(self, rows: torch.Tensor) -> Resume:
        """The same context for a selection of batch rows."""
        if self.state is None:
            return Resume()
        return Resume(tuple(None if t is None else t[rows] for t in self.state))
