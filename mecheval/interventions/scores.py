"""From an interchange grid to the study's read-outs, on its Attrib score
(mecheval.interventions.metric).

Read-outs of a 2-layer model (key corrupted, layer 1's block input restored):
    induction     high Attrib at `value`   the key was copied into the value's position
    direct_early  high Attrib at `query`   retrieved at the query, in layer 0
    direct_late   high Attrib at `key`     retrieved via the key position, in layer 1
Other depths read each layer's mixer output at `query` (the study's 3-layer read-out).
"""

from __future__ import annotations

import pandas as pd

from mecheval.interventions.bootstrap import attrib_intervals
from mecheval.interventions.metric import attrib, model_keys

MECHANISMS = {"induction": "value", "direct_early": "query", "direct_late": "key"}
# mecheval's own labelling rule (the study reports Attrib values only): a model is named after
# its highest read-out when that reaches this Attrib, else "unclear".
MECHANISM_THRESHOLD = 0.5


def _lookup(
    cells: pd.DataFrame, layer: int, site: str, position: str, column: str = "attrib"
) -> float:
    hit = cells[
        (cells["layer"] == layer) & (cells["site"] == site) & (cells["position"] == position)
    ]
    return float(hit[column].iloc[0]) if len(hit) else float("nan")


def readout_cells(depth: int) -> dict[str, tuple[int, str, str]]:
    """The read-out of a `depth`-layer model: name -> (layer, site, position)."""
    if depth == 2:
        return {m: (1, "block_input", pos) for m, pos in MECHANISMS.items()}
    return {f"layer{i}_mixer_query": (i, "mixer_output", "query") for i in range(depth)}


def readout(
    df: pd.DataFrame,
    threshold: float = MECHANISM_THRESHOLD,
    min_effect: float = 0.01,
    intervals: bool = False,
    cluster: str | None = None,
    reps: int = 1000,
) -> pd.DataFrame:
    """One row per model: the read-out scores and a mechanism label.

    Args:
        df: an interchange grid of key-corruption runs (with model-key columns if several
            models are in it), covering block_input (2-layer models) or mixer_output (other
            depths) at the positions the read-out needs.
        threshold: the Attrib a read-out must reach to name the mechanism; below it the label
            is "unclear". Models whose corruption has no effect are labelled "no effect".
        intervals: add a 95% bootstrap interval per read-out (`<name>_low`, `<name>_high`;
            see mecheval.interventions.bootstrap).
        cluster: with intervals, a column (e.g. "run") whose levels are pooled and resampled.
        reps: bootstrap replicates.
    """
    if intervals:
        scores = attrib_intervals(df, reps=reps, cluster=cluster, min_effect=min_effect)
        df = df.drop(columns=[cluster]) if cluster else df
    else:
        scores = attrib(df, min_effect=min_effect)
    keys = model_keys(df)
    models = df[keys].drop_duplicates() if keys else pd.DataFrame(index=[0])
    rows = []
    for _, model in models.iterrows():
        match = pd.Series(True, index=scores.index)
        for k in keys:
            match &= scores[k] == model[k]
        cells = scores[match]
        depth = int(df.loc[_rows_of(df, model, keys), "layer"].max()) + 1
        row = {k: model[k] for k in keys}
        wanted = readout_cells(depth)
        values = {name: _lookup(cells, *cell) for name, cell in wanted.items()}
        row.update(values)
        if intervals:
            for name, cell in wanted.items():
                row[f"{name}_low"] = _lookup(cells, *cell, column="attrib_low")
                row[f"{name}_high"] = _lookup(cells, *cell, column="attrib_high")
        if cells.empty:
            row["mechanism"] = "no effect"
        else:
            best = max(values, key=lambda k: -1e9 if pd.isna(values[k]) else values[k])
            row["mechanism"] = best if values[best] >= threshold else "unclear"
        rows.append(row)
    return pd.DataFrame(rows)


def _rows_of(df: pd.DataFrame, model: pd.Series, keys: list[str]) -> pd.Series:
    match = pd.Series(True, index=df.index)
    for k in keys:
        match &= df[k] == model[k]
    return match
