"""pytest-benchmark setup shared by the benchmarks (see benchmarks/common.py).

Run: pytest benchmarks --benchmark-only  (add --benchmark-json=FILE to keep the figures).

pytest-benchmark writes its JSON only when the session ends, so a session killed by a time
limit loses every figure. With MECHEVAL_BENCH_STREAM=FILE set, each benchmark's figures are
also appended to FILE (JSON lines) as soon as it finishes (benchmarks/gpu_run.py uses this).
"""

import json
import os

import pytest

from benchmarks.common import measure_copy_bandwidth


@pytest.fixture(scope="session")
def copy_bandwidth() -> float:
    return measure_copy_bandwidth()


@pytest.fixture(autouse=True)
def _stream_figures(request):
    yield
    path = os.environ.get("MECHEVAL_BENCH_STREAM")
    bench = request.node.funcargs.get("benchmark")
    if not path or bench is None or bench.stats is None:
        return
    stats = bench.stats.stats
    record = {
        "group": bench.group,
        "name": request.node.name,
        "median_s": stats.median,
        "min_s": stats.min,
        "rounds": stats.rounds,
        **bench.extra_info,
    }
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
