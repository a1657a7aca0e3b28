"""`Intervention`: the contract of an intervention kind in code, and a registry by name or
import path, as mixers and tasks have theirs (docs/interventions.md).

A kind is a frozen dataclass whose fields are its options. It declares its `name`, whether it
patches from corrupted documents (`corrupts`), and writes
    run(model, batch, corrupted)   its table: a row per (document, cell), with the grid's cell
                                   columns (example, layer, site, position, position_index)
                                   and p_original, p_corrupted, p_restored
    summary(table)                 what the report shows of one run: a row per cell, with
                                   `value` (and `low`, `high` where it has intervals)
`mecheval evaluate --kind NAME` runs it on trained runs, the run folder keeps its table as
`<name>.parquet`, and the report gives it a section. Shipped: grid (the interchange grid,
the default), mean_ablation, resample_ablation, path (path patching by route), eap and eap_ig
(their first-order screen).
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import pandas as pd
import torch

from mecheval.imports import import_module
from mecheval.interventions.ablation import ablation_grid
from mecheval.interventions.bootstrap import attrib_intervals
from mecheval.interventions.eap import edge_attribution
from mecheval.interventions.grid import interchange_grid
from mecheval.interventions.path import path_patching


class Intervention(ABC):
    """Base class of every intervention kind (see the module docstring)."""

    name: ClassVar[str]
    corrupts: ClassVar[bool] = True
    title: ClassVar[str] = ""

    @abstractmethod
    def run(self, model, batch, corrupted: torch.Tensor | None) -> pd.DataFrame:
        """The kind's table on `batch` (its `corrupted` copies when `corrupts`)."""

    def summary(self, table: pd.DataFrame) -> pd.DataFrame:
        """Per cell: the mean effect p_original - p_restored over documents (`value`)."""
        cells = ["layer", "site", "position"]
        grouped = table.groupby(cells, sort=False)
        out = grouped[["p_original", "p_restored"]].mean().reset_index()
        out["value"] = out["p_original"] - out["p_restored"]
        out["n"] = grouped["example"].nunique().to_numpy()
        return out[[*cells, "value", "n"]]

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class Grid(Intervention):
    """The interchange grid (mecheval.interventions.grid), summarised as Attrib."""

    positions: tuple[str, ...] | None = None
    memory_budget: int = 1 << 30
    name: ClassVar[str] = "grid"
    title: ClassVar[str] = "Interchange interventions (Attrib, 95% interval)"

    def run(self, model, batch, corrupted):
        return interchange_grid(model, batch, corrupted, positions=_labels(self.positions),
                                memory_budget=self.memory_budget)  # fmt: skip

    def summary(self, table):
        return _attrib(table)


@dataclasses.dataclass(frozen=True)
class MeanAblation(Intervention):
    """Every cell of the clean run set to its mean over the documents."""

    positions: tuple[str, ...] | None = None
    memory_budget: int = 1 << 30
    name: ClassVar[str] = "mean_ablation"
    corrupts: ClassVar[bool] = False
    title: ClassVar[str] = "Mean ablation (drop of the answer's probability)"

    def run(self, model, batch, corrupted):
        return ablation_grid(model, batch, "mean", positions=_labels(self.positions),
                             memory_budget=self.memory_budget)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ResampleAblation(Intervention):
    """Every cell of the clean run set to its value in another document."""

    positions: tuple[str, ...] | None = None
    seed: int = 0
    memory_budget: int = 1 << 30
    name: ClassVar[str] = "resample_ablation"
    corrupts: ClassVar[bool] = False
    title: ClassVar[str] = "Resample ablation (drop of the answer's probability)"

    def run(self, model, batch, corrupted):
        return ablation_grid(model, batch, "resample", positions=_labels(self.positions),
                             seed=self.seed, memory_budget=self.memory_budget)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PathPatching(Intervention):
    """Each route's share of the sender's effect (mecheval.interventions.path), every layer's
    mixer the route's (`layers` None) or those given."""

    positions: tuple[str, ...] = ("key",)
    layers: tuple[int, ...] | None = None
    sender: str = "block_input"
    receiver: str | None = None
    name: ClassVar[str] = "path"
    title: ClassVar[str] = "Path patching: each route's share of the sender's effect"

    def run(self, model, batch, corrupted):
        layers = range(len(model.layers)) if self.layers is None else self.layers
        return pd.concat(
            [
                path_patching(model, batch, corrupted, layer=layer, sender=self.sender,
                              positions=list(self.positions), receiver=self.receiver)
                for layer in layers
            ],
            ignore_index=True,
        )  # fmt: skip

    def summary(self, table):
        return route_shares(table)


