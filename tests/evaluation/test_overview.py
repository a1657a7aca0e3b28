"""The report's first figure: an architecture per row at its most accurate width, its
read-outs with their intervals, layer 0's highest conv, the findings beside their task; the
SVG shows each value on hover and links each architecture to its heatmap."""

from __future__ import annotations

import re

import matplotlib.image
import pandas as pd
import pytest

from mecheval.evaluation.findings import findings_table
from mecheval.evaluation.overview import layout, overview_table, short_claim, write_overview
from tests.evaluation.synthetic import AR, ATR, study_like


def _findings(evidence: pd.DataFrame) -> pd.DataFrame:
    return findings_table(evidence[evidence["n_layers"] == 2])


def test_a_row_per_architecture_at_its_most_accurate_width():
    table = overview_table(study_like())
    assert list(zip(table["task"], table["arch"], strict=True)) == [
        *[("ar", a) for a in ("attention", "based", "mamba", "mamba_noconv", "deltanet")],
        ("ar", "h3"),
        ("ar", "hyena"),
        *[("atr", a) for a in ("attention", "based", "mamba_noconv")],
    ]
    rows = table.set_index(["task", "arch"])
    assert rows.loc[("ar", "attention"), "d_model"] == 64  # 1.00 beats d32's 0.90
    assert rows.loc[("ar", "mamba"), "direct_early"] == 0.72  # the 2-layer model, not 3
    assert rows.loc[("ar", "attention"), "induction_seeds_low"] == pytest.approx(0.83)
    # Layer 0's conv: the highest of DeltaNet's three, named; blank without a conv.
    assert rows.loc[("ar", "deltanet"), "conv@value+1"] == 0.5
    assert rows.loc[("ar", "deltanet"), "conv@value+1_site"] == "k_conv"
    assert rows.loc[("ar", "deltanet"), "conv@value+1_low"] == pytest.approx(0.47)
    assert rows.loc[("ar", "mamba"), "conv@value+1_site"] == "conv"
    assert pd.isna(rows.loc[("ar", "attention"), "conv@value+1"])
    assert overview_table(pd.DataFrame()).empty


def test_unevaluated_models_are_left_out_and_a_task_without_models_still_shows_its_findings():
    evidence = study_like()
    evidence.loc[evidence["arch"] == "h3", "mechanism"] = None  # trained, not evaluated
    evidence = evidence[evidence["task"] == "ar"]
    table = overview_table(evidence)
    assert "h3" not in set(table["arch"])
    items = layout(table, _findings(evidence))
    kinds = [(kind, what if isinstance(what, str) else None) for kind, _, what in items]
    assert ("task", "atr") in kinds and ("none", "atr") in kinds
    assert [int(w["finding"]) for k, _, w in items if k == "finding"] == [1, 2, 3, 4, 5]
    ys = [y for _, y, _ in items if _ is not None]
    assert items[-1][0] == "end" and items[-1][1] > max(ys[:-1])


def test_the_svg_shows_every_value_on_hover_and_links_to_the_heatmaps(tmp_path):
    evidence = study_like()
    findings = _findings(evidence)
    links = {"ar-mamba-d64-l2": "#heatmap_ar_mamba"}
    name, svg = write_overview(evidence, findings, tmp_path, links)
    titles = re.findall(r"<title>(.*?)</title>", svg, flags=re.S)
    table = overview_table(evidence)
    # A dev-accuracy box and six Attrib cells per row, a badge per finding.
    assert len(titles) == 7 * len(table) + len(findings)
    induction = next(
        t for t in titles if t.startswith(f"attention d64 ({AR})\nlayer 1 block input at value")
    )
    assert "Attrib 0.930, 95% interval [0.88, 0.97] over documents" in induction
    assert "[0.83, 1.01] over 2 seeds and documents" in induction
    deltanet = next(t for t in titles if t.startswith("deltanet") and "k_conv output" in t)
    assert "at value+1" in deltanet and "Attrib 0.500" in deltanet
    # Blank cells: the convs each row lacks (AR: 3, 2, 2, 3, 2, 3, 3; ATR: 3 each).
    assert sum(": no read-out" in t for t in titles) == 18 + 9
    assert any(t.startswith(f"mamba_noconv d64 ({ATR})\nlayer 1 block input") for t in titles)
    assert re.search(r'<a xlink:href="#heatmap_ar_mamba">', svg)
    verdicts = [t for t in titles if t.startswith("Finding ")]
    assert [v.split(":")[0] for v in verdicts] == [f"Finding {n}" for n in range(1, 6)]
    assert all(
        f"Finding {r.finding}: {r.verdict}\n" in v
        for r, v in zip(findings.itertuples(), verdicts, strict=True)
    )
    png = matplotlib.image.imread(tmp_path / name)
    assert png.shape[1] > 1200 and png.shape[0] > 500  # 110 dpi, 13 inches wide


def test_a_model_whose_answer_the_corruption_leaves_alone_says_so(tmp_path):
    evidence = study_like()
    noconv = evidence["arch"] == "mamba_noconv"
    for name in ("induction", "direct_early", "direct_late"):
        evidence.loc[noconv, [name, f"{name}_low", f"{name}_high"]] = float("nan")
    evidence.loc[noconv, "mechanism"] = "no effect"  # as mecheval.interventions.readout labels it
    _, svg = write_overview(evidence, _findings(evidence), tmp_path, {})
    assert svg.count("no effect: the corrupted key changes no answer") == 2  # AR and ATR
    assert svg.count("no read-out (corrupting the key leaves the model&#x27;s answer") == 6


def test_short_claims_drop_the_task_and_the_detail():
    assert short_claim("AR: attention and Based solve it by induction (Attrib at value)") == (
        "Attention and Based solve it by induction"
    )
