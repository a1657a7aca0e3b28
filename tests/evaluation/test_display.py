"""How the report shows a table's cells (blank where missing, never <NA> or nan), splits a table
by task setting, and shortens the findings' evidence to a line per model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mecheval.evaluation.display import by_setting, cell_text, evidence_lines, short_line
from mecheval.evaluation.findings import NOT_AT_SCALE, NOT_RUN, REPRODUCED, findings_table
from tests.evaluation.synthetic import AR, model, study_like


def test_missing_values_are_blank_and_numbers_read_as_numbers():
    for missing in (None, math.nan, np.nan, pd.NA, pd.NaT):
        assert cell_text(missing) == ""
    steps = pd.Series([1500, None], dtype="Int64").astype(object)
    assert [cell_text(v, "induction_from") for v in steps] == ["1500", ""]
    assert cell_text(64.0, "d_model") == "64" and cell_text(2.0, "seeds") == "2"
    assert cell_text(3e-4, "lr") == "0.0003" and cell_text(1e-3, "lr") == "0.001"
    assert cell_text(0.98765, "dev_accuracy") == "0.988"
    assert cell_text(-0.00197, "direct_late") == "-0.002"
    assert cell_text(-0.0003, "direct_late") == "0.000"
    assert cell_text(True) == "yes" and cell_text("two\nlines |") == "two lines |"


def test_tables_split_by_task_setting_in_order():
    table = pd.DataFrame(
        {"task": ["ar", "atr", "ar"], "setting": ["s1", "s2", "s1"], "arch": ["a", "b", "c"]}
    )
    parts = list(by_setting(table))
    assert [setting for setting, _ in parts] == ["s1", "s2"]
    assert list(parts[0][1].columns) == ["arch"] and list(parts[0][1]["arch"]) == ["a", "c"]
    assert [s for s, _ in by_setting(pd.DataFrame({"arch": ["a"]}))] == [""]


def test_the_findings_evidence_is_a_line_per_model_deciding_setting_first():
    evidence = study_like()
    evidence = evidence[evidence["n_layers"] == 2]
    # A second AR setting in which attention and Based were run, Based reading out directly.
    small = "ar(num_pairs=2, num_keys=8), 500 steps"
    extra = [
        model("ar", small, "attention", 1.0, (0.9, 0.0, 0.0)),
        model("ar", small, "based", 0.95, (0.1, 0.8, 0.0)),
    ]
    # Attention on AR ran with two seeds, both by induction.
    attention = evidence[(evidence["arch"] == "attention") & (evidence["setting"] == AR)]
    seeds = pd.concat([attention, attention.assign(seed=1, induction=0.85)])
    findings = findings_table(pd.concat([evidence, pd.DataFrame(extra)]), seeds)
    first = findings.set_index("finding").loc[1]
    assert first["verdict"] == REPRODUCED
    parts = evidence_lines(first["ours"])
    assert [(setting, verdict) for setting, verdict, _ in parts] == [
        (AR, REPRODUCED),
        (small, NOT_AT_SCALE),
    ]
    lines = parts[0][2]
    assert lines == [
        "attention d64: acc 1.00, induction 0.93 [0.88, 0.97], direct_early 0.01 [-0.04, 0.05], "
        "direct_late 0.02 [-0.03, 0.06] [as found in 2 of 2 seeds (0, 1)]",
        "based d64: acc 0.99, induction 0.88 [0.83, 0.92], direct_early 0.02 [-0.03, 0.06], "
        "direct_late 0.00 [-0.05, 0.04]",
    ]
    assert [short_line(line) for line in lines] == [
        "attention d64: acc 1.00, induction 0.93, direct_early 0.01, direct_late 0.02 "
        "(2 of 2 seeds)",
        "based d64: acc 0.99, induction 0.88, direct_early 0.02, direct_late 0.00",
    ]
    # Finding 3 ends with Mamba's conv read-outs, a line of their own.
    third = evidence_lines(findings.set_index("finding").loc[3, "ours"])[0][2]
    assert short_line(third[-1]) == "mamba layer-0 conv output: conv_value+1 0.71, conv_value+2 n/a"
    # A finding that needs models not run: one line naming them.
    missing = findings_table(evidence[evidence["arch"] != "h3"]).set_index("finding").loc[2]
    assert missing["verdict"] == NOT_RUN
    assert evidence_lines(missing["ours"])[0][2] == ["no (evaluated) AR run of h3"]
