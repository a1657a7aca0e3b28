"""Sites: named points in a forward pass where an activation can be read or replaced.

A layer marks such a point by routing the tensor through a `Site` submodule (for (B, L, C)
activations) or by running its scan through a `StateSite` (for the recurrent state of a scan).
Idle sites cost one attribute test: no hooks, no copies. A site becomes active when something
gives it a `SitePlan` (`mecheval.models` does so inside `model.intervene(...)`), which says what
to read and what to patch, for one position per batch row.

Semantics, the same for every site:
- a patch replaces the activation at (row, positions[row]) with values[row] and the forward
  continues from the patched tensor;
- a read records the activation at (row, positions[row]) AFTER any patch at the same site, so a
  read of a patched site returns the patched values; positions None reads the whole tensor.

Because `Site` is an `nn.Module` called on every forward, standard forward hooks on it (and tools
built on them) see, and may replace, the activation too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SitePlan:
    """What one site does during one intervention.

    Attributes:
        name: the site's full name, the key under which reads are recorded.
        record: dict that reads are written into (shared by all sites of one intervention).
        read: whether to read; `read_positions` (B,) or None for the full tensor.
        patch_positions: (B,) positions to patch, or None; `patch_values` (B, C) (or, for a
            state site, (B, *state_shape)).
    """

    name: str
    record: dict[str, torch.Tensor]
    read: bool = False
    read_positions: torch.Tensor | None = None
    patch_positions: torch.Tensor | None = None
    patch_values: torch.Tensor | None = None
    _rows: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    # (what, length) pairs already range-checked: positions do not change within a plan, and
    # each check costs a device sync.
    _checked: set[tuple[str, int]] = field(default_factory=set, repr=False)

    @property
    def patching(self) -> bool:
        return self.patch_values is not None

    def rows(self, batch: int, device: torch.device) -> torch.Tensor:
        rows = self._rows.get(device)
        if rows is None or rows.numel() != batch:
            rows = torch.arange(batch, device=device)
            self._rows[device] = rows
        return rows

    def check_batch(self, positions: torch.Tensor, batch: int, what: str) -> None:
        if positions.shape[0] != batch:
            raise ValueError(
                f"site {self.name}: {what} positions have batch size {positions.shape[0]}, "
                f"but the activation has batch size {batch}"
            )

    def check_in_range(self, positions: torch.Tensor, length: int, what: str) -> None:
        if (what, length) in self._checked:
            return
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= length:
            raise ValueError(
                f"site {self.name}: {what} positions must lie in [0, {length - 1}], "
                f"got values in [{lo}, {hi}]"
            )
        self._checked.add((what, length))


class Site(nn.Module):
    """Identity on a (B, L, C) activation, unless an intervention gives it a plan.

    Args:
        name: the site's short name within its block, e.g. "mixer_output" or "conv_input".
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.plan: SitePlan | None = None

    def extra_repr(self) -> str:
        return repr(self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, C). Returns x, or x patched as the active plan says."""
        plan = self.plan
        if plan is None:
            return x
        return _apply(plan, x)


def _apply(plan: SitePlan, x: torch.Tensor) -> torch.Tensor:
    batch, length = x.shape[0], x.shape[1]
    if plan.patching:
        values = plan.patch_values
        if plan.patch_positions is None:
            if values.shape != x.shape:
                raise ValueError(
                    f"site {plan.name}: full-tensor patch values must have shape "
                    f"{tuple(x.shape)}, got {tuple(values.shape)}"
                )
            x = values.to(device=x.device, dtype=x.dtype)
        else:
            positions = plan.patch_positions.to(x.device)
            plan.check_batch(positions, batch, "patch")
            plan.check_in_range(positions, length, "patch")
            expected = (batch, *x.shape[2:])
            if tuple(values.shape) != expected:
                raise ValueError(
                    f"site {plan.name}: patch values must have shape {expected}, "
                    f"got {tuple(values.shape)}"
                )
            rows = plan.rows(batch, x.device)
            x = x.index_put((rows, positions), values.to(device=x.device, dtype=x.dtype))
    if plan.read:
        if plan.read_positions is None:
            plan.record[plan.name] = x
        else:
            positions = plan.read_positions.to(x.device)
            plan.check_batch(positions, batch, "read")
            plan.check_in_range(positions, length, "read")
            plan.record[plan.name] = x[plan.rows(batch, x.device), positions]
    return x


# run_segment(start, stop, initial_state) -> (outputs for positions start..stop-1, state after
# position stop-1); initial_state None means the scan's zero state.
SegmentFn = Callable[[int, int, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class StateSite(nn.Module):
    """The recurrent state of a scan, h_t = the state after position t, as a site.

    Idle, the layer runs its scan in one call. Active, the layer hands `scan` a function that
    runs the scan over a range of positions from a given initial state; `scan` cuts the sequence
    after every position where some row reads or patches the state, runs the pieces in order
    (each continuing from the previous piece's final state, exactly as the kernels'
    initial_state / final-state outputs allow) and concatenates their outputs. At a cut after
    position p, rows whose patch position is p get their state replaced (the scan continues
    from the patched state, so outputs from p + 1 on see it; the output at p was computed from
    the unpatched state), then rows whose read position is p have their state recorded.

    Args:
        name: the site's short name, "state".
    """

    def __init__(self, name: str = "state") -> None:
        super().__init__()
        self.name = name
        self.plan: SitePlan | None = None

    def extra_repr(self) -> str:
        return repr(self.name)

    @property
    def active(self) -> bool:
        return self.plan is not None

    def scan(
        self,
        run_segment: SegmentFn,
        length: int,
        batch: int,
        time_dim: int,
        initial_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the scan in pieces as the plan says.

        Args:
            run_segment: see `SegmentFn`; its outputs have the time axis at `time_dim`.
            length: sequence length L.
            batch: batch size B.
            time_dim: the time axis of the outputs, to concatenate pieces along.
            initial_state: the state before position 0 (None: the scan's zero state).

        Returns:
            (the outputs for all L positions, as one unsplit scan would return them, the state
            after the last position).
        """
        plan = self.plan
        cuts: set[int] = set()
        read_pos = patch_pos = None
        if plan.read:
            if plan.read_positions is None:
                cuts.update(range(length))
            else:
                read_pos = plan.read_positions
                plan.check_batch(read_pos, batch, "read")
                plan.check_in_range(read_pos, length, "read")
                cuts.update(read_pos.tolist())
        if plan.patching:
            patch_pos = plan.patch_positions
            if patch_pos is None:
                raise ValueError(f"site {plan.name}: a state patch needs positions, got None")
            plan.check_batch(patch_pos, batch, "patch")
            plan.check_in_range(patch_pos, length, "patch")
            cuts.update(patch_pos.tolist())

        outputs, states = [], []
        read_buffer = None
        state = initial_state
        start = 0
        for p in sorted(cuts):
            out, state = run_segment(start, p + 1, state)
            outputs.append(out)
            if patch_pos is not None:
                state = self._patch(plan, state, patch_pos, p, batch)
            if plan.read and read_pos is None:
                states.append(state)
            elif read_pos is not None:
                mask = _row_mask(read_pos, p, state)
                read_buffer = torch.where(
                    mask, state, torch.zeros_like(state) if read_buffer is None else read_buffer
                )
            start = p + 1
        if start < length:
            out, state = run_segment(start, length, state)
            outputs.append(out)
        if plan.read:
            plan.record[plan.name] = torch.stack(states, 1) if read_pos is None else read_buffer
        y = torch.cat(outputs, dim=time_dim) if len(outputs) > 1 else outputs[0]
        return y, state

    @staticmethod
    def _patch(
        plan: SitePlan, state: torch.Tensor, positions: torch.Tensor, p: int, batch: int
    ) -> torch.Tensor:
        values = plan.patch_values
        if tuple(values.shape) != tuple(state.shape):
            raise ValueError(
                f"site {plan.name}: state patch values must have shape {tuple(state.shape)}, "
                f"got {tuple(values.shape)}"
            )
        mask = _row_mask(positions, p, state)
        return torch.where(mask, values.to(device=state.device, dtype=state.dtype), state)


def _row_mask(positions: torch.Tensor, p: int, like: torch.Tensor) -> torch.Tensor:
    """(B, 1, ..., 1) bool: rows whose position is p, broadcastable against `like`."""
    mask = positions.to(like.device) == p
    return mask.view(-1, *([1] * (like.dim() - 1)))
