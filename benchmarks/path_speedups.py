"""Speed-ups of path patching over its plain loop, side by side in one process: for each
architecture, `path_patching` (best of `--repeats` runs after a warm-up) and
`path_patching_loop` (one run: hooked forward passes of one document and one route at a time,
every pass from the embedding) on the grid benchmark's setup (d_model 64, 2 layers, untrained,
320 documents of the study's AR), the sender layer 0's block input at the key, every route of
layer 0. Prints a markdown table and, with --json, writes the figures.

Run: python -m benchmarks.path_speedups [--archs mamba,deltanet] [--json FILE] [--threads 1]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import DEVICE
from benchmarks.grid_speedups import _seconds
from mecheval.interventions import path_patching
from mecheval.interventions.per_cell import path_patching_loop
from mecheval.models import build_model
from mecheval.tasks import make_task

ARCHS = ("mamba", "mamba2", "deltanet", "gated_deltanet", "attention", "based")


def measure(arch: str, repeats: int, task, batch, corrupted) -> dict:
    torch.manual_seed(0)
    size = dict(vocab_size=task.vocab_size, d_model=64, max_len=task.max_document_length)
    model = build_model(arch, **size).to(DEVICE).eval()
    path_patching(model, batch, corrupted)  # warm-up
    ours = min(
        (_seconds(lambda: path_patching(model, batch, corrupted)) for _ in range(repeats)),
        key=lambda t: t[1],
    )
    loop = _seconds(lambda: path_patching_loop(model, batch, corrupted))
    return {
        "arch": arch,
        "ours_wall_s": ours[0],
        "ours_cpu_s": ours[1],
        "loop_wall_s": loop[0],
        "loop_cpu_s": loop[1],
        "speedup": loop[1] / ours[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--documents", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = make_task("ar")
    batch = task.sample(args.documents, seed=0, split="dev")
    corrupted = task.corrupt(batch, "key", seed=0)
    rows = []
    print("| arch | path_patching: CPU s (wall) | loop: CPU s (wall) | speed-up |")
    print("|---|---|---|---|")
    for arch in args.archs.split(","):
        r = measure(arch, args.repeats, task, batch, corrupted)
        rows.append(r)
        print(
            f"| {arch} | {r['ours_cpu_s']:.2f} ({r['ours_wall_s']:.2f}) | "
            f"{r['loop_cpu_s']:.1f} ({r['loop_wall_s']:.1f}) | {r['speedup']:.1f}x |",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                meta = {"device": str(DEVICE), "threads": torch.get_num_threads()}
                json.dump({**meta, "documents": args.documents, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
