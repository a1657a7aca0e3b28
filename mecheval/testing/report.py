"""What the conformance checks share: a `Check`, the report of every check of one mixer or
task, the error that carries it, and the comparison of the interchange grid with the
per-cell loop that both end with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from mecheval.interventions import interchange_grid, per_cell_loop

GRID_COLUMNS = ("p_original", "p_corrupted", "p_restored", "logit_restored", "kl")


@dataclass
class Check:
    """One check: passed (True), failed (False) or skipped (None: nothing declared)."""

    name: str
    passed: bool | None
    detail: str = ""


@dataclass
class _Report:
    """Every check of one subject (a mixer's or a task's name), in the order they ran; printed
    a line each under `<check>(subject)`."""

    subject: str
    checks: list[Check] = field(default_factory=list)
    check: ClassVar[str] = ""

    @property
    def heading(self) -> str:
        return f"{self.check}({self.subject!r})"

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    def __str__(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}
        lines = [f"{self.heading}:"]
        lines += [f"  {mark[c.passed]} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)


class MixerReport(_Report):
    """Every check of one mixer (`check_mixer`)."""

    check = "check_mixer"


class TaskReport(_Report):
    """Every check of one task (`check_task`)."""

    check = "check_task"


class _CheckError(AssertionError):
    def __init__(self, report: _Report) -> None:
        super().__init__(str(report))
        self.report = report


class MixerCheckError(_CheckError):
    """A mixer failed a check of `check_mixer`; `report` holds every check."""


class TaskCheckError(_CheckError):
    """A task failed a check of `check_task`; `report` holds every check."""


def grid_against_loop(model, batch, corrupted, atol: float, rtol: float, passed: str) -> Check:
    """The "grid" check: every cell of the interchange grid of `model` equals the per-cell
    loop's (within atol, rtol), `passed` its detail when it does."""
    fast = interchange_grid(model, batch, corrupted)
    slow = per_cell_loop(model, batch, corrupted)
    keys = ["example", "layer", "site", "position"]
    merged = fast.merge(slow, on=keys, suffixes=("", "_loop"), validate="one_to_one")
    if len(merged) != len(fast) or len(fast) != len(slow):
        return Check("grid", False, f"{len(fast)} grid cells against {len(slow)} loop cells")
    for column in GRID_COLUMNS:
        if not np.allclose(merged[column], merged[f"{column}_loop"], atol=atol, rtol=rtol):
            worst = float(np.abs(merged[column] - merged[f"{column}_loop"]).max())
            return Check("grid", False, f"{column} differs from the per-cell loop by {worst:.2e}")
    return Check("grid", True, f"{len(fast)} {passed}")
