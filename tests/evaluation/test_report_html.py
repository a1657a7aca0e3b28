"""report.html as a reader meets it: opened in headless Chromium at 1400 x 900 px, its first
screen holds the overview figure, every image loads, no table runs off the page (a table too
wide for it scrolls in its own box), the figure's links land on the heatmaps; missing values
are blank and a section not run names the command that runs it."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from mecheval.evaluation.display import Section, conv_display, mechanism_display
from mecheval.evaluation.findings import findings_table
from mecheval.evaluation.overview import write_overview
from mecheval.evaluation.plots import heatmap
from mecheval.evaluation.report_html import Page, write_html
from mecheval.interventions import readout_cells
from tests.evaluation.browser import CHROMIUM, measure
from tests.evaluation.synthetic import attrib_cells, study_like

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it",
)
DAS_MISSING = "DAS has not run on these runs: `mecheval das runs/x` runs it (docs/das.md)."


def _page(out) -> tuple[Page, pd.DataFrame]:
    """A page of the study-like evidence: findings, mechanism and conv tables (two settings),
    a table too wide for any page, a DAS section not run, two heatmaps."""
    evidence = study_like()
    findings = findings_table(evidence[evidence["n_layers"] == 2])
    anchors = {"ar-attention-d64-l2": "heatmap_a", "ar-mamba-d64-l2": "heatmap_b"}
    _, svg = write_overview(evidence, findings, out, {r: f"#{a}" for r, a in anchors.items()})
    cells, grid = attrib_cells()
    heatmaps = []
    for anchor in anchors.values():
        fig = heatmap(cells, f"{anchor}\nar(), 3,000 steps", readout_cells(2), grid)
        fig.save_png(out / f"{anchor}.png")
        heatmaps.append((anchor, fig.svg(), f"{anchor}.png"))
        fig.close()
    wide = pd.DataFrame(
        np.arange(3 * 40).reshape(3, 40) / 7, columns=[f"column_{i}" for i in range(40)]
    )
    wide.iloc[1, 3] = np.nan
    sections = [
        Section("Findings", "findings", "", findings),
        Section("Mechanism", "mechanism", "", mechanism_display(evidence), split=True),
        Section("Convs", "convs", "", conv_display(evidence), split=True),
        Section("Wide", "wide", "", wide),
        Section("Where the association lives (DAS: k*)", "das", "", pd.DataFrame(), DAS_MISSING),
    ]
    page = Page("2 run folders.", svg, "the caption", sections, heatmaps, ["overview.png"])
    return page, evidence


def test_missing_values_are_blank_and_a_section_not_run_names_its_command(tmp_path):
    page, _ = _page(tmp_path)
    text = write_html(tmp_path, page).read_text()
    cells = re.findall(r"<td[^>]*>(.*?)</td>", text, flags=re.S)
    assert cells and not [c for c in cells if c in ("nan", "NaN", "&lt;NA&gt;", "None", "<NA>")]
    assert '<td class="num"></td>' in text  # the wide table's gap
    assert f'<p class="missing">{DAS_MISSING}</p>' in text
    # The findings: a line per model, the full evidence behind a click.
    assert text.count("<details><summary>intervals, seeds, every setting</summary>") == 5
    assert (
        "<li>attention d64: acc 1.00, induction 0.93, direct_early 0.01, direct_late 0.02" in text
    )
    assert "<script" not in text  # no server, no script


@needs_chromium
def test_the_page_renders_in_chromium(tmp_path):
    page, _ = _page(tmp_path)
    m = measure(write_html(tmp_path, page))
    width, height = m["viewport"]
    assert width == 1400
    assert m["images"] and all(image["loaded"] for image in m["images"]), m["images"]
    assert m["page_width"] <= width  # nothing runs off the page...
    for table in m["tables"]:
        assert table["box"]["right"] <= width, table
        if table["head"] != "column_0":
            assert table["right"] <= width, table  # ...and every table but the too wide one fits
    wide = next(t for t in m["tables"] if t["head"] == "column_0")
    assert wide["width"] > wide["box"]["width"]  # it scrolls in its own box
    figure = m["figure"]
    assert figure["top"] >= 0 and figure["bottom"] <= height and figure["width"] > 1000, figure
    assert m["links"] == ["#heatmap_a", "#heatmap_b"]
    assert {"heatmap_a", "heatmap_b"} <= set(m["ids"])
    heatmaps = [s for s in m["svgs"] if s["id"].startswith("heatmap_")]
    assert len(heatmaps) == 2 and all(s["width"] > 400 for s in heatmaps)
