"""The Attrib heatmap of a run: a row per (layer, site), positions in document order, each
value in its cell and on hover, the read-outs boxed; its file name valid on every OS."""

from __future__ import annotations

import re

import pandas as pd

from mecheval.evaluation.plots import heatmap, heatmap_name, two_places
from mecheval.interventions import readout_cells
from tests.evaluation.synthetic import attrib_cells


def test_the_heatmap_puts_positions_in_document_order_and_shows_each_value():
    cells, grid = attrib_cells()
    fig = heatmap(cells, "attention d64\nar(), 3,000 steps", readout_cells(2), grid)
    svg = fig.svg()
    fig.close()
    labels = re.findall(r">(key|value|value\+1|query)</text>", svg)
    assert labels[:4] == ["key", "value", "value+1", "query"]
    titles = re.findall(r"<title>(.*?)</title>", svg, flags=re.S)
    assert len(titles) == len(cells)
    induction = "layer 1 block_input at value (induction): Attrib 0.900"
    assert any(t.startswith(induction) for t in titles)
    assert all("; 64 documents" in t and "p restored 0.500" in t for t in titles)
    boxed = [t for t in titles if "(" in t.split(":")[0]]
    assert len(boxed) == 3  # induction, direct_early, direct_late
    assert heatmap(cells.iloc[:0], "empty") is None


def test_heatmap_names_are_valid_file_names_and_keep_settings_apart():
    run = {
        "task": "ar",
        "arch": "examples.retention:DeclaredRetention",
        "d_model": 64,
        "n_layers": 2,
        "setting": "ar(), 50,016 steps",
    }
    name = heatmap_name(pd.Series(run))
    assert re.fullmatch(
        r"heatmap_ar_examples-retention-DeclaredRetention_d64_l2_[0-9a-f]{6}\.png", name
    )
    other = heatmap_name(pd.Series({**run, "setting": "ar(num_pairs=4), 3,000 steps"}))
    assert other != name and other.startswith(name[: -len("123456.png")])


def test_two_places_never_reads_minus_zero():
    assert [two_places(v) for v in (-0.004, 0.004, -0.006, 1.0)] == [
        "0.00",
        "0.00",
        "-0.01",
        "1.00",
    ]
