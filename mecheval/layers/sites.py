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

What a mixer declares about its sites (which are token-local, which a patch reaches from
where) is part of the mixer contract: mecheval.layers.mixer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mecheval_kernels import ScanAt


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


class StateSite(nn.Module):
    """The recurrent state of a scan, h_t = the state after position t, as a site.

    The layer hands `scan` its scan at positions (`mecheval_kernels.at_positions` with a drop-in
    scan and the layer's inputs bound) and the scan runs once: idle, plainly; active, also returning
    the states after the positions a read asks for (`states_at`) and replacing the state after each
    row's patch position inside the scan (`state_patch`: the outputs after it see the patched state,
    the output at it the unpatched one). Reads come after patches (a read of a patched state is the
    patched state). Every row may have its own positions.

    Args:
        name: the site's short name, "state".
    """

    def __init__(self, name: str = "state") -> None:
        super().__init__()
        self.name = name
        self.plan: SitePlan | None = None

    def extra_repr(self) -> str:
        return repr(self.name)

    def scan(
        self,
        scan_at: Callable[..., ScanAt],
        batch: int,
        length: int,
        at: torch.Tensor | None = None,
        return_final_state: bool = False,
    ) -> ScanAt:
        """Run the scan as the plan says.

        Args:
            scan_at: the layer's scan at positions, taking the keywords states_at, out_at,
                state_patch and return_final_state (the kernels' `at_positions`) and returning
                a `mecheval_kernels.ScanAt`.
            batch, length: the scan's B and L (positions are checked against them).
            at: (B,) the one position per row whose output is wanted (the kernels' out_at),
                or None (all).
            return_final_state: whether the state after the last position is wanted.
        """
        plan = self.plan
        if plan is None:
            return scan_at(out_at=at, return_final_state=return_final_state)
        read = patch = None
        if plan.read:
            read = plan.read_positions
            if read is None:
                read = torch.arange(length).expand(batch, length)
            else:
                plan.check_batch(read, batch, "read")
                plan.check_in_range(read, length, "read")
            read = read if read.dim() == 2 else read[:, None]
        if plan.patching:
            if plan.patch_positions is None:
                raise ValueError(f"site {plan.name}: a state patch needs positions, got None")
            plan.check_batch(plan.patch_positions, batch, "patch")
            plan.check_in_range(plan.patch_positions, length, "patch")
            patch = (plan.patch_positions, plan.patch_values)
        try:
            result = scan_at(
                states_at=read,
                out_at=at,
                state_patch=patch,
                return_final_state=return_final_state,
            )
        except ValueError as error:  # the kernel names its argument; say which site it was
            raise ValueError(f"site {plan.name}: {error}") from None
        if plan.read:
            one = plan.read_positions is not None and plan.read_positions.dim() == 1
            plan.record[plan.name] = result.states[:, 0] if one else result.states
        return result
