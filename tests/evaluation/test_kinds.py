"""Intervention kinds through the command line: `mecheval evaluate --kind NAME` on a trained
run writes the kind's table and stamp, skips a run evaluated with equal settings, takes a kind
of one's own by import path, and refuses a bad kind or option in one line."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mecheval import cli
from tests.helpers import TINY, cli_line

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("kinds") / "mamba"
    steps = ["steps=4", "eval_every=2", "arch=mamba"]
    assert cli.main(["train", "--out", str(run), *TINY, *steps]) == 0
    return run


@pytest.mark.parametrize(
    "kind, options, rows",
    [
        ("path", ["layers=[0]"], {"route": {"conv", "state", "kv", "residual"}}),
        ("mean_ablation", ["positions=[key,query]"], {"position": {"key", "query"}}),
        ("examples.zero_ablation:ZeroAblation", [], {"corruption": {"none"}}),
        ("eap", ["layers=[1]"], {"layer": {1}}),
    ],
)
def test_a_kind_writes_its_table_and_stamp(run, kind, options, rows):
    flags = [x for option in options for x in ("--option", option)]
    assert cli.main(["evaluate", str(run), "--kind", kind, *flags]) == 0
    name = kind.split(":")[-1].lower().replace("zeroablation", "zero_ablation")
    table = pd.read_parquet(run / f"{name}.parquet")
    for column, values in rows.items():
        assert set(table[column]) == values
    stamp = json.loads((run / f"{name}.json").read_text())
    assert stamp["settings"]["kind"] == kind and f"{name}.parquet" in stamp["files"]
    before = (run / f"{name}.parquet").stat().st_mtime_ns
    assert cli.main(["evaluate", str(run), "--kind", kind, *flags]) == 0
    assert (run / f"{name}.parquet").stat().st_mtime_ns == before  # equal settings: skipped


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--kind", "nope"], "--kind: unknown intervention kind 'nope'"),
        (["--kind", "path", "--option", "routes=[conv]"], "unknown option(s) ['routes']"),
        (["--option", "layers=[0]"], "--option: the grid takes its options as flags"),
    ],
)
def test_a_bad_kind_or_option_is_one_line(run, capsys, argv, words):
    code, line = cli_line(["evaluate", str(run), *argv], capsys)
    assert code == 2 and words in line


def test_the_kinds_tables_summarise_and_screens_agree(run):
    from mecheval.evaluation.kind_report import kind_sections, kind_tables, screen_agreement

    for kind, options in (("path", "layers=[0,1]"), ("eap", "layers=[0,1]")):
        assert cli.main(["evaluate", str(run), "--kind", kind, "--option", options]) == 0
    runs = pd.DataFrame({"run": [run.name], "path": [str(run)]})
    tables = kind_tables(runs)
    assert {"path", "eap"} <= set(tables)
    assert {"route", "value", "low", "high"} <= set(tables["path"].columns)
    agreement = screen_agreement(tables)  # a 4-step model: its cells may have no effect
    assert set(agreement.screen) == {"eap"} and set(agreement.run) == {run.name}
    titles = [title for title, _, _ in kind_sections(runs)]
    assert "EAP against exact path patching" in titles


def test_the_report_has_a_section_per_kind(run):
    for kind, options in (("path", "layers=[0]"), ("mean_ablation", "positions=[key]")):
        assert cli.main(["evaluate", str(run), "--kind", kind, "--option", options]) == 0
    assert cli.main(["evaluate", str(run)]) == 0
    assert cli.main(["report", str(run)]) == 0
    report = (run / "report" / "report.md").read_text()
    assert "## Path patching: each route's share of the sender's effect" in report
    assert "## Mean ablation (drop of the answer's probability)" in report
    assert "## Routes over seeds (path patching)" in report
    routes = pd.read_parquet(run / "report" / "routes.parquet")
    assert set(routes["route"]) <= {"conv", "state", "kv", "residual"}
    html = (run / "report" / "report.html").read_text()
    assert "Path patching" in html
