"""Read-outs and accuracies pooled over seeds pool runs of one configuration only: the same
task instance, run length, model and learning rate."""

from __future__ import annotations

import pandas as pd
import pytest

from mecheval.evaluation.analysis import seed_runs, seed_siblings
from mecheval.evaluation.results import with_seed_spread

pytestmark = pytest.mark.pipeline


def test_seed_siblings_share_everything_but_the_seed():
    base = dict(task_label="ar", steps=3000, arch="mamba", d_model=64, n_layers=2, lr=1e-3)
    results = pd.DataFrame(
        [
            dict(base, run="a", seed=0, evaluated=True),
            dict(base, run="b", seed=1, evaluated=True),
            dict(base, run="c", seed=2, evaluated=False),  # not evaluated: nothing to pool
            dict(base, run="d", seed=0, evaluated=True, steps=6000),  # another length
            dict(base, run="e", seed=0, evaluated=True, lr=3e-3),
            dict(base, run="f", seed=0, evaluated=True, task_label="ar (another draw)"),
        ]
    )
    assert list(seed_siblings(results.iloc[0], results)["run"]) == ["a", "b"]
    assert list(seed_siblings(results.iloc[3], results)["run"]) == ["d"]
    # The findings judge each selected run over these: every evaluated seed, each run once.
    assert list(seed_runs(results.iloc[[1, 0, 4]], results)["run"]) == ["a", "b", "e"]


def test_the_accuracy_table_gives_each_configuration_its_spread_over_finished_seeds():
    base = dict(task_label="ar", steps=3000, arch="mamba", d_model=64, n_layers=2, lr=1e-2)
    results = pd.DataFrame(
        [
            dict(base, run="a", seed=42, dev_accuracy=0.753, evaluated=True),
            dict(base, run="b", seed=43, dev_accuracy=0.759, evaluated=True),
            dict(base, run="c", seed=44, dev_accuracy=0.700, evaluated=False),
            dict(base, run="d", seed=42, dev_accuracy=0.500, evaluated=True, lr=1e-3),
        ]
    )
    shown = with_seed_spread(results.iloc[[1, 3]], results)
    assert list(shown["seeds"]) == [3, 1]
    assert shown["dev_mean"].iloc[0] == pytest.approx((0.753 + 0.759 + 0.700) / 3)
    assert (shown["dev_min"].iloc[0], shown["dev_max"].iloc[0]) == (0.700, 0.759)
    assert shown["dev_mean"].iloc[1] == 0.500
