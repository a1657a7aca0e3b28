"""A small attention model trained once for the pipeline tests: 4-pair AR over 16 keys, 2,400
steps, every 600-step checkpoint kept (for the read-outs over training)."""

from __future__ import annotations

import pytest

from mecheval.train.config import load_train_config
from mecheval.train.loop import train

OVERRIDES = [
    "task.options.num_pairs=4",
    "task.options.num_keys=16",
    "task.train_size=64000",
    "task.eval_size=128",
    "arch=attention",
    "d_model=64",
    "model.options.init=pytorch",
    "steps=2400",
    "seed=0",
    "lr=1e-3",
    "eval_every=600",
    "checkpoint_every=600",
    "keep_checkpoints=4",
    "progress=false",
    "backend=torch",
]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    import os

    os.environ["MECHEVAL_CACHE"] = str(root / "cache")
    run = root / "attention"
    result = train(load_train_config(None, OVERRIDES), run)
    return run, result
