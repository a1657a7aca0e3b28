"""The study's metric per cell of an interchange grid (docs/study.md, "The metric").

    Attrib = (E[p_restored] - E[p_corrupted]) / (E[p_original] - E[p_corrupted])

per (layer, site, position) cell, the expectations over a set of documents; a model whose
corruption effect E[p_original] - E[p_corrupted] is at most `min_effect` (0.01) has nothing
to attribute and is dropped. Its bootstrap intervals are mecheval.interventions.bootstrap's,
the read-outs built on it mecheval.interventions.scores'.
"""

from __future__ import annotations

import pandas as pd

from mecheval.interventions.grid import COLUMNS

CELL = ("layer", "site", "position")


def model_keys(frame: pd.DataFrame) -> list[str]:
    """The columns that identify a model or condition (run, arch, corruption, ...): everything
    an interchange grid does not produce itself."""
    own = set(COLUMNS) | {"attrib", "effect", "n"}
    return [c for c in frame.columns if c not in own]


def attrib(df: pd.DataFrame, min_effect: float = 0.01) -> pd.DataFrame:
    """Attrib per (model keys..., layer, site, position) from an interchange-grid table.

    Returns columns: the model keys, layer, site, position, p_original, p_corrupted,
    p_restored, kl (means over documents), n (documents), effect, attrib. Models whose effect
    is <= min_effect are dropped.
    """
    keys = model_keys(df)
    grouped = df.groupby([*keys, *CELL], sort=False, dropna=False)
    table = grouped.agg(
        p_original=("p_original", "mean"),
        p_corrupted=("p_corrupted", "mean"),
        p_restored=("p_restored", "mean"),
        kl=("kl", "mean"),
        n=("example", "nunique"),
    ).reset_index()
    table["effect"] = table["p_original"] - table["p_corrupted"]
    table["attrib"] = (table["p_restored"] - table["p_corrupted"]) / table["effect"]
    return table[table["effect"] > min_effect].reset_index(drop=True)
