"""task_stats and stats_table against statistics computed directly from the documents."""

import numpy as np
import pytest

from mecheval.tasks import across_grammar_seeds, make_task, stats_table, task_stats


def test_ar_statistics_match_the_layout():
    stats = task_stats(make_task("ar"), n=2000, seed=0)
    assert stats["length"]["mean"] == 37 and stats["length"]["std"] == 0
    assert stats["sentence_length"]["min"] == stats["sentence_length"]["max"] == 32
    assert stats["key_to_value"]["min"] == stats["key_to_value"]["max"] == 1
    # Query at 34, key at 1 + 2j with j uniform in 0..15: distance 33 - 2j, mean 18.
    query_to_key = stats["query_to_key"]
    assert query_to_key["min"] >= 3 and query_to_key["max"] <= 33
    assert abs(query_to_key["mean"] - 18) < 5 * (2 * (255 / 12) ** 0.5) / 2000**0.5


def test_atr_statistics_match_numpy_on_the_same_documents():
    task = make_task("atr", max_rhs_len=10, num_terminals=20)
    stats = task_stats(task, n=500, seed=4, split="dev")
    batch = task.sample(500, seed=4, split="dev")
    key = batch.positions["key"].numpy()
    direct = {
        "length": batch.lengths.numpy(),
        "sentence_length": batch.lengths.numpy() - 5,
        "key_to_value": batch.positions["value"].numpy() - key,
        "query_to_key": batch.positions["query"].numpy() - key,
    }
    for name, values in direct.items():
        summary = stats[name]
        assert np.isclose(summary["mean"], values.mean())
        assert np.isclose(summary["std"], values.std(ddof=1))
        assert np.isclose(summary["median"], np.quantile(values, 0.5))
        assert np.isclose(summary["q10"], np.quantile(values, 0.1))
        assert np.isclose(summary["q90"], np.quantile(values, 0.9))
        assert summary["min"] == values.min() and summary["max"] == values.max()
    assert stats["key_to_value"]["min"] >= 1


def test_stats_table_has_one_row_per_task():
    tasks = [make_task("ar"), make_task("atr", max_rhs_len=5, num_terminals=20)]
    table = stats_table(tasks, n=200)
    lines = table.splitlines()
    assert lines[0].split() == ["task", "length", "sentence_length", "key_to_value", "query_to_key"]
    assert lines[2].startswith("ar()") and lines[3].startswith(
        "atr(max_rhs_len=5, num_terminals=20)"
    )
    assert "37.0 ± 0.0" in lines[2]
    assert len(lines) == 5


def test_across_grammar_seeds_averages_the_per_grammar_means():
    task = make_task("atr", max_rhs_len=5, num_terminals=20, max_length=60)
    spread = across_grammar_seeds(task, [2, 5, 9], n=40, seed=1)
    lengths = [
        float(
            (
                make_task("atr", max_rhs_len=5, num_terminals=20, max_length=60, seed=s)
                .sample(40, seed=1)
                .lengths
                - 5
            )
            .double()
            .mean()
        )
        for s in (2, 5, 9)
    ]
    summary = spread["sentence_length"]
    assert np.allclose(summary["per_seed"], lengths)
    assert np.isclose(summary["mean"], np.mean(lengths))
    assert np.isclose(summary["std"], np.std(lengths, ddof=1))
    assert summary["min"] == min(lengths) and summary["max"] == max(lengths)
    assert set(spread) == {"length", "sentence_length", "key_to_value", "query_to_key"}
    with pytest.raises(ValueError, match="grammar seed"):
        across_grammar_seeds(make_task("ar"), [0, 1])


def test_stats_table_adds_the_spread_across_grammar_seeds_for_atr_only():
    tasks = [make_task("ar"), make_task("atr", max_rhs_len=5, num_terminals=20, seed=3)]
    table = stats_table(tasks, n=100, grammar_seeds=4)
    lines = table.splitlines()
    assert lines[5] == "" and lines[6].split() == [
        "task",
        "grammar",
        "seeds",
        "sentence_length",
        "key_to_value",
    ]
    row = lines[8]
    assert row.startswith("atr(max_rhs_len=5, num_terminals=20)") and "3..6" in row
    spread = across_grammar_seeds(tasks[1], range(3, 7), n=100)
    summary = spread["sentence_length"]
    assert f"{summary['mean']:.2f} ± {summary['std']:.2f}" in row
    assert len(lines) == 10
    assert stats_table(tasks, n=100) == "\n".join(lines[:5])
