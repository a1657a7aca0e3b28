"""mecheval/evaluation/results.py: the best learning rate of each model, chosen by dev accuracy
(ties to the smaller rate), checked against a selection written out by hand; a setting's label
names the task's non-default options and the run's length."""

from __future__ import annotations

import pandas as pd

from mecheval.evaluation.results import best_runs, task_setting


def test_the_best_run_per_model_is_the_most_accurate_then_the_smallest_rate():
    rows = [
        # run, arch, d_model, lr, dev_accuracy
        ("a1", "attention", 64, 1e-3, 0.90),
        ("a2", "attention", 64, 3e-3, 0.99),
        ("a3", "attention", 64, 1e-2, 0.99),  # tie with a2: the smaller rate wins
        ("a4", "attention", 32, 1e-2, 0.50),  # another width: its own model
        ("m1", "mamba", 64, 1e-3, 0.10),
        ("m2", "mamba", 64, 1e-2, 0.80),
    ]
    results = pd.DataFrame(rows, columns=["run", "arch", "d_model", "lr", "dev_accuracy"])
    results = results.assign(task="ar", setting="ar(), 50,016 steps", n_layers=2)
    chosen = best_runs(results)
    assert sorted(chosen["run"]) == ["a2", "a4", "m2"]
    assert len(chosen) == results.groupby(["arch", "d_model"]).ngroups


def test_a_setting_names_the_options_that_differ_and_the_length():
    assert task_setting({"name": "ar"}, 50016) == "ar(), 50,016 steps"
    setting = task_setting({"name": "ar", "options": {"num_pairs": 4, "num_keys": 16}}, 3000)
    assert setting == "ar(num_pairs=4, num_keys=16), 3,000 steps"
