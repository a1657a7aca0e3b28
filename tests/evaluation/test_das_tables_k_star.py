"""k*: the smallest k whose swap gains KSTAR_SHARE of the full swap's gain in IIA over no swap,
none where the full swap gains too little."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mecheval.evaluation.das_tables import _k_star, k_star_table

pytestmark = pytest.mark.pipeline


def test_k_star_is_measured_from_no_swap():
    ks = np.array([0, 1, 2, 4, 8])
    # gains over no swap 0.1, 0.6, 0.75, 0.8: 90% of 0.8 is 0.72, first reached at k = 4
    assert _k_star(np.array([0.2, 0.3, 0.8, 0.95, 1.0]), ks) == 4
    # without a no-swap column the gain is over 0: 0.9 is first reached at k = 4 too
    assert _k_star(np.array([0.3, 0.8, 0.95, 1.0]), ks[1:]) == 4
    # a full swap gaining 0.05 carries too little for a k*
    assert np.isnan(_k_star(np.array([0.2, 0.2, 0.21, 0.22, 0.25]), ks))


def _cell(position: str, iia_by_k: dict[int, float], n: int = 200) -> pd.DataFrame:
    rows = []
    for k, iia in iia_by_k.items():
        correct = np.arange(n) < round(iia * n)
        rows.append(
            pd.DataFrame(
                {"example": np.arange(n), "k": k, "correct": correct, "position": position}
            )
        )
    model = dict(task="ar", setting="ar()", arch="attention", d_model=64, n_layers=2, lr=1e-3)
    model["das_settings"] = "steps 200"
    cell = dict(corruption="key", layer=1, site="block_input", width=8, run="r")
    return pd.concat(rows).assign(**model, **cell)


def test_the_table_gives_k_star_with_its_interval_or_none():
    das = pd.concat(
        [
            _cell("value", {0: 0.2, 1: 0.4, 2: 0.7, 4: 0.95, 8: 1.0}),
            _cell("key", {0: 0.2, 1: 0.2, 2: 0.2, 4: 0.2, 8: 0.22}),
        ]
    )
    table = k_star_table(das).set_index("position")
    value, key = table.loc["value"], table.loc["key"]
    assert value["k_star"] == 4 and value["k_star_low"] <= 4 <= value["k_star_high"]
    assert value["no_swap_iia"] == 0.2 and value["full_swap_iia"] == 1.0
    assert pd.isna(key["k_star"]) and pd.isna(key["k_star_low"])
