"""Mechanisms over training: the read-outs of every checkpoint a run kept.

    evaluate_over_training(run_dir)   -> run_dir/readouts_over_training.parquet

The study ran its interchange evaluation every 1,000 training steps. mecheval evaluates, after
training, every checkpoint the run kept (`checkpoint_every` spaces them, `keep_checkpoints`
keeps them), on the read-out cells only, which makes it cheap: the key corrupted, and
- 2-layer models: layer 1's block input at key, value and query (direct late, induction,
  direct early);
- other depths: each layer's mixer output at the query;
- models with short convs (each site a mixer declares in `conv_sites`: Mamba's and Based's
  one conv, DeltaNet's q, k and v convs, any mixer's own): each conv's output at value,
  value+1 and value+2, where the study finds Mamba's association (`conv_value+1` for layer
  0's conv, `conv_l1_value` for layer 1's, `k_conv_value` for layer 0's key conv;
  `conv_column` names them).
One row per checkpoint: step, accuracy on the evaluation documents, the read-outs and the
mechanism label. A damaged checkpoint is left out with a warning naming it. A run already
evaluated with the same settings and checkpoints is skipped.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pandas as pd

from mecheval.evaluation.config import DEFAULTS
from mecheval.evaluation.documents import document_records
from mecheval.interventions import interchange_grid, readout, readout_cells
from mecheval.io import DamagedFileError
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import (
    WEIGHTS,
    CheckpointError,
    list_checkpoints,
    verify_checkpoint,
)
from mecheval.run_folder.files import CHECKPOINTS, OVER_TRAINING, OVER_TRAINING_STAMP
from mecheval.run_folder.weights import load_trained_model

CONV_POSITIONS = ("value", "value+1", "value+2")
# The zoo's short convs' outputs, by name: what evaluations that recorded no `conv_sites`
# (before mixers declared them) read out.
CONV_SITES = ("conv_output", "q_conv_output", "k_conv_output", "v_conv_output")
READOUT_CELLS_VERSION = 3  # 3: every short conv of every layer (1: layer 0's conv only)
_CONV_COLUMN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*?)_(?:l(\d+)_)?(value(?:\+[12])?)$")


def conv_column(layer: int, position: str, site: str = "conv_output") -> str:
    """The read-out name of a short conv's output at `position`: `conv_value+1` for layer 0's
    conv, `conv_l1_value` for layer 1's, `k_conv_value` for layer 0's key conv (DeltaNet)."""
    prefix = site.removesuffix("_output")
    return f"{prefix}_{position}" if layer == 0 else f"{prefix}_l{int(layer)}_{position}"


def parse_conv_column(name: str) -> tuple[str, int, str] | None:
    """(site, layer, position) of a `conv_column` name; None for any other column."""
    match = _CONV_COLUMN.match(name)
    if match is None:
        return None
    return f"{match[1]}_output", int(match[2] or 0), match[3]


def conv_sites(model) -> dict[int, list[str]]:
    """Each layer's short convs' outputs, as its mixer declares them (`Mixer.conv_sites`)."""
    return {i: list(block.mixer.conv_sites) for i, block in enumerate(model.layers)}


def readout_grids(
    model, batch, corrupted, memory_budget: int = DEFAULTS.memory_budget
) -> pd.DataFrame:
    """The interchange grid of the read-out cells (see the module docstring) the task's roles
    support (a read-out at a role the documents lack is left out: not applicable)."""
    depth = len(model.layers)
    cells = readout_cells(depth)
    layers = sorted({layer for layer, _, _ in cells.values()})
    sites = sorted({site for _, site, _ in cells.values()})
    positions = [p for p in dict.fromkeys(p for _, _, p in cells.values()) if p in batch.roles]
    grids = []
    if positions:
        grids.append(
            interchange_grid(
                model,
                batch,
                corrupted,
                layers=layers,
                sites=sites,
                positions=positions,
                memory_budget=memory_budget,
            )
        )
    declared = conv_sites(model) if "value" in batch.roles else {}
    for site in dict.fromkeys(site for sites in declared.values() for site in sites):
        conv_layers = [layer for layer, sites in declared.items() if site in sites]
        if conv_layers:
            grids.append(
                interchange_grid(
                    model,
                    batch,
                    corrupted,
                    layers=conv_layers,
                    sites=[site],
                    positions=list(CONV_POSITIONS),
                    memory_budget=memory_budget,
                )
            )
    return pd.concat(grids, ignore_index=True)


def is_conv_cell(grid: pd.DataFrame, declared: dict[int, list[str]] | None) -> pd.Series:
    """Which rows of `grid` patch a short conv's output: a site its layer's mixer declares
    (`declared`, as `conv_sites` gives it), or, where that was not recorded (None), one of
    the zoo's CONV_SITES."""
    if declared is None:
        return grid["site"].isin(CONV_SITES)
    pairs = {(int(layer), site) for layer, sites in declared.items() for site in sites}
    keys = zip(grid["layer"].astype(int), grid["site"], strict=True)
    return pd.Series([key in pairs for key in keys], index=grid.index, dtype=bool)


