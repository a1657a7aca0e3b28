"""Mechanisms over training and per-document records: every kept checkpoint gets a row, the
final one equals the read-outs of the full evaluation grid, and documents record their
key-to-query distance and whether the model answers them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mecheval.evaluation.analysis import conv_readouts
from mecheval.evaluation.evaluate import EXAMPLES, evaluate_run
from mecheval.evaluation.over_training import (
    _conv_readouts,
    conv_column,
    evaluate_over_training,
    parse_conv_column,
)
from mecheval.interventions import attrib, readout

pytestmark = pytest.mark.pipeline

IDENTITY = ["run", "arch", "d_model", "n_layers", "lr", "task", "accuracy", "corruption"]


def test_every_kept_checkpoint_has_a_row_and_the_last_equals_the_full_grid(trained):
    run, _ = trained
    table = evaluate_over_training(run)
    assert list(table["step"]) == [600, 1200, 1800, 2400]
    full = evaluate_run(run)
    key = full[full["corruption"] == "key"].drop(columns=[*IDENTITY, "replacement_ids"])
    expected = readout(key).iloc[0]
    last = table.iloc[-1]
    for name in ("induction", "direct_early", "direct_late"):
        assert last[name] == pytest.approx(expected[name], abs=1e-6)
    assert last["mechanism"] == expected["mechanism"] == "induction"
    assert last["accuracy"] == pytest.approx(full["accuracy"].iloc[0])
    # Induction forms during training: the model answers more, and reads out more as induction,
    # at the end than at the first kept checkpoint.
    assert table["accuracy"].iloc[-1] > table["accuracy"].iloc[0]
    assert not any(c.startswith("conv_") for c in table)  # attention has no short conv
    # A second call reuses the stored table.
    assert evaluate_over_training(run).equals(table)


def test_conv_readouts_are_the_attrib_of_each_layers_conv_cells():
    rng = np.random.default_rng(0)
    rows = []
    cells_of = ((0, "conv_output"), (1, "conv_output"), (1, "block_input"))
    for example in range(30):
        po, pc = rng.uniform(0.5, 1), rng.uniform(0, 0.2)
        for position, fraction in (("value", 0.1), ("value+1", 0.9), ("value+2", 0.5)):
            for layer, site in cells_of:
                fraction = 1 - fraction if layer == 1 else fraction
                rows.append(
                    {
                        "example": example,
                        "layer": layer,
                        "site": site,
                        "position": position,
                        "p_original": po,
                        "p_corrupted": pc,
                        "p_restored": pc + fraction * (po - pc) + rng.normal(0, 0.05),
                    }
                )
    grid = pd.DataFrame(rows)
    got = _conv_readouts(grid)
    cells = attrib(grid.assign(position_index=0, logit_restored=0.0, kl=0.0))
    cells = cells[cells["site"] == "conv_output"].set_index(["layer", "position"])
    positions = ("value", "value+1", "value+2")
    assert set(got) == {f"conv_{p}" for p in positions} | {f"conv_l1_{p}" for p in positions}
    for position in positions:
        assert got[f"conv_{position}"] == pytest.approx(cells.loc[(0, position), "attrib"])
        assert got[f"conv_l1_{position}"] == pytest.approx(cells.loc[(1, position), "attrib"])
    assert got["conv_value+1"] > 0.8 and got["conv_l1_value"] > 0.8


def test_the_readout_grid_covers_every_layers_short_conv():
    from mecheval.evaluation.over_training import readout_grids
    from mecheval.models import build_model
    from mecheval.tasks import make_task

    task = make_task("ar", num_pairs=4, num_keys=16)
    batch = task.sample(8, seed=0, split="dev")
    model = build_model("mamba", task.vocab_size, 16, max_len=batch.tokens.shape[1]).eval()
    grid = readout_grids(model, batch, task.corrupt(batch, "key", seed=0))
    conv = grid[grid["site"] == "conv_output"]
    assert set(zip(conv["layer"], conv["position"], strict=True)) == {
        (layer, position) for layer in (0, 1) for position in ("value", "value+1", "value+2")
    }
    assert set(grid[grid["site"] != "conv_output"]["site"]) == {"block_input"}
    model = build_model("deltanet", task.vocab_size, 16, max_len=batch.tokens.shape[1]).eval()
    grid = readout_grids(model, batch, task.corrupt(batch, "key", seed=0))
    convs = {"q_conv_output", "k_conv_output", "v_conv_output"}
    assert set(grid["site"]) == convs | {"block_input"}
    assert set(_conv_readouts(grid)) == {
        conv_column(layer, position, site)
        for site in convs
        for layer in (0, 1)
        for position in ("value", "value+1", "value+2")
    }


def test_formation_steps_name_the_conv_that_forms_the_association_first():
    from mecheval.evaluation.analysis import formation_steps

    table = pd.DataFrame(
        {
            "run": "r",
            "setting": "s",
            "arch": "mamba",
            "d_model": 64,
            "step": [5000, 10000, 15000],
            "induction": [0.0, 0.0, 0.0],
            "direct_early": [0.1, 0.2, 0.3],
            "direct_late": [0.1, 0.6, 0.97],
            "conv_value+1": [0.0, 0.1, 0.0],
            "conv_l1_value": [0.2, 0.7, 0.97],
        }
    )
    row = formation_steps(table).iloc[0]
    assert row["direct_late_from"] == 10000 and pd.isna(row["induction_from"])
    assert row["first"] == "direct retrieval"
    assert row["conv_from"] == 10000 and row["conv_at"] == "conv_l1_value"
    no_conv = formation_steps(table.drop(columns=["conv_value+1", "conv_l1_value"])).iloc[0]
    assert pd.isna(no_conv["conv_from"]) and no_conv["conv_at"] is None


def test_the_reports_conv_readouts_name_each_layers_conv():
    rng = np.random.default_rng(1)
    rows = []
    for example in range(40):
        po, pc = rng.uniform(0.5, 1), rng.uniform(0, 0.2)
        for layer, carried_at in ((0, "value+1"), (1, "value")):
            for position in ("value", "value+1", "value+2"):
                fraction = 0.95 if position == carried_at else 0.0
                rows.append(
                    {
                        "example": example,
                        "layer": layer,
                        "site": "conv_output",
                        "position": position,
                        "p_original": po,
                        "p_corrupted": pc,
                        "p_restored": pc + fraction * (po - pc) + rng.normal(0, 0.02),
                        "position_index": 0,
                        "logit_restored": 0.0,
                        "kl": 0.0,
                    }
                )
    key_conv = [dict(row, site="k_conv_output", layer=0) for row in rows if row["layer"] == 1]
    got = conv_readouts(pd.DataFrame(rows + key_conv))
    assert got["conv_value+1"] == pytest.approx(0.95, abs=0.03)  # layer 0 keeps its old names
    assert got["conv_l1_value"] == pytest.approx(0.95, abs=0.03)
    assert got["k_conv_value"] == pytest.approx(0.95, abs=0.03)  # DeltaNet's key conv
    assert abs(got["conv_value"]) < 0.03 and abs(got["conv_l1_value+1"]) < 0.03
    for name in ("conv_value+1", "conv_l1_value", "k_conv_value"):
        assert got[f"{name}_low"] <= got[name] <= got[f"{name}_high"]
    for name in ("conv_value+1", "conv_l1_value", "k_conv_value", "q_conv_l1_value+2"):
        site, layer, position = parse_conv_column(name)
        assert conv_column(layer, position, site) == name
    assert parse_conv_column("conv_value_low") is None
    assert parse_conv_column("direct_early") is None

    from mecheval.evaluation.display import conv_display

    identity = {"setting": "ar()", "arch": "mix", "d_model": 64, "dev_accuracy": 0.9}
    table = conv_display(pd.DataFrame([identity | got]))
    assert list(zip(table["layer"], table["conv"], strict=True)) == [
        (0, "conv"),
        (0, "k_conv"),
        (1, "conv"),
    ]
    assert table["value+1"].iloc[0].startswith("0.9") and "[" in table["value+1"].iloc[0]
    assert table["value"].iloc[1].startswith("0.9")


def test_documents_record_distance_and_correctness(trained):
    run, _ = trained
    evaluate_run(run)
    examples = pd.read_parquet(run / EXAMPLES)
    assert len(examples) == 128
    # AR with 4 pairs: the query sits at 2P + 2 = 10, the queried key at 1 + 2j.
    assert set(examples["query_position"]) == {10}
    np.testing.assert_array_equal(
        examples["distance"], examples["query_position"] - examples["key_position"]
    )
    assert set(examples["distance"]) <= {3, 5, 7, 9}
    full = pd.read_parquet(run / "interventions.parquet")
    assert examples["correct"].mean() == pytest.approx(full["accuracy"].iloc[0])
    assert ((examples["p_answer"] > 0) & (examples["p_answer"] <= 1)).all()


def test_report_has_findings_over_training_and_distance(trained):
    from mecheval.evaluation.evaluate import evaluate_all
    from mecheval.evaluation.report import build_report

    run, _ = trained
    evaluate_all(run, progress=False)
    out = build_report(run, out=run.parent / "report_full")
    text = (out / "report.md").read_text()
    findings = pd.read_parquet(out / "findings.parquet")
    assert list(findings["finding"]) == [1, 2, 3, 4, 5]
    # Only attention ran: the findings that need other models are not run at this scale.
    assert set(findings["verdict"]) == {"not run at this scale"}
    assert text.index("## Findings") < text.index("## Accuracy")
    over = pd.read_parquet(out / "over_training.parquet")
    assert list(over["step"]) == [600, 1200, 1800, 2400]
    assert (out / "over_training.png").exists() and "## Mechanisms over training" in text
    distance = pd.read_parquet(out / "distance.parquet")
    examples = pd.read_parquet(run / EXAMPLES)
    assert distance["n"].sum() == len(examples)
    assert (distance["n"] * distance["accuracy"]).sum() == pytest.approx(examples["correct"].sum())
    evidence = pd.read_parquet(out / "evidence.parquet").iloc[0]
    assert evidence["induction_low"] <= evidence["induction"] <= evidence["induction_high"]
    assert "induction " in text and "[" in text  # read-outs printed with their intervals


def test_the_reports_tables_leave_missing_text_blank():
    from mecheval.evaluation.report import _markdown

    frame = pd.DataFrame({"conv_from": [5000.0, np.nan], "conv_at": ["conv_value", np.nan]})
    lines = _markdown(frame).splitlines()
    assert lines[2] == "| 5000 | conv_value |" and lines[3] == "|  |  |"
