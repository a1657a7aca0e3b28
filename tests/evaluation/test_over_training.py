"""The short-conv read-outs of any mixer (mecheval.evaluation.over_training): the convs are the
sites each layer's mixer declares in `conv_sites`, not the zoo's site names; the evaluation
records them, and the report's "Inside the short convs" shows them."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mecheval import cli
from mecheval.evaluation.analysis import conv_readouts
from mecheval.evaluation.over_training import (
    _conv_readouts,
    conv_column,
    conv_sites,
    is_conv_cell,
    readout_grids,
)
from mecheval.models import build_model
from mecheval.run_folder.files import (
    EXAMPLES,
    INTERVENTIONS,
    INTERVENTIONS_STAMP,
    evaluated_conv_sites,
    write_stamped,
)
from mecheval.tasks import make_task
from tests.helpers import TINY

ARCH = "tests.evaluation.conv_mixer:ShortConvAttention"
CONVS = ("q_short", "k_short", "v_short")
POSITIONS = ("value", "value+1", "value+2")


def test_the_readout_grid_covers_the_declared_convs_of_a_mixer_of_ones_own():
    task = make_task("ar", num_pairs=4, num_keys=16)
    batch = task.sample(8, seed=0, split="dev")
    model = build_model(ARCH, task.vocab_size, 16, max_len=batch.tokens.shape[1]).eval()
    assert conv_sites(model) == {0: list(CONVS), 1: list(CONVS)}
    grid = readout_grids(model, batch, task.corrupt(batch, "key", seed=0))
    conv = grid[is_conv_cell(grid, conv_sites(model))]
    assert set(zip(conv["site"], conv["layer"], conv["position"], strict=True)) == {
        (site, layer, position) for site in CONVS for layer in (0, 1) for position in POSITIONS
    }
    got = _conv_readouts(grid, conv_sites(model))
    assert set(got) == {
        conv_column(layer, position, site)
        for site in CONVS
        for layer in (0, 1)
        for position in POSITIONS
    }
    # Each read-out is the Attrib of its cells: (restored - corrupted) / (original -
    # corrupted), mean probabilities, NaN where the corruption moves too little.
    cells = conv[(conv["site"] == "k_short") & (conv["layer"] == 1)]
    cells = cells[cells["position"] == "value+1"]
    po, pc, pr = (cells[c].mean() for c in ("p_original", "p_corrupted", "p_restored"))
    want = (pr - pc) / (po - pc) if po - pc > 0.01 else float("nan")
    assert got["k_short_l1_value+1"] == pytest.approx(want, nan_ok=True)


def test_recorded_conv_sites_pick_the_cells_and_unrecorded_ones_fall_back_to_zoo_names():
    rows = [
        {"layer": layer, "site": site, "position": "value", "example": 0}
        for layer in (0, 1)
        for site in ("conv_output", "q_short", "block_input")
    ]
    grid = pd.DataFrame(rows)
    declared = {"0": ["q_short"], "1": []}  # as JSON keeps it
    assert list(grid[is_conv_cell(grid, declared)]["site"]) == ["q_short"]
    assert list(grid[is_conv_cell(grid, None)]["site"]) == ["conv_output", "conv_output"]
    assert conv_readouts(grid.assign(p_original=1.0, p_corrupted=0.0, p_restored=0.5,
                                     position_index=0, logit_restored=0.0, kl=0.0),
                         {"0": []}) == {}  # fmt: skip


def test_the_report_shows_the_short_convs_of_a_mixer_of_ones_own(tmp_path):
    """Before: the report's "Inside the short convs" showed nothing for a mixer whose convs
    were not named as the zoo's."""
    run = tmp_path / "runs" / "own"
    steps = ["steps=4", "eval_every=2", "checkpoint_every=2"]
    assert cli.main(["train", "--out", str(run), *TINY, *steps, f"arch={ARCH}"]) == 0
    assert cli.main(["evaluate", str(run), "--positions", "key", "value", "value+1",
                     "value+2", "query"]) == 0  # fmt: skip
    assert evaluated_conv_sites(run) == {0: list(CONVS), 1: list(CONVS)}
    over = pd.read_parquet(run / "readouts_over_training.parquet")
    assert {"q_short_value+1", "v_short_l1_value"} <= set(over)
    # Four steps teach it nothing (every Attrib is undefined): give the corruption an effect
    # and each cell half of it, rewritten as evaluation writes it (tables, then stamp).
    grid = pd.read_parquet(run / INTERVENTIONS)
    grid = grid.assign(p_original=0.9, p_corrupted=0.1, p_restored=0.5)
    stamp = json.loads((run / INTERVENTIONS_STAMP).read_text())
    examples = pd.read_parquet(run / EXAMPLES)
    write_stamped(run, INTERVENTIONS_STAMP, {INTERVENTIONS: grid, EXAMPLES: examples}, stamp)
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    section = report.split("## Inside the short convs")[1].split("\n## ")[0]
    shown = [line.split("|") for line in section.splitlines() if line.startswith("| ")][1:]
    assert {(int(cells[4]), cells[5].strip()) for cells in shown} == {
        (layer, conv) for layer in (0, 1) for conv in CONVS
    }
