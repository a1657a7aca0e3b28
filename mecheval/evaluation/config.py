"""The evaluation's settings, their defaults and the checks they pass before any work starts, in
a module light enough for the CLI to import (mecheval.evaluation.evaluate runs them).

`check_options` checks what needs no run: the split, corruptions, seed, device, memory budget,
checkpoint step, and that each position is written as one (a named position, optionally
shifted, an index, or "all"). Whether a position lies inside a task's documents is checked
against each run's documents (mecheval.evaluation.documents). Every error is an
`OptionError` naming the option, the bad value and what is allowed; `renamed` gives its message
with the option as the caller spells it (`--memory-budget` on the command line,
`evaluate.memory_budget` in a run config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from mecheval.checks import check_int
from mecheval.config import ConfigError
from mecheval.run_folder import LATEST

CORRUPTIONS = ("key", "value")
POSITIONS = ("key", "value", "divider", "query", "value+1", "value+2")
"""AR's and ATR's: what `corruptions` and `positions` left unset (None) mean for their tasks;
a task's own are its corruptions and `task_positions(task)`."""
SPLITS = ("dev", "test")


@dataclasses.dataclass
class EvaluateConfig:
    """How trained runs are evaluated; the one place its defaults live (`evaluate_run`, the
    main job's `evaluate:` section and `mecheval evaluate` all take them from here).

    Attributes:
        split: the documents patched (dev or test).
        corruptions: the task's corruptions the grids run (None: all of the task's; key and
            value for AR).
        positions: the positions patched, by name (see mecheval.interventions.positions;
            None: `task_positions`, AR's key, value, divider, query, value+1, value+2).
        device: where the grids run (cpu, cuda, cuda:N, or auto).
        seed: the corruption's seed (>= 0).
        memory_budget: bytes a grid may hold at once (larger grids run in chunks).
        step: the checkpoint evaluated: None, the one the run's result.json names; a step
            number; or "latest", the newest intact one the run kept.
    """

    split: str = "dev"
    corruptions: list[str] | None = None
    positions: list[str] | None = None
    device: str = "cpu"
    seed: int = 0
    memory_budget: int = 1 << 30
    step: int | Literal["latest"] | None = None


DEFAULTS = EvaluateConfig()


# The sites where the study's read-outs find the association: the residual stream (a block's
# input), the mixer's output, a short convolution's output and a recurrent state. A run is
# searched at those of them its model has.
READOUT_SITES = ("block_input", "mixer_output", "conv_output", "state")


DAS_DIMS = (1, 2, 4, 8, 16, 32)  # `mecheval das`'s subspace sizes by default


@dataclasses.dataclass
class DasOptions:
    """What `mecheval das` searches and how (the one place its defaults live).

    Attributes:
        sites: short site names, each of which every run's model must have; None: those of
            READOUT_SITES each model has.
        layers: layer indices (None: every layer).
        positions: position names as the grid takes them.
        dims: subspace sizes k (each site's full width is always added; a k above every
            searched site's width is an error, one above some site's is left out there and
            named); None: those of DAS_DIMS below the widest site's width.
        corruptions: what the corrupted documents change (key, value).
        steps, lr, batch_size, holdout, seed: the training settings; None: DasSettings'
            default (mecheval.interventions.das). The seed also draws the corruptions.
        split, device, step: as `mecheval evaluate` takes them.
    """

    sites: list[str] | None = None
    layers: list[int] | None = None
    positions: list[str] = dataclasses.field(default_factory=lambda: ["key", "value", "query"])
    dims: list[int] | None = None
    corruptions: list[str] = dataclasses.field(default_factory=lambda: ["key"])
    steps: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    holdout: float | None = None
    seed: int | None = None
    split: str = "dev"
    device: str = "cpu"
    step: int | Literal["latest"] | None = None


def task_positions(task) -> list[str]:
    """The positions a task's runs are evaluated at by default: the roles among key, value,
    divider and query it declares, and value+1, value+2 where it has a value (the study's conv
    read-outs; AR's default is POSITIONS)."""
    named = [name for name in ("key", "value", "divider", "query") if name in task.roles]
    return named + (["value+1", "value+2"] if "value" in task.roles else [])


class OptionError(ConfigError):
    """An evaluation option (a field of EvaluateConfig) that cannot be used."""

    def __init__(self, option: str, problem: str) -> None:
        self.option, self.problem = option, problem
        super().__init__(f"{option}: {problem}")

    def renamed(self, spell: Callable[[str], str]) -> ConfigError:
        """The same error with the option spelt `spell(option)`."""
        return ConfigError(f"{spell(self.option)}: {self.problem}")


def _integer(option: str, value: object, minimum: int) -> int:
    try:
        return check_int(option, value, minimum)
    except ValueError as error:
        raise OptionError(option, str(error).removeprefix(f"{option} ")) from None


def _names(option: str, values: object, what: str) -> list[str]:
    """A non-empty list of strings, duplicates dropped (order kept)."""
    if isinstance(values, str) or not isinstance(values, (list, tuple)) or not values:
        raise OptionError(option, f"expected a non-empty list of {what}, got {values!r}")
    for value in values:
        if not isinstance(value, str):
            raise OptionError(option, f"expected {what}, got {type(value).__name__} {value!r}")
    return list(dict.fromkeys(values))


def check_options(options: EvaluateConfig) -> EvaluateConfig:
    """`options` checked (see the module docstring), with duplicate corruptions and positions
    dropped and the device resolved (auto: cuda if present, else cpu).

    Raises:
        OptionError: naming the option, the bad value and what is allowed.
    """
    from mecheval.interventions.positions import parse_position
    from mecheval.train.config import resolve_device

    if options.split not in SPLITS:
        raise OptionError("split", f"must be {' or '.join(SPLITS)}, got {options.split!r}")
    corruptions, positions = options.corruptions, options.positions
    if corruptions is not None:  # each checked against the run's task (evaluation.documents)
        corruptions = _names("corruptions", corruptions, "corruption names")
    if positions is not None:
        positions = _names("positions", positions, "positions")
    for label in positions or ():
        if label != "all":
            try:
                parse_position(label)
            except ValueError as error:
                raise OptionError("positions", str(error)) from None
    seed = _integer("seed", options.seed, 0)
    memory_budget = _integer("memory_budget", options.memory_budget, 1)
    step = options.step
    number = isinstance(step, int) and not isinstance(step, bool) and step >= 0
    if not (step is None or step == LATEST or number):
        raise OptionError("step", f"must be a step number >= 0 or {LATEST!r}, got {step!r}")
    if not isinstance(options.device, str):
        raise OptionError("device", f"expected a device name, got {options.device!r}")
    try:
        device = str(resolve_device(options.device))
    except ConfigError as error:
        raise OptionError("device", str(error).removeprefix("device ")) from None
    return dataclasses.replace(
        options,
        corruptions=corruptions,
        positions=positions,
        seed=seed,
        memory_budget=memory_budget,
        device=device,
    )
