"""Batched DAS (mecheval.interventions.das) against training each (site, position, k) alone
through a forward hook (`das_loop`, pyvene's way), side by side in one process: one d_model 64,
2-layer model (untrained: the cost does not depend on the weights), 320 AR documents corrupted
at the key (160 to train on, 160 held out), the sites of the study's read-outs in both layers
(the blocks' inputs, the mixers' outputs, and a recurrent mixer's state), at the key, the value
and the query, subspace sizes 1, 4 and 16 (and each site's full width), a few steps. Prints a
markdown table and, with --json, writes the figures; checks that both give the same results.

Run: python -m benchmarks.das_speedup [--archs attention,mamba,deltanet] [--steps 10]
         [--task study|quickstart] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.common import DEVICE, sync
from mecheval.interventions.das import DasSettings, das
from mecheval.interventions.das_loop import das_loop
from mecheval.models import build_model
from mecheval.tasks import make_task

ARCHS = ("attention", "mamba", "deltanet")
TASKS = {"study": {}, "quickstart": {"num_pairs": 4, "num_keys": 16}}
KEYS = ["example", "layer", "site", "position", "k"]


def _seconds(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    sync()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def setup(arch: str, steps: int, task) -> tuple[torch.nn.Module, dict, DasSettings]:
    """The model, the (sites, positions, dims) searched and the settings both methods run."""
    torch.manual_seed(0)
    size = dict(vocab_size=task.vocab_size, d_model=64, max_len=task.max_document_length)
    model = build_model(arch, **size).to(DEVICE)
    recurrent = any(name.endswith(".state") for name in model.site_names())
    sites = ["block_input", "mixer_output"] + (["state"] if recurrent else [])
    where = dict(sites=sites, positions=["key", "value", "query"], dims=[1, 4, 16])
    return model, where, DasSettings(steps=steps, lr=1e-2, batch_size=32, holdout=0.5)


def measure(arch: str, steps: int, task, batch, corrupted) -> dict:
    model, where, settings = setup(arch, steps, task)
    ours, ours_wall, ours_cpu = _seconds(
        lambda: das(model, batch, corrupted, settings=settings, **where)
    )
    loop, loop_wall, loop_cpu = _seconds(
        lambda: das_loop(model, batch, corrupted, settings=settings, **where)
    )
    ours, loop = ours.table, loop.table
    merged = ours.merge(loop, on=KEYS, suffixes=("", "_loop"))
    gap = float(np.abs(merged["p_target"] - merged["p_target_loop"]).max())
    same = bool((merged["correct"] == merged["correct_loop"]).all())
    combos = len(ours.groupby(["layer", "site", "position", "k"]))
    return {
        "arch": arch,
        "combinations": combos,
        "steps": steps,
        "ours_wall_s": ours_wall,
        "ours_cpu_s": ours_cpu,
        "loop_wall_s": loop_wall,
        "loop_cpu_s": loop_cpu,
        "speedup": loop_cpu / ours_cpu,
        "max_p_target_gap": gap,
        "same_correct": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--task",
        choices=tuple(TASKS),
        default="study",
        help="study: the study's AR (16 pairs over 4,096 keys); quickstart: the CPU quickstart's "
        "(4 pairs over 16 keys, 13-token documents)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # its one-time imports, out of both
    task = make_task("ar", **TASKS[args.task])
    batch = task.sample(320, seed=0, split="dev")
    corrupted = task.corrupt(batch, "key", seed=0)
    rows = []
    header = (
        "| arch | combinations | steps | ours: CPU s | one at a time: CPU s | speed-up | same |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    for arch in args.archs.split(","):
        r = measure(arch, args.steps, task, batch, corrupted)
        rows.append(r)
        same = "yes" if r["same_correct"] and r["max_p_target_gap"] < 1e-4 else "no"
        print(
            f"| {arch} | {r['combinations']} | {r['steps']} | {r['ours_cpu_s']:.1f} | "
            f"{r['loop_cpu_s']:.1f} | {r['speedup']:.1f}x | {same} "
            f"(p gap {r['max_p_target_gap']:.1e}) |",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                meta = {"device": str(DEVICE), "threads": torch.get_num_threads()}
                json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
