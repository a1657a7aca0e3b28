"""Shared benchmark plumbing: device choice, synchronised timing, bandwidth figures.

Every benchmark times with pytest-benchmark and records in `benchmark.extra_info`
  - `bytes`: the bytes the op must move at the least (each input read once, each output written
    once), and `GB/s`: those bytes over the median time;
  - `copy_GB/s`: this device's measured copy bandwidth (read + write), for comparison.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Benchmarks run in bf16 on a GPU (the precision models train in there) and fp32 on CPU.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import time

    if nbytes is None:
        nbytes = 2 << 30 if DEVICE.type == "cuda" else 256 << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=DEVICE).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * nbytes / times[len(times) // 2] / 1e9


def run_benchmark(
    benchmark,
    fn: Callable[[], object],
    *,
    nbytes: int,
    copy_bandwidth: float,
    slow: bool = False,
    **info: object,
) -> None:
    """Time `fn` (synchronising CUDA after each call) and record bandwidth figures.

    `slow` runs one round of one call: for references that take seconds per call.
    """

    def call():
        out = fn()
        sync()
        return out

    if slow:
        benchmark.pedantic(call, rounds=1, iterations=1, warmup_rounds=0)
    else:
        call()  # warm-up: compilation and autotuning stay out of the figures
        benchmark(call)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(info)
    benchmark.extra_info["device"] = (
        torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    )
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(nbytes / median / 1e9, 2)
    benchmark.extra_info["copy_GB/s"] = round(copy_bandwidth, 2)
