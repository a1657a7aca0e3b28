"""Sweep files: a base training config and a grid of values whose product is the sweep.

    base:                      # any part of a TrainConfig (see mecheval.train.config)
      task: {name: ar}
    grid:                      # dotted keys (or train aliases) -> lists of values
      model.arch: [attention, mamba]
      model.d_model: [32, 64]
      optim.lr: [1e-3, 3e-3]
    include:                   # optional: extra runs (partial configs over `base`), not crossed
      - {model: {arch: h3}, seed: 0}
      - {task: {name: atr, options: {max_rhs_len: 5}}, model: {arch: mamba_noconv}}

A file with `include` and no `grid` is its include runs alone (the base is not a run of it);
with neither, the base is its one run.

An include entry that names another task than the base's replaces the base's task section
(the base's task options belong to its task); otherwise it merges into the base.

Every run gets a folder named from its config: readable fields plus a short hash of the whole
resolved config, so two different configs never share a folder and the same config always
maps to the same one (which is what makes a rerun resume).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mecheval.config import (
    ConfigError,
    from_dict,
    merge,
    parse_overrides,
    read_yaml,
    set_dotted,
    to_dict,
)
from mecheval.train.config import ALIASES, TrainConfig, identity


@dataclass(frozen=True)
class Run:
    name: str
    config: TrainConfig


def run_name(config: TrainConfig) -> str:
    """e.g. `ar-mamba-d64-l2-lr0.001-s42-3f2a9c1e`."""
    digest = hashlib.sha256(json.dumps(identity(config), sort_keys=True).encode()).hexdigest()[:8]
    m = config.model
    arch, task = (re.sub(r"[^A-Za-z0-9_.+-]", "_", name) for name in (m.arch, config.task.name))
    readable = f"{task}-{arch}-d{m.d_model}-l{m.n_layers}"  # an import path's ":" replaced
    return f"{readable}-lr{config.optim.lr:g}-s{config.seed}-{digest}"


def _include(base: dict, extra: dict) -> dict:
    """`extra` over `base`; a different task replaces the base's task section."""
    if not isinstance(extra, dict):
        raise ConfigError(f"include entries must be mappings, got {extra!r}")
    task = extra.get("task")
    base_task = (base.get("task") or {}).get("name", "ar")
    if isinstance(task, dict) and task.get("name", base_task) != base_task:
        base = {k: v for k, v in base.items() if k != "task"}
    return merge(base, extra)


def expand_sweep(spec: dict, overrides: list[str] | tuple[str, ...] = ()) -> list[Run]:
    """The runs of a sweep spec (a parsed sweep file), in a fixed order, without duplicates."""
    unknown = set(spec) - {"base", "grid", "include"}
    if unknown:
        raise ConfigError(
            f"unknown sweep file key(s) {sorted(unknown)}; expected base, grid, include"
        )
    base = merge(spec.get("base") or {}, parse_overrides(overrides, ALIASES))
    grid = spec.get("grid") or {}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"grid.{key} must be a non-empty list, got {values!r}")
    partials = []
    keys = list(grid)
    crossed = itertools.product(*(grid[k] for k in keys)) if grid or not spec.get("include") else ()
    for combination in crossed:
        run = dict(base)
        for key, value in zip(keys, combination, strict=True):
            run = merge(run, set_dotted({}, ALIASES.get(key, key), value))
        partials.append(run)
    for extra in spec.get("include") or []:
        partials.append(_include(base, extra))
    runs, seen = [], set()
    for partial in partials:
        config = from_dict(TrainConfig, partial)
        name = run_name(config)
        if name not in seen:
            seen.add(name)
            runs.append(Run(name, config))
    return runs


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> list[Run]:
    spec = read_yaml(path, "sweep file") or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a sweep file must hold a mapping")
    return expand_sweep(spec, overrides)


def select_runs(runs: list[Run], only: list[str] | tuple[str, ...]) -> list[Run]:
    """The runs whose config matches every `key=value` filter (dotted keys or train aliases,
    values parsed as in overrides; `key=a,b` matches either), in their sweep order. Runs keep
    their names, so a slice of a sweep trains into the sweep's own folders."""
    wanted = []
    for item in only:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--only takes key=value, got {item!r}")
        key = ALIASES.get(key, key)
        parsed = [parse_overrides([f"x={v}"])["x"] for v in values.split(",")]
        wanted.append((key, parsed))
    selected = []
    for run in runs:
        fields = to_dict(run.config)
        matches = True
        for key, parsed in wanted:
            value: Any = fields
            for part in key.split("."):
                if not isinstance(value, dict) or part not in value:
                    raise ConfigError(f"--only: unknown config key {key!r}")
                value = value[part]
            matches &= value in parsed
        if matches:
            selected.append(run)
    return selected
