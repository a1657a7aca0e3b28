"""DAS's orthonormal bases R (width, k): their cost per training step, parametrised as the Q
factor of a free matrix (ours, `mecheval.interventions.das.Bases`, all n bases in one batched
QR) against Householder reflections (pyvene's: `torch.nn.utils.parametrizations.orthogonal` of
a (width, k) weight, one module per basis). One step: form every R, swap a batch of 64 rows
through it (corrupted + (clean - corrupted) R R^T), and back-propagate a sum to the parameters.
CPU time per step, the median of the repeats after one warm-up step.

Run: python -m benchmarks.das_rotation_cost [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from mecheval.interventions.das import Bases

# (width, k, bases): the residual stream at d_model 64, and Mamba's state at d_model 64
# (d_inner 128 x d_state 16 = 2,048 floats), three bases each.
CASES = ((64, 1, 3), (64, 16, 3), (2048, 1, 3), (2048, 16, 3))
ROWS = 64


def _householder(width: int, k: int, n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Linear(width, k, bias=False) for _ in range(n)]
    return [
        nn.utils.parametrizations.orthogonal(layer, orthogonal_map="householder")
        for layer in layers
    ]


def _step_qr(bases: Bases, corrupted, clean) -> None:
    bases.swap(corrupted, clean).sum().backward()


def _step_householder(layers, corrupted, clean) -> None:
    total = 0
    for layer, b, s in zip(layers, corrupted, clean, strict=True):
        R = layer.weight.T  # (width, k), orthonormal columns
        total = total + (b + (s - b) @ R @ R.T).sum()
    total.backward()


def _seconds(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(width: int, k: int, n: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    corrupted, clean = (torch.randn(n, ROWS, width, generator=g) for _ in range(2))
    qr = Bases(width, k, seeds=list(range(n)))
    householder = _householder(width, k, n)
    ours = _seconds(lambda: _step_qr(qr, corrupted, clean), repeats)
    theirs = _seconds(lambda: _step_householder(householder, corrupted, clean), repeats)
    return {"width": width, "k": k, "bases": n, "qr_s": ours, "householder_s": theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| width | k | bases | QR: CPU ms/step | Householder: CPU ms/step | ratio |")
    print("|---|---|---|---|---|---|")
    rows = []
    for width, k, n in CASES:
        r = measure(width, k, n, args.repeats)
        rows.append(r)
        ratio = r["householder_s"] / r["qr_s"]
        print(
            f"| {width} | {k} | {n} | {1e3 * r['qr_s']:.2f} | {1e3 * r['householder_s']:.2f} | "
            f"{ratio:.1f}x |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
