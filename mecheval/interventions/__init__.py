"""Causal interventions: batched interchange grids, the study's Attrib scores and read-outs,
and attribution patching for screening large grids."""

from mecheval.interventions.attribution import attribution_patching, screening_correlation
from mecheval.interventions.bootstrap import attrib_intervals
from mecheval.interventions.grid import COLUMNS, interchange_grid, select_sites
from mecheval.interventions.metric import attrib
from mecheval.interventions.per_cell import per_cell_loop
from mecheval.interventions.plan import GridPlan, plan_grid
from mecheval.interventions.positions import NAMED, expand_positions, resolve_position
from mecheval.interventions.scores import MECHANISM_THRESHOLD, readout, readout_cells

__all__ = [
    "COLUMNS",
    "GridPlan",
    "NAMED",
    "attrib",
    "attrib_intervals",
    "attribution_patching",
    "expand_positions",
    "interchange_grid",
    "per_cell_loop",
    "plan_grid",
    "readout",
    "readout_cells",
    "MECHANISM_THRESHOLD",
    "resolve_position",
    "screening_correlation",
    "select_sites",
]
