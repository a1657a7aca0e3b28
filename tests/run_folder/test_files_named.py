"""Probes: every file the package reads from a run folder is named in its error (config.yaml
empty, not YAML or not UTF-8; result.json damaged); malformed metrics.jsonl lines (no `step`,
not UTF-8, not JSON) are skipped with a warning naming the file, never a bare KeyError."""

from __future__ import annotations

import json
import re

import pytest

from mecheval import cli
from mecheval.io import DamagedFileError
from mecheval.run_folder.weights import load_trained_model
from mecheval.sweep import expand_sweep, run_sweep
from mecheval.train.loop import train
from tests.helpers import TINY, tiny

pytestmark = pytest.mark.reliability

CONFIG_DAMAGE = {
    "empty": (b"", "empty"),
    "not-yaml": (b"task: {name: ar\n", "not valid YAML"),
    "not-utf8": (b"task:\n  name: \xff\xfe\n", "not UTF-8"),
    "a-list": (b"- 1\n- 2\n", "not a mapping"),
    "unknown-key": (b"stepz: 3\n", "unknown config key 'stepz'"),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_DAMAGE))
def test_a_damaged_config_yaml_is_named(tmp_path, kind):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    data, reason = CONFIG_DAMAGE[kind]
    (run / "config.yaml").write_bytes(data)
    with pytest.raises(DamagedFileError, match=f"{run / 'config.yaml'}.*{reason}"):
        load_trained_model(run)
    with pytest.raises(DamagedFileError, match="config.yaml"):  # finished: compared first
        train(tiny("steps=2"), run)
    (run / "result.json").unlink()
    with pytest.raises(DamagedFileError, match="config.yaml"):  # unfinished: resumed
        train(tiny("steps=2"), run)


def test_cli_names_the_damaged_file(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["train", "--out", str(out), *TINY, "steps=2"]) == 0
    (out / "config.yaml").write_text("")
    assert cli.main(["train", "--out", str(out), *TINY, "steps=2"]) == 1
    assert f"{out / 'config.yaml'}: the run config is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,reason",
    [(b"{", "not valid JSON"), (b"\xff\xfe", "not UTF-8"), (b'{"steps": 2}', "lacks config")],
)
def test_a_damaged_result_json_is_named(tmp_path, content, reason):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    (run / "result.json").write_bytes(content)
    with pytest.raises(DamagedFileError, match=f"result.json.*{reason}"):
        train(tiny("steps=2"), run)


def test_a_sweep_records_a_damaged_result_by_name_and_goes_on(tmp_path):
    base = {
        "task": {"options": {"num_pairs": 4, "num_keys": 16}, "train_size": 320, "eval_size": 32},
        "model": {"d_model": 16},
        "steps": 2,
        "backend": "torch",
    }
    runs = expand_sweep({"base": base, "grid": {"seed": [1, 2]}})
    run_sweep(runs, tmp_path, progress=False)
    (tmp_path / runs[0].name / "result.json").write_text("{")
    table = run_sweep(runs, tmp_path, progress=False).set_index("run")
    assert table.loc[runs[0].name, "status"] == "failed"
    assert "result.json" in table.loc[runs[0].name, "error"]
    assert table.loc[runs[1].name, "status"] == "finished"


def test_malformed_metrics_lines_are_skipped_with_a_warning(tmp_path):
    run = tmp_path / "run"
    train(tiny(), run)
    (run / "result.json").unlink()
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    damaged = [
        lines[0],
        b'{"loss": 1.0}\n',  # no step
        b'{"step": "4"}\n',  # a step that is not an integer
        b"\xff\xfe garbage\n",  # not UTF-8
        b"[1, 2]\n",  # not a record
        *lines[1:],
        b'{"step": 9, "lo',  # cut short by a kill: skipped silently
    ]
    metrics.write_bytes(b"".join(damaged))
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: skipped malformed line\(s\) 2 ") as w:
        assert train(tiny(), run)["steps"] == 8
    message = str(w[0].message)
    assert "2 (no integer 'step')" in message and "4 (not UTF-8)" in message
    reported = message.split("skipped malformed line(s) ", 1)[1]  # after the path
    assert re.findall(r"(\d+) \(", reported) == ["2", "3", "4", "5"]  # not the cut line
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [2, 4, 6, 8]
