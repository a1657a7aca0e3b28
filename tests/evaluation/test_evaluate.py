"""A small attention model trained once, then checked end to end: it learns AR, the batched
grid equals the per-cell loop on it, and its mechanism read-out is induction (docs/study.md)."""

from __future__ import annotations

import numpy as np
import pytest

from mecheval.evaluation.evaluate import evaluate_run
from mecheval.evaluation.report import build_report
from mecheval.interventions import interchange_grid, per_cell_loop, readout
from mecheval.run_folder.weights import load_trained_model

pytestmark = pytest.mark.pipeline


def test_attention_learns_associative_recall(trained):
    _, result = trained
    assert result["dev_accuracy"] >= 0.95, result
    assert result["test_accuracy"] >= 0.95, result


def test_grid_matches_the_per_cell_loop_on_a_trained_model(trained):
    run, _ = trained
    model, task, _ = load_trained_model(run)
    batch = task.dataset("dev", size=16)
    corrupted = task.corrupt(batch, "key", seed=1)
    fast = interchange_grid(model, batch, corrupted, positions=["key", "value", "query", "value+1"])
    slow = per_cell_loop(model, batch, corrupted, positions=["key", "value", "query", "value+1"])
    merged = fast.merge(slow, on=["example", "layer", "site", "position"], suffixes=("", "_loop"))
    assert len(merged) == len(fast) == len(slow)
    for column in ("p_restored", "logit_restored", "kl"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_loop"], atol=1e-5, rtol=1e-4)


def test_trained_attention_solves_recall_by_induction(trained):
    run, _ = trained
    table = evaluate_run(run)
    assert set(table["corruption"]) == {"key", "value"}
    # Both corruptions draw key ids, as the study's evaluation does (docs/study.md).
    _, task, _ = load_trained_model(run)
    keys = f"{task.first_key}..{task.first_value - 1}"
    assert set(table.groupby("corruption")["replacement_ids"].unique().map(tuple)) == {(keys,)}
    key = table[table["corruption"] == "key"].drop(
        columns=[
            *("run", "arch", "d_model", "n_layers", "lr", "task", "accuracy", "corruption"),
            "replacement_ids",
        ]
    )
    scores = readout(key).iloc[0]
    assert scores["mechanism"] == "induction", scores.to_dict()
    assert scores["induction"] > 0.8 > scores["direct_early"]
    # Attribution patching ranks the cells of a trained model much as exact patching does.
    from mecheval.interventions import attribution_patching, screening_correlation

    model, task, _ = load_trained_model(run)
    batch = task.dataset("dev", size=64)
    corrupted = task.corrupt(batch, "key", seed=0)
    sites = ["block_input", "mixer_output", "mlp_output", "block_output"]
    rho = screening_correlation(
        interchange_grid(model, batch, corrupted, sites=sites),
        attribution_patching(model, batch, corrupted, sites=sites),
    )
    assert rho > 0.5, rho
    # Evaluating again reuses the stored table.
    assert evaluate_run(run).equals(table)
    out = build_report(run)
    text = (out / "report.md").read_text()
    assert "induction" in text and (out / "report.html").exists()
    assert f"key replaced by ids {keys}; value replaced by ids {keys}" in text
    assert "mecheval's own rule" in text
    # The in-range value draw, without retraining; an option that is not a corruption option
    # is refused by name.
    own = evaluate_run(run, corruptions=["value"], corruption_options={"corruption_range": "own"})
    values = f"{task.first_value}..{task.vocab_size - 1}"
    assert set(own["replacement_ids"]) == {values}
    with pytest.raises(ValueError, match="num_keys"):
        evaluate_run(run, corruption_options={"num_keys": 8})
    assert list(out.glob("heatmap_ar_attention_*.png"))
