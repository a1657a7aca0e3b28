"""Read-outs pooled over seeds pool runs of one configuration only: the same task instance,
run length, model and learning rate."""

from __future__ import annotations

import pandas as pd

from mecheval.evaluation.analysis import seed_siblings


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
