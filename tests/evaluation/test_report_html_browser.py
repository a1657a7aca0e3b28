"""The report of a trained model as a reader meets it: report.html in headless Chromium at
1400 x 900 px (tests/evaluation/browser.py). Its first screen holds the overview figure, whose
hover text carries the read-outs the evidence table stores and whose architecture links to its
heatmap; every image loads; every table fits the page; the DAS section of a job that ran no
DAS names the command that runs it."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from mecheval.evaluation.evaluate import evaluate_all
from mecheval.evaluation.report import build_report
from tests.evaluation.browser import CHROMIUM, measure

pytestmark = pytest.mark.pipeline


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it",
)
def test_the_report_of_a_trained_model_reads_in_a_browser(trained, tmp_path):
    run, _ = trained
    evaluate_all(run, progress=False)
    out = build_report(run, out=tmp_path / "report")
    page = (out / "report.html").read_text()
    evidence = pd.read_parquet(out / "evidence.parquet").iloc[0]
    title = re.search(r"<title>(attention d64 \([^<]*\)\nlayer 1 block input at value[^<]*)<", page)
    low, high = evidence["induction_low"], evidence["induction_high"]
    assert f"Attrib {evidence['induction']:.3f}, 95% interval [{low:.2f}, {high:.2f}]" in title[1]
    assert f"DAS has not run on these runs: `mecheval das {run}` runs it" in page
    m = measure(out / "report.html")
    width, height = m["viewport"]
    names = {image["src"] for image in m["images"]}
    assert {"over_training.png", "value_vs_query.png"} <= names
    assert all(image["loaded"] for image in m["images"]), m["images"]
    assert m["page_width"] <= width
    assert m["tables"] and all(table["right"] <= width for table in m["tables"]), m["tables"]
    figure = m["figure"]
    assert figure["top"] >= 0 and figure["bottom"] <= height, figure
    (link,) = m["links"]
    assert link.startswith("#heatmap_ar_attention_d64_l2_") and link[1:] in m["ids"]
