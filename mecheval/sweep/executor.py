"""Where a sweep's runs execute (its executor): local worker processes, or Ray tasks (on a local
Ray instance, or a cluster at `address`). Not to be confused with the kernel backend
(`TrainConfig.backend`: which implementation runs the kernels)."""

from __future__ import annotations

from typing import Any, Literal, get_args

Executor = Literal["local", "ray"]
EXECUTORS: tuple[str, ...] = get_args(Executor)

# How a sweep's runs execute: the options of `run_sweep` that the main job's run config
# (mecheval.pipeline.RunConfig) and the flags of `mecheval sweep` both carry.
EXECUTION = ("executor", "workers", "retries", "address", "stack")


def execution_of(options: object) -> dict[str, Any]:
    """The execution options (`EXECUTION`) that `options` holds as attributes, as `run_sweep`'s
    keyword arguments."""
    return {name: getattr(options, name) for name in EXECUTION}
