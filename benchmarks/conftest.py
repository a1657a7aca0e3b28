"""pytest-benchmark setup shared by the benchmarks (see benchmarks/common.py).

Run: pytest benchmarks --benchmark-only  (add --benchmark-json=FILE to keep the figures).
"""

import pytest

from benchmarks.common import measure_copy_bandwidth


@pytest.fixture(scope="session")
def copy_bandwidth() -> float:
    return measure_copy_bandwidth()
