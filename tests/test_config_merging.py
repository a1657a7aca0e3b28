"""Probes: dotted overrides and YAML sections merge into the defaults, dict-typed ones included;
the run config saved in the folder is exactly the one that ran."""

from __future__ import annotations

import pytest
import yaml

from mecheval import cli
from mecheval.config import ConfigError, read_yaml
from mecheval.pipeline import QUICKSTART, load_run_config
from mecheval.run_folder.files import read_run_config
from mecheval.train.config import load_train_config
from mecheval.train.loop import train
from tests.helpers import tiny

pytestmark = pytest.mark.reliability


def test_dotted_override_of_the_default_sweep_keeps_its_grid_and_base():
    QUICKSTART_SWEEP = read_yaml(QUICKSTART)["sweep"]  # the default sweep, as the file writes it
    config = load_run_config(None, ["sweep.base.steps=5"])
    assert config.sweep["grid"] == QUICKSTART_SWEEP["grid"]
    expected_base = {**QUICKSTART_SWEEP["base"], "steps": 5}
    assert config.sweep["base"] == expected_base
    assert QUICKSTART_SWEEP["base"]["steps"] == 3000  # the default itself is left alone


def test_cli_run_with_a_dotted_override_runs_the_default_sweep(monkeypatch, tmp_path):
    """`mecheval run sweep.base.steps=5`: the pipeline gets 5 architectures x 2 seeds."""
    import mecheval.pipeline as pipeline

    seen = {}

    def fake_pipeline(config, out, progress=True):
        seen["config"] = config
        raise ConfigError("stop here")  # no training in this test

    monkeypatch.setattr(pipeline, "run_pipeline", fake_pipeline)
    assert cli.main(["run", "sweep.base.steps=5", "--out", str(tmp_path / "out")]) == 2
    sweep = seen["config"].sweep
    assert sweep["base"]["steps"] == 5 and sweep["base"]["task"]["options"]["num_keys"] == 16
    assert sweep["grid"]["seed"] == [0, 1] and len(sweep["grid"]["model.arch"]) == 7


def test_dotted_override_reaches_a_grid_key_holding_dots():
    config = load_run_config(None, ["sweep.grid.model.arch=[mamba]"])
    assert config.sweep["grid"] == {"model.arch": ["mamba"], "seed": [0, 1]}


def test_run_config_file_sweep_is_taken_as_written_and_overrides_merge_into_it(tmp_path):
    path = tmp_path / "run.yaml"
    sweep = {"base": {"task": {"name": "ar"}, "steps": 7}, "grid": {"model.arch": ["mamba"]}}
    path.write_text(yaml.safe_dump({"sweep": sweep, "workers": 1}))
    config = load_run_config(path, ["sweep.base.seed=3"])
    # Not mixed with the default sweep (no seed grid, no quickstart task options).
    assert config.sweep == {
        "base": {"task": {"name": "ar"}, "steps": 7, "seed": 3},
        "grid": {"model.arch": ["mamba"]},
    }
    assert config.workers == 1


@pytest.mark.parametrize(
    "text",
    ["task: {name: atr}\nmodel: {arch: mamba}\n", "task: atr\nmodel: {arch: mamba}\n"],
    ids=["sections", "alias"],
)
def test_yaml_sections_plus_dotted_overrides_keep_the_file(tmp_path, text):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    config = load_train_config(path, ["task.train_size=320", "model.d_model=16", "lr=3e-3"])
    assert config.task.name == "atr" and config.task.train_size == 320
    assert config.model.arch == "mamba" and config.model.d_model == 16
    assert config.optim.lr == 3e-3


def test_a_scalar_where_a_section_belongs_is_refused_not_dropped(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: mamba\n")
    with pytest.raises(ConfigError, match="model"):
        load_train_config(path, ["model.d_model=16"])
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_train_config(path)


def test_invalid_yaml_file_is_named(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("task: {name: atr\n")
    with pytest.raises(ConfigError, match="train.yaml"):
        load_train_config(path)


def test_the_saved_run_config_is_exactly_what_ran(tmp_path):
    config = tiny("steps=2", "arch=mamba", "model.options.d_conv=3", "seed=5")
    result = train(config, tmp_path / "run")
    assert read_run_config(tmp_path / "run") == config
    assert result["config"]["model"] == {
        "arch": "mamba",
        "d_model": 16,
        "n_layers": 2,
        "options": {"d_conv": 3},
    }
