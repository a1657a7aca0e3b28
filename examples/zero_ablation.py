"""An intervention kind of one's own, in one file: zero ablation, each cell of the clean run set
to zero, on mecheval's patched-run engine (plan the cells, run them batched from their resume
points, read the answer at the query). Use it by import path, unchanged through the command
line:

    mecheval evaluate runs/quickstart --kind examples.zero_ablation:ZeroAblation
    mecheval report runs/quickstart

docs/interventions.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mecheval.interventions import Intervention, frame, plan_grid, run_plan


@dataclass(frozen=True)
class ZeroAblation(Intervention):
    """Args:
    positions: the position specs ablated (None: the task's key, value, divider, query).
    """

    positions: tuple[str, ...] | None = None
    name: ClassVar[str] = "zero_ablation"
    corrupts: ClassVar[bool] = False  # it patches the clean documents
    title: ClassVar[str] = "Zero ablation (drop of the answer's probability)"

    @torch.no_grad()
    def run(self, model, batch, corrupted):
        model.eval()
        batch = batch.to(next(model.parameters()).device)
        positions = None if self.positions is None else list(self.positions)
        # Zeros are no value one run computes: sites that would change the query alike run
        # each (alike=False).
        plan = plan_grid(model, batch, positions=positions, alike=False)

        def zeros(clean_values: dict) -> dict:
            return {site: torch.zeros_like(values) for site, values in clean_values.items()}

        outputs, p_original, p_unpatched = run_plan(model, plan, batch, batch.tokens, False, zeros)
        return frame(outputs, plan, p_original, p_unpatched)
