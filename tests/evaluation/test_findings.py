"""The findings table: verdicts follow from the evidence (reproduced, not reproduced, not run),
one row per finding, with the study's numbers beside ours."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from mecheval.config import to_dict
from mecheval.evaluation.findings import (
    FINDINGS,
    NOT_AT_SCALE,
    NOT_REPRODUCED,
    NOT_RUN,
    REPRODUCED,
    findings_table,
    smallest_settings,
)
from mecheval.evaluation.results import task_setting
from mecheval.evaluation.study_numbers import at_study_scale
from mecheval.sweep import expand_sweep

pytestmark = pytest.mark.pipeline


def model(task, arch, acc, mechanism=None, d_model=64, **readouts):
    row = {"task": task, "arch": arch, "d_model": d_model, "dev_accuracy": acc}
    if mechanism is not None:
        row.update(mechanism=mechanism, induction=0.0, direct_early=0.0, direct_late=0.0)
    row.update(readouts)
    return row


STUDY_LIKE = [
    model("ar", "attention", 1.0, "induction", induction=0.95, induction_low=0.9, induction_high=1),
    model("ar", "based", 0.99, "induction", induction=0.9),
    model("ar", "h3", 0.02),
    model("ar", "hyena", 0.03),
    model("ar", "mamba", 0.81, "direct_early", direct_early=0.8, **{"conv_value+1": 0.9}),
    model("ar", "deltanet", 0.7, "direct_late", direct_late=0.7),
    model("ar", "mamba_noconv", 0.02),
    model("atr", "attention", 0.9, "induction", induction=1.0),
    model("atr", "based", 0.9, "induction", induction=1.0),
    model("atr", "mamba_noconv", 0.8, "induction", induction=0.8),
]


def test_the_studys_pattern_reproduces_every_finding():
    table = findings_table(pd.DataFrame(STUDY_LIKE))
    assert list(table["finding"]) == [1, 2, 3, 4, 5]
    assert list(table["verdict"]) == [REPRODUCED] * 5
    assert len(FINDINGS) == 5 and all(table["study"].str.len() > 10)
    first = table.iloc[0]["ours"]
    assert "attention d64: acc 1.00, induction 0.95 [0.90, 1.00]" in first


def test_contradicting_evidence_is_not_reproduced():
    rows = [dict(r) for r in STUDY_LIKE]
    rows[1].update(mechanism="direct_early")  # Based reads out as direct retrieval
    rows[3].update(dev_accuracy=0.9)  # Hyena solves AR
    rows[4]["conv_value+1"] = 0.1  # Mamba's conv carries nothing
    rows[6].update(dev_accuracy=0.6)  # Mamba without conv solves AR
    rows[9].update(mechanism="direct_late")
    table = findings_table(pd.DataFrame(rows))
    assert list(table["verdict"]) == [NOT_REPRODUCED] * 5


def test_missing_models_are_not_run_and_the_most_accurate_width_counts():
    rows = [r for r in STUDY_LIKE if r["arch"] not in ("h3", "based")]
    rows.append(model("ar", "hyena", 0.9, d_model=16))  # its most accurate width is d16
    table = findings_table(pd.DataFrame(rows)).set_index("finding")
    assert table.loc[1, "verdict"] == NOT_RUN and "based" in table.loc[1, "ours"]
    assert table.loc[2, "verdict"] == NOT_RUN and "h3" in table.loc[2, "ours"]
    only_hyena = [r for r in rows if r["arch"] != "h3"]
    only_hyena.append(model("ar", "h3", 0.01))
    table = findings_table(pd.DataFrame(only_hyena)).set_index("finding")
    assert table.loc[2, "verdict"] == NOT_REPRODUCED  # Hyena d16 at 0.9 solves AR
    # An unevaluated model (no read-out) cannot support a mechanism finding.
    unevaluated = [dict(r) for r in STUDY_LIKE]
    unevaluated[0] = model("ar", "attention", 1.0)
    assert findings_table(pd.DataFrame(unevaluated)).iloc[0]["verdict"] == NOT_RUN


def test_a_failure_counts_only_where_attention_solves_the_task():
    untrained = [dict(r) for r in STUDY_LIKE]
    untrained[0].update(dev_accuracy=0.05)  # nothing learns this setting: H3 failing says nothing
    table = findings_table(pd.DataFrame(untrained)).set_index("finding")
    assert table.loc[2, "verdict"] == NOT_REPRODUCED and table.loc[4, "verdict"] == NOT_REPRODUCED
    assert "attention d64: acc 0.05" in table.loc[2, "ours"]
    no_attention = [r for r in STUDY_LIKE if (r["task"], r["arch"]) != ("ar", "attention")]
    table = findings_table(pd.DataFrame(no_attention)).set_index("finding")
    assert table.loc[2, "verdict"] == NOT_RUN and "attention" in table.loc[2, "ours"]


def test_each_task_setting_is_judged_on_its_own():
    toy, study = "ar(num_pairs=4, num_keys=16)", "ar()"
    rows = [dict(r, setting=study if r["task"] == "ar" else "atr()") for r in STUDY_LIKE]
    rows = [r for r in rows if r["arch"] not in ("h3", "hyena")]
    rows += [
        dict(model("ar", "h3", 0.86), setting=toy),  # H3 and Hyena solve the toy task...
        dict(model("ar", "hyena", 0.9), setting=toy),
        dict(model("ar", "attention", 1.0, "induction", induction=1.0), setting=toy),
    ]
    table = findings_table(pd.DataFrame(rows)).set_index("finding")
    assert table.loc[2, "verdict"] == NOT_REPRODUCED
    assert f"{toy} (not reproduced)" in table.loc[2, "ours"]
    assert f"{study} (not run at this scale)" in table.loc[2, "ours"]
    rows += [  # ... and fail the study's, which decides
        dict(model("ar", "h3", 0.02), setting=study),
        dict(model("ar", "hyena", 0.03), setting=study),
    ]
    table = findings_table(pd.DataFrame(rows)).set_index("finding")
    assert table.loc[2, "verdict"] == REPRODUCED
    ours = table.loc[2, "ours"]
    assert ours.index(f"{study} (reproduced)") < ours.index(f"{toy} (not reproduced)")
    # Based only ran on the study's task: finding 1 is judged there, not on the toy task
    # where attention ran alone.
    assert (
        table.loc[1, "verdict"] == REPRODUCED
        and f"{toy} (not run at this scale)" in (table.loc[1, "ours"])
    )


def test_a_finding_missing_only_in_smaller_runs_is_not_reproduced_at_this_scale():
    rows = [dict(r) for r in STUDY_LIKE]
    rows[3].update(dev_accuracy=0.9)  # Hyena solves AR ...
    small = findings_table(pd.DataFrame([dict(r, study_scale=False) for r in rows]))
    assert small.set_index("finding").loc[2, "verdict"] == NOT_AT_SCALE
    full = findings_table(pd.DataFrame([dict(r, study_scale=True) for r in rows]))
    assert full.set_index("finding").loc[2, "verdict"] == NOT_REPRODUCED  # ... at full scale
    assert (small.set_index("finding").loc[[1, 3, 4, 5], "verdict"] == REPRODUCED).all()


def test_study_scale_is_the_studys_task_setting_and_length():
    assert at_study_scale("ar", {}, 50_016)
    assert not at_study_scale("ar", {}, 3_000)
    assert not at_study_scale("ar", {"num_pairs": 4, "num_keys": 16}, 50_016)
    assert at_study_scale("atr", {"max_rhs_len": 5, "num_terminals": 20}, 100_032)
    assert not at_study_scale("atr", {"max_rhs_len": 5, "num_terminals": 20}, 30_000)
    assert not at_study_scale("atr", {"max_rhs_len": 7, "num_terminals": 20}, 100_032)


def test_every_findings_smallest_setting_is_one_its_config_trains():
    repo = Path(__file__).resolve().parents[2]
    table = findings_table(pd.DataFrame(STUDY_LIKE))
    assert set(smallest_settings()) == {1, 2, 3, 4, 5}
    for number, (setting, config) in smallest_settings().items():
        spec = yaml.safe_load((repo / config).read_text())
        runs = expand_sweep(spec.get("sweep", spec))
        trained = {task_setting(to_dict(r.config.task), r.config.total_steps) for r in runs}
        assert setting in trained, (number, config, sorted(trained))
        assert table.set_index("finding").loc[number, "smallest_setting"] == f"{setting} ({config})"


def test_with_seeds_a_model_behaves_as_found_only_in_most_of_them():
    rows = [dict(r, lr=1e-2, seed=44) for r in STUDY_LIKE]
    mamba = next(r for r in rows if r["arch"] == "mamba")
    mamba["conv_value+1"] = 0.0  # the most accurate seed forms the association elsewhere
    others = [dict(mamba, seed=s, dev_accuracy=0.75, **{"conv_value+1": 0.98}) for s in (42, 43)]
    evidence = pd.DataFrame(rows)
    alone = findings_table(evidence).set_index("finding")
    assert alone.loc[3, "verdict"] == NOT_REPRODUCED  # judged on seed 44 alone
    table = findings_table(evidence, pd.DataFrame([*rows, *others])).set_index("finding")
    assert table.loc[3, "verdict"] == REPRODUCED
    assert "[as found in 2 of 3 seeds (42, 43)]" in table.loc[3, "ours"]
    assert "acc 0.81" in table.loc[3, "ours"]  # the selected (most accurate) seed is described
    one_of_three = [others[0], dict(others[1], **{"conv_value+1": 0.1})]
    table = findings_table(evidence, pd.DataFrame([*rows, *one_of_three])).set_index("finding")
    assert table.loc[3, "verdict"] == NOT_REPRODUCED
    assert "[as found in 1 of 3 seeds (42)]" in table.loc[3, "ours"]
    assert (table.loc[[1, 2, 4, 5], "verdict"] == REPRODUCED).all()  # single-seed models as before
