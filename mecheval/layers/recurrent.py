"""RecurrentMixer: what Mamba, Mamba-2, DeltaNet and Gated DeltaNet share. Each projects its
input, runs short causal convolutions over some of the projections, then a recurrent scan whose
state is a `StateSite`; so each resumes from (the convolutions' windows, the state), reads its
output out at one position, and declares the same sites.

A subclass builds its convolutions with `add_convs` (site prefixes: "conv" for Mamba's x,
"q_conv", "k_conv", "v_conv" for DeltaNet's; their names in `convs`), each a `ShortConvolution`
(an `nn.Conv1d`) at attribute `{prefix}1d` with sites `{prefix}_input` and `{prefix}_output`,
fed with a projection of the mixer's input at each position alone; and a `StateSite` at
`state`. It then writes the two ends of the scan, which `forward` runs between reading the
context (`context_in`) and leaving it (`leave`): `scan_inputs`, the projections, the
convolutions (`short_convs`) and the scan's other inputs; and `output`, the mixer's output from
the scan's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, conv_window, leave_context, resumed_from
from mecheval.layers.short_conv import ShortConvolution
from mecheval.layers.sites import StateSite


class RecurrentMixer(Mixer):
    """Base class: short convolutions, then a scan with a state site (see the module
    docstring). Contexts are (the windows of `convs` in order, (B, C, width - 1) each, the
    scan's state)."""

    resumable = True
    reads_out_at = True
    convs: tuple[str, ...] = ()
    state: StateSite

    def add_convs(
        self,
        width_name: str,
        width: int,
        bias: bool,
        channels: Mapping[str, tuple[int, str | None]],
        **factory,
    ) -> None:
        """Short convolutions of width `width` (1..8; `width_name`: the constructor's argument
        that sets it, for the error), one per entry prefix -> (channels, activation) of
        `channels`, in order: each a `ShortConvolution` at `{prefix}1d` (with `factory`'s
        device and dtype), then each one's sites; `convs` names them."""
        if not 1 <= width <= 8:
            raise ValueError(f"{width_name} must be in 1..8, got {width}")
        for prefix, (size, activation) in channels.items():
            conv = ShortConvolution(size, width, bias, activation, **factory)
            self.add_module(f"{prefix}1d", conv)
        for prefix in channels:
            self.add_conv_sites(prefix)
        self.convs = tuple(channels)

    def add_conv_sites(self, prefix: str) -> None:
        self.add_sites(f"{prefix}_input", f"{prefix}_output")

    def conv_width(self, prefix: str) -> int:
        conv: nn.Conv1d = getattr(self, f"{prefix}1d")
        return conv.kernel_size[0]

    @property
    def local_sites(self) -> tuple[str, ...]:
        """The convolutions' inputs: projections of one position."""
        return tuple(f"{prefix}_input" for prefix in self.convs)

    @property
    def conv_sites(self) -> tuple[str, ...]:
        """The convolutions' outputs."""
        return tuple(f"{prefix}_output" for prefix in self.convs)

    @property
    def window_sites(self) -> Mapping[str, int]:
        """Each convolution's output reads its width of inputs."""
        return {f"{prefix}_output": self.conv_width(prefix) for prefix in self.convs}

    @property
    def context_sites(self) -> tuple[str, ...]:
        """The convolutions' inputs and the state."""
        return (*self.local_sites, "state")

    def context_from(self, values: dict, point: int, index: int) -> tuple:
        """(each convolution's last width - 1 inputs before `point`, the state there)."""
        windows = tuple(
            conv_window(values[f"{prefix}_input"], point, self.conv_width(prefix))
            for prefix in self.convs
        )
        return (*windows, values["state"][:, index].contiguous())

    def context_in(self, resume: Resume | None) -> tuple[tuple, torch.Tensor | None]:
        """(the convolutions' windows to continue from, the state to continue from); None
        entries for a sequence that starts here."""
        context = resumed_from(resume, len(self.convs) + 1)
        return context[:-1], context[-1]

    @staticmethod
    def leave(resume: Resume | None, windows: tuple, state: torch.Tensor | None) -> None:
        leave_context(resume, *windows, state)

    def forward(
        self,
        hidden_states: torch.Tensor,
        resume: Resume | None = None,
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: (B, L, d_model) -> (B, L, d_model), or (B, 1, d_model) at positions
        `at` (B,)."""
        batch, length, _ = hidden_states.shape
        windows, state = self.context_in(resume)
        scan_at, windows, aside = self.scan_inputs(hidden_states, windows, state, resume)
        result = self.scan(scan_at, batch, length, at, resume)
        self.leave(resume, windows, result.final_state)
        return self.output(result.out, aside, at)

    def scan_inputs(
        self,
        hidden_states: torch.Tensor,
        windows: tuple,
        state: torch.Tensor | None,
        resume: Resume | None,
    ) -> tuple[Callable[..., mecheval_kernels.ScanAt], tuple, object]:
        """The scan's side of `forward`: (the scan for `scan`, `mecheval_kernels.at_positions` with
        a drop-in scan and its inputs bound, continuing from `state`; the convolutions' windows
        after hidden_states' last position (from `short_convs`, which continues from
        `windows`); whatever `output` needs beside the scan's output)."""
        raise NotImplementedError(f"{type(self).__name__} writes no scan_inputs")

    def output(self, out: torch.Tensor, aside: object, at: torch.Tensor | None) -> torch.Tensor:
        """The mixer's output (B, L or 1, d_model) from the scan's `out` (at every position, or
        at `at` (B,) alone) and `aside` from `scan_inputs`."""
        raise NotImplementedError(f"{type(self).__name__} writes no output")

    def convolve(
        self,
        prefix: str,
        x: torch.Tensor,
        window: torch.Tensor | None,
        resume: Resume | None,
        activation: str | None = "silu",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, L, C) through convolution `prefix` and its sites: (its output (B, L, C), its
        window after x's last position, or None when no context is to be left)."""
        conv: nn.Conv1d = getattr(self, f"{prefix}1d")
        keep = resume is not None and resume.leave
        x = getattr(self, f"{prefix}_input")(x)
        y = mecheval_kernels.causal_conv1d_fn(
            x.transpose(1, 2),
            conv.weight[:, 0, :],
            conv.bias,
            initial_states=window,
            return_final_states=keep,
            activation=activation,
        )
        y, window = y if keep else (y, None)
        return getattr(self, f"{prefix}_output")(y.transpose(1, 2)), window

    def short_convs(
        self,
        xs: tuple[torch.Tensor, ...],
        windows: tuple,
        resume: Resume | None,
        silu: tuple[bool, ...] | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """xs (B, L, C), one per convolution of `convs` in order, each through it and its
        activation (`convolve`) from its window in `windows`: (the outputs, the windows after
        xs' last position). Without convolutions: each x through the SiLU where `silu` (a flag
        per x; None: every one) says, and no windows."""
        if not self.convs:
            flags = (True,) * len(xs) if silu is None else silu
            return tuple(F.silu(x) if on else x for x, on in zip(xs, flags, strict=True)), ()
        outputs = [
            self.convolve(prefix, x, window, resume, getattr(self, f"{prefix}1d").activation)
            for prefix, x, window in zip(self.convs, xs, windows, strict=True)
        ]
        return tuple(y for y, _ in outputs), tuple(window for _, window in outputs)

    def scan(
        self,
        scan_at: Callable[..., mecheval_kernels.ScanAt],
        batch: int,
        length: int,
        at: torch.Tensor | None,
        resume: Resume | None,
    ) -> mecheval_kernels.ScanAt:
        """The scan through the state site: its output at every position, or at `at` (B,)
        alone, and its final state when a context is to be left."""
        final = resume is not None and resume.leave
        return self.state.scan(scan_at, batch, length, at=at, return_final_state=final)