@dataclasses.dataclass(frozen=True)
class EdgeAttribution(Intervention):
    """EAP: the first-order estimate of every path cell (mecheval.interventions.eap)."""

    positions: tuple[str, ...] = ("key",)
    layers: tuple[int, ...] | None = None
    name: ClassVar[str] = "eap"
    title: ClassVar[str] = "EAP: the routes' shares, estimated from gradients"
    steps: ClassVar[int] = 1

    def run(self, model, batch, corrupted):
        layers = range(len(model.layers)) if self.layers is None else self.layers
        return pd.concat(
            [
                edge_attribution(model, batch, corrupted, layer=layer,
                                 positions=list(self.positions), steps=self.steps)
                for layer in layers
            ],
            ignore_index=True,
        )  # fmt: skip

    def summary(self, table):
        return route_shares(table, intervals=False)


@dataclasses.dataclass(frozen=True)
class IntegratedEdgeAttribution(EdgeAttribution):
    """EAP-IG: EAP with its gradient averaged over 8 points between the corrupted run and the
    patched one."""

    name: ClassVar[str] = "eap_ig"
    title: ClassVar[str] = "EAP-IG: the routes' shares, estimated from integrated gradients"
    steps: ClassVar[int] = 8


def _labels(positions):
    return None if positions is None else list(positions)


def _attrib(table: pd.DataFrame, cells=("layer", "site", "position")) -> pd.DataFrame:
    scores = attrib_intervals(table[[c for c in table if c in _GRID]], reps=200)
    out = scores.rename(columns={"attrib": "value", "attrib_low": "low", "attrib_high": "high"})
    return out[[*cells, "value", "low", "high", "n"]]


_GRID = ("example", "layer", "site", "position", "position_index", "p_original",
         "p_corrupted", "p_restored", "logit_restored", "kl")  # fmt: skip


def route_shares(table: pd.DataFrame, intervals: bool = True) -> pd.DataFrame:
    """Per (layer, position, route): the route's share of the sender's effect,
    (E[p_route] - E[p_corrupted]) / (E[p_original] - E[p_corrupted]), with a 95% bootstrap
    interval over documents (the route takes the grid's site column, so that Attrib's
    bootstrap applies)."""
    cells = table.assign(site=table["route"])
    if not intervals:
        grouped = cells.groupby(["layer", "site", "position"], sort=False)
        mean = grouped[["p_original", "p_corrupted", "p_restored"]].mean()
        value = (mean.p_restored - mean.p_corrupted) / (mean.p_original - mean.p_corrupted)
        out = value.rename("value").reset_index()
        out["n"] = grouped["example"].nunique().to_numpy()
        return out.rename(columns={"site": "route"})
    return _attrib(cells).rename(columns={"site": "route"})


# ---- the registry --------------------------------------------------------------------------

_REGISTRY: dict[str, type[Intervention]] = {}


def register_intervention(name: str, kind: type[Intervention], *, replace: bool = False):
    """Register the `Intervention` subclass `kind` (a frozen dataclass) under `name`."""
    if not (inspect.isclass(kind) and issubclass(kind, Intervention)):
        raise TypeError(f"intervention {name!r} must be a subclass of Intervention, got {kind!r}")
    if not dataclasses.is_dataclass(kind) or inspect.isabstract(kind):
        raise TypeError(f"intervention {name!r} must be a frozen dataclass that writes run()")
    if name in _REGISTRY and _REGISTRY[name] is not kind and not replace:
        raise ValueError(f"an intervention named {name!r} is already registered")
    _REGISTRY[name] = kind
    return kind


def registered_interventions() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def intervention_class(name: str) -> type[Intervention]:
    """The kind of a registered name or an import path `module:Class`."""
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            kind = getattr(import_module(module_name), attribute, None)
        except ImportError as error:
            message = f"intervention {name!r}: cannot import {module_name!r} ({error})"
            raise ValueError(message) from None
        if kind is None:
            raise ValueError(f"intervention {name!r}: {module_name!r} has no {attribute!r}")
        return register_intervention(name, kind, replace=True)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown intervention kind {name!r}: registered are {', '.join(_REGISTRY)}; "
            "register yours with register_intervention, or name it by import path"
        )
    return _REGISTRY[name]


def make_intervention(name: str, **options: Any) -> Intervention:
    """An intervention kind by name or import path, its options checked by name."""
    kind = intervention_class(name)
    valid = [f.name for f in dataclasses.fields(kind)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for intervention {name!r}; valid: {valid}")
    return kind(**options)


for _kind in (Grid, MeanAblation, ResampleAblation, PathPatching, EdgeAttribution,
              IntegratedEdgeAttribution):  # fmt: skip
    register_intervention(_kind.name, _kind)

__all__ = [
    "Intervention",
    "intervention_class",
    "make_intervention",
    "register_intervention",
    "registered_interventions",
    "route_shares",
]
