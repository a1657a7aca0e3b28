"""Evaluation settings live in one config: the CLI, the main job and `evaluate_run` share its
defaults, and the CLI takes every setting."""

from __future__ import annotations

import inspect

import pandas as pd
import pytest

from mecheval.cli import build_parser, main
from mecheval.config import ConfigError
from mecheval.evaluation.config import DEFAULTS, EvaluateConfig
from mecheval.evaluation.evaluate import evaluate_run
from mecheval.pipeline import load_run_config

pytestmark = pytest.mark.pipeline


def test_cli_main_job_and_evaluate_run_share_the_defaults():
    args = build_parser().parse_args(["evaluate", "runs/x"])
    assert args.positions == DEFAULTS.positions and args.corruptions == DEFAULTS.corruptions
    assert (args.split, args.device, args.seed, args.memory_budget) == (
        DEFAULTS.split,
        DEFAULTS.device,
        DEFAULTS.seed,
        DEFAULTS.memory_budget,
    )
    assert load_run_config().evaluate == EvaluateConfig()
    signature = inspect.signature(evaluate_run).parameters
    for name in ("split", "device", "seed", "memory_budget"):
        assert signature[name].default == getattr(DEFAULTS, name)
    assert signature["positions"].default is DEFAULTS.positions is None  # the task's own
    assert signature["corruptions"].default is DEFAULTS.corruptions is None


def test_main_job_evaluate_section_takes_overrides_and_rejects_unknown_keys():
    config = load_run_config(None, ["evaluate.positions=[key,query]", "evaluate.seed=3"])
    assert config.evaluate.positions == ["key", "query"] and config.evaluate.seed == 3
    with pytest.raises(ConfigError, match="evaluate.posiitons"):
        load_run_config(None, ["evaluate.posiitons=[key]"])


def test_cli_evaluate_runs_the_chosen_positions_and_corruptions(trained, capsys):
    run, _ = trained
    code = main(
        ["evaluate", str(run), "--positions", "key", "query", "--corruptions", "key", "--force"]
    )
    assert code == 0, capsys.readouterr().err
    table = pd.read_parquet(run / "interventions.parquet")
    assert set(table["corruption"]) == {"key"}
    assert set(table["position"]) == {"key", "query"}
    evaluate_run(run, force=True)  # back to the defaults for the other tests on this run
