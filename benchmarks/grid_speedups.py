"""Speed-ups of the interchange grid over the per-cell hook loop, side by side in one process:
for each architecture, the grid (best of `--repeats` runs after a warm-up) and the loop (one
run: it is slow by design) on the setup of bench_interventions.py (the study's seven
architectures, d_model 64, 2 layers, untrained, 320 AR documents), for the named positions and
for all 37 positions. Prints a markdown table and, with --json, writes the figures.

Run: python -m benchmarks.grid_speedups [--archs mamba,h3] [--grids named,all] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import DEVICE, sync
from mecheval.interventions import interchange_grid, per_cell_loop
from mecheval.models import build_model
from mecheval.tasks import make_task

ARCHS = ("attention", "base_conv", "based", "h3", "hyena", "mamba", "deltanet")
GRIDS = {"named": None, "all": ["all"]}


def _seconds(fn) -> tuple[float, float]:
    """(wall-clock, process CPU) seconds of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(arch: str, grid: str, repeats: int, task, batch, corrupted) -> dict:
    torch.manual_seed(0)
    size = dict(vocab_size=task.vocab_size, d_model=64, max_len=task.max_document_length)
    model = build_model(arch, **size).to(DEVICE)
    positions = GRIDS[grid]
    run = lambda fn: fn(model, batch, corrupted, positions=positions)  # noqa: E731
    run(interchange_grid)  # warm-up
    ours = min(
        (_seconds(lambda: run(interchange_grid)) for _ in range(repeats)), key=lambda t: t[1]
    )
    loop = _seconds(lambda: run(per_cell_loop))
    return {
        "arch": arch,
        "grid": grid,
        "ours_wall_s": ours[0],
        "ours_cpu_s": ours[1],
        "loop_wall_s": loop[0],
        "loop_cpu_s": loop[1],
        "speedup": loop[1] / ours[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--grids", default="named,all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = make_task("ar")
    batch = task.sample(320, seed=0, split="dev")
    corrupted = task.corrupt(batch, "key", seed=0)
    rows = []
    print("| arch | positions | ours: CPU s (wall) | per-cell loop: CPU s (wall) | speed-up |")
    print("|---|---|---|---|---|")
    for arch in args.archs.split(","):
        for grid in args.grids.split(","):
            r = measure(arch, grid, args.repeats, task, batch, corrupted)
            rows.append(r)
            print(
                f"| {arch} | {grid} | {r['ours_cpu_s']:.2f} ({r['ours_wall_s']:.2f}) | "
                f"{r['loop_cpu_s']:.1f} ({r['loop_wall_s']:.1f}) | {r['speedup']:.1f}x |",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    meta = {"device": str(DEVICE), "threads": torch.get_num_threads()}
                    json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
