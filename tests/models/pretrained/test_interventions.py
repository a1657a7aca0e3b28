"""The interchange grid on pretrained models: every cell equals the per-cell hook loop's (every
site, the recurrent state included, at every position), and pyvene's interchange intervention
on the Hugging Face model itself at the same (layer, site, position) (pyvene_reference.py maps
the sites to the modules); chunked under a small memory budget, the grid is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from mecheval.interventions import interchange_grid, per_cell_loop
from mecheval.models.pretrained import FAMILIES, from_pretrained
from mecheval.models.pretrained.synthetic import random_batch, random_hf_model
from tests.models.pretrained.fla_reference import naive_forwards
from tests.models.pretrained.helpers import FLA
from tests.models.pretrained.pyvene_reference import COMPONENTS, pyvene_cells

VALUES = ["p_original", "p_corrupted", "p_restored", "logit_restored", "kl"]
NAMED = ["key", "value", "divider", "query"]


def _setup(family: str, n_layers: int = 2):
    hf = random_hf_model(family, n_layers=n_layers, vocab_size=61, seed=1)
    batch, corrupted = random_batch(61, n=4, length=12, seed=2)
    return hf, from_pretrained(hf), batch, corrupted


@pytest.mark.parametrize("family", FAMILIES)
def test_every_cell_equals_the_per_cell_loop(family):
    _, model, batch, corrupted = _setup(family)
    grid = interchange_grid(model, batch, corrupted, positions=["all"])
    loop = per_cell_loop(model, batch, corrupted, positions=["all"])
    assert list(grid["site"].unique()) == list(loop["site"].unique())
    assert (grid[["example", "layer", "site", "position"]] == loop[grid.columns[:4]]).all().all()
    np.testing.assert_allclose(grid[VALUES], loop[VALUES], atol=1e-5, rtol=1e-4)
    chunked = interchange_grid(model, batch, corrupted, positions=["all"], memory_budget=1 << 16)
    np.testing.assert_allclose(chunked[VALUES], grid[VALUES], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cells_equal_pyvenes_interchange_interventions(family):
    hf, model, batch, corrupted = _setup(family)
    sites = [s for s in COMPONENTS if f"layers.0.{s}" in model.site_names()]
    grid = interchange_grid(model, batch, corrupted, sites=sites, positions=NAMED)
    context = (lambda: naive_forwards(hf)) if family in FLA else None
    checked = 0
    for layer in range(model.config.n_layers):
        for site in sites:
            theirs = pyvene_cells(hf, batch, corrupted, layer, site, NAMED, context)
            for label, (p, logit, kl) in theirs.items():
                ours = grid[(grid.layer == layer) & (grid.site == site) & (grid.position == label)]
                np.testing.assert_allclose(ours.p_restored, p.numpy(), atol=1e-5, rtol=1e-4)
                np.testing.assert_allclose(ours.logit_restored, logit.numpy(), atol=1e-4)
                np.testing.assert_allclose(ours.kl, kl.numpy(), atol=1e-5, rtol=1e-3)
                checked += 1
    assert checked == model.config.n_layers * len(sites) * len(NAMED)
