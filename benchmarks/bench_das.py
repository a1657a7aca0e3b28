"""Batched DAS against each (site, position, k) trained alone through a forward hook
(pyvene's way), as pytest-benchmark figures: the setup of benchmarks/das_speedup.py (one
untrained d_model 64, 2-layer model, 320 AR documents corrupted at the key, the blocks' inputs,
the mixers' outputs and a recurrent mixer's state at the key, the value and the query, k in 1,
4, 16 and each site's width), 5 steps. das_speedup.py prints the same comparison as a table
and checks that both give the same results.

Run: pytest benchmarks/bench_das.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import sync
from benchmarks.das_speedup import ARCHS, setup
from mecheval.interventions.das import das
from mecheval.interventions.das_loop import das_loop
from mecheval.tasks import make_task

TASK = make_task("ar")
STEPS = 5
METHODS = {"ours (batched)": das, "each alone (hook loop)": das_loop}


@pytest.fixture(scope="module")
def data():
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # its one-time imports, out of both
    batch = TASK.sample(320, seed=0, split="dev")
    return batch, TASK.corrupt(batch, "key", seed=0)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_das(benchmark, data, arch, method):
    batch, corrupted = data
    model, where, settings = setup(arch, STEPS, TASK)
    fn = METHODS[method]

    def run():
        table = fn(model, batch, corrupted, settings=settings, **where).table
        sync()
        return table

    benchmark.group = f"DAS, {arch} d64, 320 AR docs, {STEPS} steps"
    table = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    combinations = table.groupby(["layer", "site", "position", "k"]).ngroups
    benchmark.extra_info.update(arch=arch, impl=method, combinations=combinations)
