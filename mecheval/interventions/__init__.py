"""Causal interventions: one patched-run engine (plan_grid, run_plan) and its kinds (the
interchange grid, mean and resample ablation, path patching, EAP; `Intervention` and its
registry), the study's Attrib scores and read-outs, and attribution patching."""

from mecheval.interventions.ablation import ablation_grid
from mecheval.interventions.attribution import attribution_patching, screening_correlation
from mecheval.interventions.bootstrap import attrib_intervals
from mecheval.interventions.eap import edge_attribution
from mecheval.interventions.grid import COLUMNS, frame, interchange_grid, run_plan, select_sites
from mecheval.interventions.kinds import (
    Intervention,
    intervention_class,
    make_intervention,
    register_intervention,
    registered_interventions,
    route_shares,
)
from mecheval.interventions.metric import attrib
from mecheval.interventions.path import ROUTES, path_patching, routes_of
from mecheval.interventions.per_cell import per_cell_loop
from mecheval.interventions.plan import GridPlan, plan_grid
from mecheval.interventions.positions import NAMED, expand_positions, resolve_position
from mecheval.interventions.scores import MECHANISM_THRESHOLD, readout, readout_cells

__all__ = [
    "COLUMNS",
    "ROUTES",
    "GridPlan",
    "Intervention",
    "NAMED",
    "ablation_grid",
    "edge_attribution",
    "frame",
    "intervention_class",
    "make_intervention",
    "path_patching",
    "register_intervention",
    "registered_interventions",
    "route_shares",
    "routes_of",
    "run_plan",
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
