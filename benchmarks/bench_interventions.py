"""The interchange grid of a 2-layer model on 320 AR documents (the study's evaluation set):
the batched engine vs the plain per-cell hook loop (one full forward per cell, as pyvene and
the study run it), same model, same run; and attribution patching (one backward) vs exact.

Models: the study's seven architectures (attention, BaseConv, Based, H3, Hyena, Mamba,
DeltaNet), d_model 64, untrained (the cost does not depend on the weights). Grids: every site
of the model x the four named positions, and every site x all 37 positions. The loop runs one
round (it is slow by design).

Run: pytest benchmarks/bench_interventions.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import DEVICE, sync
from mecheval.interventions import attribution_patching, interchange_grid, per_cell_loop
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar")  # the study's AR: 16 pairs over 4096 keys, 37 tokens
ARCHS = ("attention", "base_conv", "based", "h3", "hyena", "mamba", "deltanet")
GRIDS = {"named positions": None, "all 37 positions": ["all"]}
METHODS = {
    "ours (batched)": interchange_grid,
    "per-cell loop": per_cell_loop,
    "attribution patching": attribution_patching,
}


@pytest.fixture(scope="module")
def data():
    batch = TASK.sample(320, seed=0, split="dev")
    return batch, TASK.corrupt(batch, "key", seed=0)


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    torch.manual_seed(0)
    size = dict(vocab_size=TASK.vocab_size, d_model=64, max_len=TASK.max_document_length)
    return build_model(request.param, **size).to(DEVICE), request.param


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("grid", list(GRIDS))
def test_interchange_grid(benchmark, model, data, grid, method):
    (model, arch), (batch, corrupted) = model, data
    fn = METHODS[method]

    def run():
        table = fn(model, batch, corrupted, positions=GRIDS[grid])
        sync()
        return table

    benchmark.group = f"interchange grid, {arch} d64, 320 AR docs, {grid}"
    if method == "per-cell loop":
        table = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    else:
        table = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    cells = table.groupby(["layer", "site", "position"]).ngroups
    benchmark.extra_info.update(
        arch=arch, impl=method, grid=grid, cells=cells, rows=len(table), device=str(DEVICE)
    )
