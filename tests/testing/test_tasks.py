"""check_task: every shipped task passes it; a broken task fails the check that names its
fault, one line each, and the user's own code raising is reported, not raised."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mecheval.tasks import AssociativeRecall
from mecheval.testing import TaskCheckError, check_task

SMALL = {"num_pairs": 4, "num_keys": 16}


@pytest.mark.parametrize(
    "name, options",
    [
        ("ar", SMALL),
        ("atr", {"max_rhs_len": 5, "num_terminals": 20}),
        ("mqar", {"vocab_size": 64, "input_seq_len": 32, "num_kv_pairs": 4}),
        ("mad_recall", {"seq_len": 32}),
        ("mad_noisy_recall", {"seq_len": 32}),
        ("mad_fuzzy_recall", {"seq_len": 64}),
    ],
)
def test_every_shipped_task_passes(name, options):
    report = check_task(name, options=options, grid=name in ("mqar", "mad_fuzzy_recall"))
    assert not report.failed and len(report.checks) >= 5


@dataclasses.dataclass(frozen=True)
class Shifted(AssociativeRecall):
    """Its value role points at the next key: the oracle reads the wrong token."""

    def _generate(self, n, seed, split):
        batch = super()._generate(n, seed, split)
        return dataclasses.replace(
            batch, positions={**batch.positions, "value": batch.positions["value"] + 1}
        )


@dataclasses.dataclass(frozen=True)
class Outside(AssociativeRecall):
    def _generate(self, n, seed, split):
        batch = super()._generate(n, seed, split)
        return dataclasses.replace(
            batch, positions={**batch.positions, "divider": batch.lengths + 3}
        )


@dataclasses.dataclass(frozen=True)
class OneStream(AssociativeRecall):
    """Every split the same documents."""

    def _generate(self, n, seed, split):
        return super()._generate(n, seed, "train")


@dataclasses.dataclass(frozen=True)
class Unseeded(AssociativeRecall):
    def _generate(self, n, seed, split):
        return super()._generate(n, int(np.random.default_rng().integers(1 << 30)), split)


@dataclasses.dataclass(frozen=True)
class Sloppy(AssociativeRecall):
    """Its key corruption also changes the query."""

    def corrupt(self, batch, corruption, seed):
        corrupted = super().corrupt(batch, corruption, seed)
        rows = torch.arange(len(batch))
        corrupted[rows, batch.positions["query"]] = 3
        return corrupted


@pytest.mark.parametrize(
    "task, failed, words",
    [
        (Shifted, ["corruptions", "oracle"], "tokens at 'value' fall outside"),
        (Outside, ["roles"], "role 'divider' of row 0 lies outside its document"),
        (OneStream, ["splits"], "are in both train and dev"),
        (Unseeded, ["determinism"], "two samples of seed 0 differ"),
        (Sloppy, ["corruptions"], "key changes other tokens than 'key'"),
    ],
)
def test_a_broken_task_fails_the_check_that_names_its_fault(task, failed, words):
    with pytest.raises(TaskCheckError) as raised:
        check_task(task, options=SMALL, grid=False)
    lines = [c for c in raised.value.report.checks if c.passed is False]
    assert [c.name for c in lines] == failed
    assert words in lines[0].detail
    assert all(f"FAIL {name}: " in str(raised.value) for name in failed)


def test_a_task_whose_constructor_raises_is_reported():
    with pytest.raises(TaskCheckError, match="FAIL build: ValueError: option 'num_keys'"):
        check_task("ar", options={"num_pairs": 8, "num_keys": 4})
