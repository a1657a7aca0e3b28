"""The evaluation's settings and their defaults, in a module light enough for the CLI to import
(mecheval.evaluate runs them)."""

from __future__ import annotations

import dataclasses

CORRUPTIONS = ("key", "value")
POSITIONS = ("key", "value", "divider", "query", "value+1", "value+2")


@dataclasses.dataclass
class EvaluateConfig:
    """How trained runs are evaluated; the one place its defaults live (`evaluate_run`, the
    main job's `evaluate:` section and `mecheval evaluate` all take them from here).

    Attributes:
        split: the documents patched (dev or test).
        corruptions: what the corrupted documents change (key, value).
        positions: the positions patched, by name (see mecheval.interventions).
        device: where the grids run.
        seed: the corruption's seed.
        memory_budget: bytes a grid may hold at once (larger grids run in chunks).
    """

    split: str = "dev"
    corruptions: list[str] = dataclasses.field(default_factory=lambda: list(CORRUPTIONS))
    positions: list[str] = dataclasses.field(default_factory=lambda: list(POSITIONS))
    device: str = "cpu"
    seed: int = 0
    memory_budget: int = 1 << 30


DEFAULTS = EvaluateConfig()