def _conv_readouts(grid: pd.DataFrame, declared: dict | None = None) -> dict[str, float]:
    """Attrib (point estimate) of each short conv's output (`declared` as `is_conv_cell`
    takes it) at the conv positions."""
    cells = grid[is_conv_cell(grid, declared)]
    keys = ["site", "layer", "position"]
    means = cells.groupby(keys)[["p_original", "p_corrupted", "p_restored"]].mean()
    out = {}
    for (site, layer, position), m in means.iterrows():
        if position in CONV_POSITIONS:
            effect = m["p_original"] - m["p_corrupted"]
            out[conv_column(layer, position, site)] = (
                (m["p_restored"] - m["p_corrupted"]) / effect if effect > 0.01 else float("nan")
            )
    return out


def evaluate_over_training(
    run_dir: str | Path,
    split: str = DEFAULTS.split,
    device: str = DEFAULTS.device,
    seed: int = DEFAULTS.seed,
    memory_budget: int = DEFAULTS.memory_budget,
    force: bool = False,
) -> pd.DataFrame:
    """The read-outs of every kept checkpoint of a run (see the module docstring).

    Returns:
        one row per checkpoint: step, accuracy, the read-out columns of
        `mecheval.interventions.readout` (and conv_* for models with a short conv), mechanism.
    """
    run_dir = Path(run_dir)
    checkpoints = []
    for step, path in list_checkpoints(run_dir / CHECKPOINTS):
        try:
            verify_checkpoint(path, (WEIGHTS,))
        except CheckpointError as error:
            warnings.warn(f"{error}: left out of the read-outs over training", stacklevel=2)
            continue
        checkpoints.append((step, path))
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir} has no intact checkpoint")
    settings = {
        "split": split,
        "seed": seed,
        "steps": [step for step, _ in checkpoints],
        "cells": READOUT_CELLS_VERSION,
    }
    stored = files.read_stamp(run_dir, OVER_TRAINING_STAMP)
    stored = stored.get("settings", {k: v for k, v in stored.items() if k != "files"})
    if (run_dir / OVER_TRAINING).exists() and not force and stored == settings:
        try:
            return files.read_table(run_dir, OVER_TRAINING)
        except DamagedFileError:
            pass  # evaluated anew, below
    rows = []
    for step, path in checkpoints:
        model, task, config = load_trained_model(run_dir, device=device, checkpoint=path)
        if "key" not in task.corruptions:
            return pd.DataFrame()  # the read-outs corrupt the key: not applicable
        batch = task.dataset(split, size=config.task.eval_size).to(device)
        corrupted = task.corrupt(batch, "key", seed=seed)
        grid = readout_grids(model, batch, corrupted, memory_budget=memory_budget)
        convs = is_conv_cell(grid, conv_sites(model))  # a mixer's site is never a block's
        scores = readout(grid[~convs]).iloc[0].to_dict()
        row = {"step": step, "accuracy": float(document_records(model, batch)["correct"].mean())}
        row.update(scores)
        row.update(_conv_readouts(grid, conv_sites(model)))
        rows.append(row)
    table = pd.DataFrame(rows)
    table.insert(0, "run", run_dir.name)
    record = {"settings": settings}
    files.write_stamped(run_dir, OVER_TRAINING_STAMP, {OVER_TRAINING: table}, record)
    return table
