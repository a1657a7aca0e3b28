"""The main job: train a grid of models, evaluate their mechanisms, write the report.

    mecheval run [CONFIG] [--out DIR] [key=value ...]

Without a config it runs configs/quickstart.yaml, the CPU quickstart: attention, Based, Mamba,
Mamba without its short conv and DeltaNet (two seeds each; and, beyond the study, Gated
DeltaNet and Mamba-2), H3 and Hyena on a small associative-recall task (4 pairs over 16 keys),
and attention, Based and Mamba without its short conv on a small associative-treecall task
((5, 20) grammars), which a 2-core machine trains, evaluates and reports in about thirteen
minutes (docs/benchmarks.md). Its report's Findings table says which of the study's five
findings show at this scale. Another config file (see configs/) runs another sweep, e.g. the
study's full grids on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from mecheval.config import load_config
from mecheval.evaluation.config import EvaluateConfig, OptionError, check_options
from mecheval.evaluation.documents import documents_of
from mecheval.evaluation.evaluate import evaluate_all
from mecheval.evaluation.report import build_report, read_report_table
from mecheval.sweep import Executor, execution_of, expand_sweep, run_sweep

# The default main job, configs/quickstart.yaml, shipped inside the package (setup.py).
QUICKSTART = Path(__file__).with_name("quickstart.yaml")


@dataclass
class RunConfig:
    """The main job: a sweep spec (base + grid, as in a sweep file), how to run it (its executor,
    workers, retries and Ray address; `stack`: runs that differ only in seed and optimiser
    settings train as stacked models), and how to evaluate the trained models."""

    sweep: dict
    executor: Executor = "local"
    workers: int = 2
    retries: int = 0
    address: str | None = None
    stack: bool = True
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)


def load_run_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run config in `path` (without one, the CPU quickstart, `QUICKSTART`), with
    `key=value` overrides (`sweep.base.steps=5`, `workers=4`)."""
    return load_config(RunConfig, QUICKSTART if path is None else path, overrides)


def run_pipeline(config: RunConfig, out: str | Path, progress: bool = True) -> dict:
    """Train (or resume) every run, evaluate every finished one, write the report. The
    `evaluate:` section is checked against every run's task first (`check_evaluation`).

    Returns:
        {"results": sweep table, "mechanisms": read-out table, "report": report folder}
    """
    out = Path(out)
    runs = expand_sweep(config.sweep)
    check_evaluation(config.evaluate, [run.config for run in runs])
    table = run_sweep(runs, out, progress=progress, **execution_of(config))
    if (table["status"] == "finished").any():
        evaluate_all(out, progress=progress, **asdict(config.evaluate))
    report = build_report(out)
    evidence = read_report_table(report, "evidence")
    findings = read_report_table(report, "findings")
    return {"results": table, "mechanisms": evidence, "findings": findings, "report": report}


def check_evaluation(options: EvaluateConfig, configs: Sequence) -> None:
    """Check the `evaluate:` section against every task the runs train on (their evaluation
    documents), before any run trains: a bad option fails now, not after the training.

    Raises:
        ConfigError: naming the option (`evaluate.<name>`), the bad value and what is allowed.
    """
    try:
        documents_of(configs, check_options(options))
    except OptionError as error:
        raise error.renamed(lambda option: f"evaluate.{option}") from None


def summary(mechanisms: pd.DataFrame, findings: pd.DataFrame | None = None) -> str:
    """The findings' verdicts and the mechanism table as text, for the terminal."""
    lines = []
    if findings is not None and not findings.empty:
        lines += [f"finding {r.finding}: {r.verdict:22s} {r.claim}" for r in findings.itertuples()]
    if mechanisms.empty or "mechanism" not in mechanisms:
        return "\n".join([*lines, "no evaluated run"])
    columns = [
        c
        for c in (
            "task",
            "arch",
            "d_model",
            "dev_accuracy",
            "induction",
            "direct_early",
            "direct_late",
            "mechanism",
        )
        if c in mechanisms
    ]
    table = mechanisms[mechanisms["mechanism"].notna()][columns]
    return "\n".join([*lines, table.to_string(index=False, float_format=lambda v: f"{v:.3f}")])
