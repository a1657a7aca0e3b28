"""The grids beyond the study (configs/beyond/): each is its study grid's recipe, run for Gated
DeltaNet and Mamba-2 beside DeltaNet and Mamba, and every run builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from mecheval.config import to_dict
from mecheval.models import build_model
from mecheval.pipeline import load_run_config
from mecheval.sweep import expand_sweep, load_sweep

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BEYOND = {"deltanet", "gated_deltanet", "mamba", "mamba2"}


def _recipe(config) -> dict:
    """Everything of a run's config but its architecture and name."""
    data = to_dict(config)
    data["model"] = {k: v for k, v in data["model"].items() if k != "arch"}
    data.pop("name", None)
    return data


@pytest.mark.parametrize("name", ["ar_32_nope", "pcfg_easy_nope"])
def test_beyond_grid_is_its_study_grids_recipe(name):
    beyond = [run.config for run in load_sweep(CONFIGS / "beyond" / f"{name}.yaml")]
    study = [run.config for run in load_sweep(CONFIGS / "study" / f"{name}.yaml")]
    assert len(beyond) == 100
    assert {c.model.arch for c in beyond} == BEYOND
    # Per architecture, the same runs as the study's grid (one architecture's worth).
    recipes = sorted(map(str, (_recipe(c) for c in study if c.model.arch == "mamba")))
    for arch in BEYOND:
        assert sorted(map(str, (_recipe(c) for c in beyond if c.model.arch == arch))) == recipes
    for c in beyond:
        if c.model.d_model == 16:
            build_model(c.model.arch, 50, c.model.d_model, max_len=8, **c.model.options)


def test_beyond_quickstart_loads():
    config = load_run_config(CONFIGS / "beyond" / "quickstart_ar.yaml")
    runs = [run.config for run in expand_sweep(config.sweep)]
    assert {c.model.arch for c in runs} == BEYOND
    assert len(runs) == 8


def test_das_grid_is_the_quickstart_ar_task():
    runs = [run.config for run in load_sweep(CONFIGS / "beyond" / "das_ar.yaml")]
    quickstart = [run.config for run in expand_sweep(load_run_config(None).sweep)]
    ar = next(c for c in quickstart if c.task.name == "ar")
    assert {(c.model.arch, c.optim.lr) for c in runs} == {
        ("attention", 1e-3), ("based", 1e-3), ("deltanet", 1e-3),
        ("mamba", 1e-3), ("mamba", 3e-3), ("mamba", 1e-2),
    }  # fmt: skip
    assert all(to_dict(c.task) == to_dict(ar.task) and c.steps == ar.steps for c in runs)
