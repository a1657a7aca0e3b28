"""The report's section of each intervention kind a run folder holds beside the grid
(`mecheval evaluate --kind NAME`, mecheval.evaluation.kinds): a row per (run, corruption,
cell) of the kind's own `summary`; where a run holds exact path patching and its EAP screens,
how well each screen ranks the path cells as path patching does; and path patching's route
shares pooled over each configuration's seeds (`routes_over_seeds`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mecheval.evaluation.kinds import evaluated_kinds
from mecheval.interventions import attrib, attrib_intervals
from mecheval.interventions.kinds import intervention_class, make_intervention
from mecheval.run_folder import files

SCREENS = ("eap", "eap_ig")
# What makes runs seeds of one configuration (mecheval.evaluation.analysis.same_configuration).
CONFIGURATION = ("task_label", "steps", "arch", "d_model", "n_layers", "lr")
_PATH_CELLS = ("corruption", "receiver", "layer", "position", "route")
_SAMPLES = ("run", "example", "p_original", "p_corrupted", "p_restored", "kl", "p_sender")
SAME_SENDER = 1e-6  # the sender patched alone moves no document's answer more than this
IDENTITY = ("run", "arch", "d_model", "n_layers", "lr", "task", "step")


def kind_tables(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Kind (name or import path) -> the summaries of every given run that holds its table:
    the run's identity, corruption, the kind's summary columns. `runs`: the report's run table
    (a `path` and `run` column)."""
    found: dict[str, list[pd.DataFrame]] = {}
    for run in runs.itertuples():
        folder = Path(run.path)
        for name, kind in evaluated_kinds(folder).items():
            stamp = files.read_stamp(folder, name.removesuffix(".parquet") + ".json")
            chosen = make_intervention(kind, **_options(stamp["settings"].get("options", {})))
            table = files.read_table(folder, name)
            for corruption, part in table.groupby("corruption", sort=False):
                summary = chosen.summary(part.drop(columns=[c for c in IDENTITY if c in part]))
                summary.insert(0, "corruption", corruption)
                summary.insert(0, "run", run.run)
                found.setdefault(kind, []).append(summary)
    return {kind: pd.concat(parts, ignore_index=True) for kind, parts in found.items()}


def _options(options: dict) -> dict:
    """Stored options (lists) as the kinds take them (tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def screen_agreement(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per run, corruption and screen (EAP, EAP-IG): Spearman's rank correlation between the
    screen's estimated shares and path patching's exact ones over the path cells (layer,
    position, route), and how many cells it is over."""
    if "path" not in tables:
        return pd.DataFrame()
    keys = ["run", "corruption", "layer", "position", "route"]
    exact = tables["path"][[*keys, "value"]]
    rows = []
    for screen in SCREENS:
        if screen not in tables:
            continue
        merged = exact.merge(tables[screen][[*keys, "value"]], on=keys, suffixes=("", "_est"))
        pairs = tables[screen][["run", "corruption"]].drop_duplicates()
        for run, corruption in pairs.itertuples(index=False):
            part = merged[(merged["run"] == run) & (merged["corruption"] == corruption)]
            part = part.dropna(subset=["value", "value_est"])
            rho = np.nan
            if len(part) > 2:
                rho = float(part["value"].rank().corr(part["value_est"].rank()))
            rows.append(
                {"run": run, "corruption": corruption, "screen": screen,
                 "spearman": rho, "cells": len(part)}
            )  # fmt: skip
    return pd.DataFrame(rows, columns=["run", "corruption", "screen", "spearman", "cells"])


def kind_sections(runs: pd.DataFrame) -> list[tuple[str, pd.DataFrame, str]]:
    """(title, table, note) per kind the runs hold tables of, in registration order: the
    kind's summaries (value with its interval where it has one), and for path patching the
    screens' agreement with it."""
    tables = kind_tables(runs)
    sections = []
    for kind, table in tables.items():
        title = intervention_class(kind).title or f"Intervention kind {kind}"
        note = f"`mecheval evaluate PATH --kind {kind}`; a row per run, corruption and cell."
        sections.append((title, table, note))
    agreement = screen_agreement(tables)
    if len(agreement):
        note = (
            "Spearman's rank correlation of each screen's estimated route shares with path "
            "patching's exact ones, over the path cells of a run."
        )
        sections.append(("EAP against exact path patching", agreement, note))
    return sections


def routes_over_seeds(runs: pd.DataFrame, reps: int = 1000) -> pd.DataFrame:
    """Per configuration (CONFIGURATION), corruption, receiver and path cell (layer, position,
    route): the route's share of the sender's effect pooled over the configuration's runs that
    hold path patching's table (`value`: the ratio of means over every seed's documents), its
    95% bootstrap interval over seeds and documents (seeds drawn again, then documents within
    each; one seed: documents alone), `seeds`, and each seed's own share in seed order
    (`per_seed`). `runs`: the report's run table (`run`, `path`, `seed`, `setting` and the
    configuration's columns)."""
    tables = []
    for run in runs.itertuples():
        if "path.parquet" in evaluated_kinds(Path(run.path)):
            table = files.read_table(run.path, "path.parquet")
            tables.append(table[[*_PATH_CELLS, *_SAMPLES]].assign(run=run.run))
    columns = ["setting", "arch", "d_model", "n_layers", "lr", *_PATH_CELLS, "value", "low",
               "high", "seeds", "per_seed"]  # fmt: skip
    if not tables:
        return pd.DataFrame(columns=columns)
    cells = pd.concat(tables, ignore_index=True).rename(columns={"route": "site"})
    sender = ["corruption", "receiver", "layer", "position"]
    moved = (cells["p_sender"] - cells["p_corrupted"]).abs().groupby([cells[k] for k in sender])
    cells = cells[moved.transform("max") > SAME_SENDER].drop(columns=["p_sender"])
    cells = cells.merge(runs[["run", "seed", "setting", *CONFIGURATION]], on="run")
    rows = []
    for configuration, part in cells.groupby(list(CONFIGURATION), sort=False):
        grid = part.drop(columns=["seed", "setting", *CONFIGURATION])
        pooled = attrib_intervals(grid, reps=reps, cluster="run")
        by_seed = attrib(grid.merge(part[["run", "seed"]].drop_duplicates(), on="run").drop(
            columns=["run"])).sort_values("seed")  # fmt: skip
        keys = ["corruption", "receiver", "layer", "site", "position"]
        shares = by_seed.groupby(keys, sort=False)["attrib"].agg(
            lambda values: " / ".join(f"{v:.2f}" for v in values)
        )
        pooled = pooled.merge(shares.rename("per_seed").reset_index(), on=keys)
        pooled["seeds"] = part["run"].nunique()
        identity = dict(zip(CONFIGURATION, configuration, strict=True))
        identity["setting"] = part["setting"].iloc[0]
        rows.append(pooled.assign(**identity))
    out = pd.concat(rows, ignore_index=True).rename(
        columns={"site": "route", "attrib": "value", "attrib_low": "low", "attrib_high": "high"}
    )
    return out[columns].sort_values(["arch", "lr", "corruption", "layer"], kind="stable")
