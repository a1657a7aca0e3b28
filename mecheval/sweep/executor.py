"""Where a sweep's runs execute (its executor): local worker processes, or Ray tasks (on a local
Ray instance, or a cluster at `address`). Not to be confused with the kernel backend
(`TrainConfig.backend`: which implementation runs the kernels)."""

from __future__ import annotations

from typing import Literal, get_args

Executor = Literal["local", "ray"]
EXECUTORS: tuple[str, ...] = get_args(Executor)
