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

A mixer lists in `local_sites` (a tuple of site names, empty by default) its sites whose value at
a position is a function of its input at that position alone (input projections before any
sequence mixing). In the first block such a site sees one token alone, so where two documents
agree on that token it holds the same value in both: the interchange grid knows a patch there
is the identity without running it (mecheval.interventions.plan).

A mixer lists in `window_sites` (a dict, empty by default) its sites whose value at a position
is a function of its input at that position and the n - 1 before it alone (n the entry: a short
convolution's output). In the first block, where two documents agree on those n tokens, a
patch there is the identity too.

A mixer names in `reach_site` (None by default) the site through which alone its input at a
position reaches its output at other positions (the rest of its input acts at that position
only, e.g. Mamba's gate z). In the last block, at a position before the query, a patch of the
block's input, of its mixer's input or of that site then changes the logits at the query
alike: the grid runs one of them and copies its results to the others.

A mixer lists in `readout_sites` (a dict, empty by default) the sites whose value at a position
reaches its output at that position and the next n - 1 alone (n the entry), never its state:
DeltaNet's queries. In the last block such a patch cannot reach a query n or more positions on,
and the grid does not run it (`model.query_reach()`).
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
        read: whether to read; `read_positions` (B,), (B, P) or None for the full tensor.
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

    @property
    def idle(self) -> bool:
        """No intervention plan and no hooks: nobody looks at this site's activation."""
        return self.plan is None and not self._forward_hooks and not self._forward_pre_hooks

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
            rows = plan.rows(batch, x.device)
            plan.record[plan.name] = x[rows if positions.dim() == 1 else rows[:, None], positions]
    return x


# run_scan(initial_state, at) -> (outputs, the state after the last position, the states after
# positions at[b, :] of each row b (B, P, *state_shape), or None for `at` None); initial_state
# None means the scan's zero state.
ScanFn = Callable[
    [torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]
# carry(jump, after, at) -> (the change of the outputs, of the last state, of the states at `at`
# or None) when each row's state jumps by jump[row] (B, *state_shape) after the last position
# where after[row] (B, L) is False: the scan run with no inputs, from state `jump`, left
# unchanged wherever `after` is False. Its outputs need not be masked.
CarryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


# patched(initial_state, positions, values, at) -> run_scan's outputs for the scan whose state
# after positions[b] (B,) is replaced with values[b] within the one scan (the output at the
# position unpatched, states at `at` from it on patched); used without gradients, when given.
PatchedFn = Callable[
    [torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


class StateSite(nn.Module):
    """The recurrent state of a scan, h_t = the state after position t, as a site.

    Idle, the layer runs its scan in one call. Active, the layer hands `scan` two functions
    (`ScanFn`, `CarryFn`) and the scan is never split: one run also returns the states after
    the positions it is asked for (the kernels' `states_at`), which reads take. A patch replaces
    the
    state after position p_row, row by row: as the scan is affine in its state (Mamba's
    h_t = a_t h_{t-1} + b_t, DeltaNet's S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T),
    the patched run is the unpatched run plus the scan of the jump (patch - h_p) with no inputs,
    from p + 1 on (`carry`): outputs from p + 1 on see the patched state, the output at p was
    computed from the unpatched one. Reads come after patches (a read of a patched state is the
    patched state). Every row may have its own positions: two scans whatever they are.

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

    @property
    def patching(self) -> bool:
        """Whether the plan patches the state (else it reads it alone, or is idle)."""
        return self.plan is not None and self.plan.patching

    def scan(
        self,
        run_scan: ScanFn,
        carry: CarryFn,
        length: int,
        batch: int,
        time_dim: int,
        initial_state: torch.Tensor | None = None,
        patched: PatchedFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the scan as the plan says.

        Args:
            run_scan: see `ScanFn`; its outputs have the batch axis first and the time axis at
                `time_dim`.
            carry: see `CarryFn`; its outputs are laid out as run_scan's.
            length: sequence length L.
            batch: batch size B.
            time_dim: the time axis of the outputs.
            initial_state: the state before position 0 (None: the scan's zero state).
            patched: see `PatchedFn`: a scan that patches its state itself, one scan instead
                of two for a patch (Mamba's); taken while no gradient is recorded.

        Returns:
            (the outputs for all L positions, the state after the last position).
        """
        plan = self.plan
        read_pos = patch_pos = None
        if plan.read and plan.read_positions is not None:
            read_pos = plan.read_positions
            plan.check_batch(read_pos, batch, "read")
            plan.check_in_range(read_pos, length, "read")
        if plan.patching:
            patch_pos = plan.patch_positions
            if patch_pos is None:
                raise ValueError(f"site {plan.name}: a state patch needs positions, got None")
            plan.check_batch(patch_pos, batch, "patch")
            plan.check_in_range(patch_pos, length, "patch")
        columns = []  # the positions whose states are needed: the patch's, then the reads'
        if patch_pos is not None:
            columns.append(patch_pos[:, None])
        if read_pos is not None:
            columns.append(read_pos[:, None] if read_pos.dim() == 1 else read_pos)
        elif plan.read:
            columns.append(torch.arange(length).expand(batch, length))
        device = columns[0].device
        at = torch.cat([c.to(device=device, dtype=torch.long) for c in columns], dim=1)
        if patch_pos is not None and patched is not None and not torch.is_grad_enabled():
            return self._patched(patched, initial_state, patch_pos, at[:, 1:], read_pos)
        y, last, states = run_scan(initial_state, at)
        reads = states[:, 1:] if patch_pos is not None else states  # (B, P_read, ...)
        if patch_pos is not None:
            patch_pos = patch_pos.to(states.device)
            values = plan.patch_values
            if tuple(values.shape) != (batch, *states.shape[2:]):
                raise ValueError(
                    f"site {plan.name}: state patch values must have shape "
                    f"{(batch, *states.shape[2:])}, got {tuple(values.shape)}"
                )
            jump = values.to(device=states.device, dtype=states.dtype) - states[:, 0]
            after = torch.arange(length, device=states.device)[None, :] > patch_pos[:, None]
            read_at = at[:, 1:].to(states.device) if plan.read else None
            d_y, d_last, d_reads = carry(jump, after, read_at)
            y = y + _time_mask(after, y, time_dim) * d_y.to(y.dtype)
            if last is not None:  # (None: the caller wants no state after the last position)
                last = last + d_last.to(last.dtype)
            if plan.read:  # from p on, the states carry the jump
                reached = read_at >= patch_pos[:, None]
                reached = reached.view(*reached.shape, *(1,) * (jump.dim() - 1))
                reads = reads + reached.to(reads.dtype) * d_reads.to(reads.dtype)
        if plan.read:
            one = read_pos is not None and read_pos.dim() == 1
            plan.record[plan.name] = reads[:, 0] if one else reads
        return y, last

    def _patched(self, patched: PatchedFn, initial_state, patch_pos, read_at, read_pos):
        plan = self.plan
        values = plan.patch_values
        y, last, reads = patched(initial_state, patch_pos, values, read_at if plan.read else None)
        if plan.read:
            one = read_pos is not None and read_pos.dim() == 1
            plan.record[plan.name] = reads[:, 0] if one else reads
        return y, last


def _time_mask(mask: torch.Tensor, like: torch.Tensor, time_dim: int) -> torch.Tensor:
    """A (B, L) bool mask as a tensor of like's dtype, broadcastable against `like` (batch axis
    first, time at time_dim)."""
    shape = [1] * like.dim()
    shape[0], shape[time_dim] = mask.shape
    return mask.view(shape).to(like.dtype)
