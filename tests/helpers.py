"""Tiny runs for the tests that train (the reliability probes of issue 18 first): a 4-pair AR
task, d_model 16, a few steps, the PyTorch kernels (the test session turns on the Triton
interpreter), on CPU, no progress bar; and the one line a failing `mecheval` command writes."""

from __future__ import annotations

from pathlib import Path

from mecheval.train.config import TrainConfig, load_train_config

TINY = [
    "task.options.num_pairs=4",
    "task.options.num_keys=16",
    "task.train_size=320",
    "task.eval_size=32",
    "d_model=16",
    "progress=false",
    "backend=torch",
    "device=cpu",  # resumed runs are compared bitwise, which CPU guarantees
]


def tiny(*overrides: str) -> TrainConfig:
    """A tiny config: 8 steps, a checkpoint every 2 steps (the newest 2 kept), a record every 2."""
    defaults = ["steps=8", "checkpoint_every=2", "keep_checkpoints=2", "log_every=2"]
    return load_train_config(None, [*TINY, *defaults, "eval_every=4", *overrides])


def checkpoint_steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def cli_line(argv: list[str], capsys) -> tuple[int, str]:
    """Run `mecheval argv`; its exit status and the one line it wrote to stderr (asserted to be
    one line, without a traceback)."""
    from mecheval import cli

    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    lines = [line for line in lines if "it/s]" not in line and "run/s]" not in line]  # tqdm
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return code, lines[0]
