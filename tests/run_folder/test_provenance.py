"""A run names the code of its architecture (mecheval.run_folder.provenance): evaluate, das and
report refuse a run whose mixer's code changed since training, in one line naming both hashes,
unless --allow-code-change (the report then marks it); a run trained before the code was
recorded is named once and not refused; an architecture that cannot be had in another process
(a registered name, a module not on the path) or whose code fails is a one-line error of the
user's, exit 2, never "internal error"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mecheval import cli
from mecheval.models import register_mixer
from mecheval.models.registry import unregister_mixer
from mecheval.run_folder.provenance import AS_TRAINED, CHANGED, NOT_RECORDED, code_status
from tests.helpers import TINY, cli_line

REPO = Path(__file__).resolve().parents[2]
STEPS = ["steps=2", "eval_every=2", "checkpoint_every=2"]

MIXER = """
import torch
from torch import nn

from mecheval.layers import Mixer


class Mix(Mixer):
    def __init__(self, d_model):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        return self.proj(x).cumsum(1) / steps
"""
# The same parameters, another forward: the trained weights load, and mean something else.
EDITED = MIXER.replace("cumsum(1) / steps", "cumsum(1) / steps.sqrt()")


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    """A module of one's own in a folder of its own, the current directory (found as `python -m`
    would find it); returns (its name, its file)."""
    folder = tmp_path / "code"
    folder.mkdir()
    name = f"own_mixer_{uuid.uuid4().hex[:8]}"  # a new module for each test: no import cache
    path = folder / f"{name}.py"
    path.write_text(MIXER)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield name, path
    sys.modules.pop(name, None)


def _train(run: Path, arch: str) -> None:
    assert cli.main(["train", "--out", str(run), *TINY, *STEPS, f"arch={arch}"]) == 0


def test_a_run_records_the_code_of_its_architecture(tmp_path, own_module):
    name, path = own_module
    run = tmp_path / "runs" / "own"
    _train(run, f"mamba+{name}:Mix")
    code = json.loads((run / "result.json").read_text())["code"]
    assert set(code) == {"mamba", f"{name}:Mix"}
    assert code[f"{name}:Mix"]["sources"] == [str(path.resolve())]
    assert code["mamba"]["factory"] == "mecheval.models.zoo.mamba"
    assert "mecheval.layers.mamba.Mamba" in code["mamba"]["sources"]
    assert code_status(run) == (AS_TRAINED, "")


def test_an_edited_mixer_is_refused_naming_both_hashes_unless_allowed(tmp_path, own_module, capsys):
    """Before: the edited module evaluated without a word (accuracy 0.219 at training, 0.031
    at evaluation)."""
    name, path = own_module
    run = tmp_path / "runs" / "own"
    _train(run, f"{name}:Mix")
    before = json.loads((run / "result.json").read_text())["code"][f"{name}:Mix"]["sha256"]
    path.write_text(EDITED)
    status, detail = code_status(run)
    assert status == CHANGED
    for argv in (["evaluate", str(run)], ["das", str(run), "--steps", "1"], ["report", str(run)]):
        code, line = cli_line(argv, capsys)
        assert code == 1, argv
        hashes = re.findall(r"sha256 ([0-9a-f]{64}) at training, ([0-9a-f]{64}) now", line)
        assert hashes and hashes[0][0] == before and hashes[0][1] != before, line
        assert str(path.resolve()) in line and "--allow-code-change" in line
    assert not (run / "interventions.parquet").exists() and not (run / "das.parquet").exists()
    flags = ["--positions", "key", "value", "query", "--allow-code-change"]
    assert cli.main(["evaluate", str(run), *flags]) == 0
    assert json.loads((run / "interventions.json").read_text())["code"] == CHANGED
    assert cli.main(["report", str(run), "--allow-code-change"]) == 0
    report = (run / "report" / "report.md").read_text()
    runs_section = report.split("## Finished runs")[1].split("\n## ")[0]
    header, _, row = [line for line in runs_section.splitlines() if line.startswith("|")][:3]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[columns.index("code")] == CHANGED


def test_a_run_without_a_recorded_code_is_named_once_and_evaluated(tmp_path):
    """Runs trained before the code was recorded (the lead's study-scale runs) still evaluate."""
    runs = tmp_path / "runs"
    for seed in (1, 2):
        run = runs / f"seed{seed}"
        assert cli.main(["train", "--out", str(run), *TINY, *STEPS, f"seed={seed}"]) == 0
        result = json.loads((run / "result.json").read_text())
        del result["code"]
        (run / "result.json").write_text(json.dumps(result))
        assert code_status(run) == (NOT_RECORDED, "")
    process = _fresh_process(
        ["evaluate", str(runs), "--positions", "key", "--corruptions", "key"], cwd=tmp_path
    )
    assert process.returncode == 0, process.stderr
    notes = [line for line in process.stderr.splitlines() if "note:" in line]
    assert notes == [
        "mecheval: note: 2 run(s) (seed1, seed2) record no code of their architecture (trained "
        "before it was recorded): not checked against today's code"
    ]
    assert (runs / "seed1" / "interventions.parquet").exists()


def _fresh_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`mecheval argv` in a new Python process (nothing registered or imported by this one)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / '.imports'}"}
    command = [sys.executable, "-c", "from mecheval.cli import main; raise SystemExit(main())"]
    return subprocess.run(
        [*command, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _one_line(process: subprocess.CompletedProcess) -> str:
    lines = [line for line in process.stderr.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and "Traceback" not in process.stderr, process.stderr
    return lines[0]


def test_a_registered_name_in_a_fresh_process_says_how_to_make_it_importable(tmp_path, own_module):
    """Before: "internal error (a bug; please report it)", exit 3."""
    name, _ = own_module
    module = __import__(name)
    registered = f"mine_{uuid.uuid4().hex[:6]}"
    register_mixer(registered, module.Mix)
    try:
        run = tmp_path / "runs" / "mine"
        _train(run, registered)
    finally:
        unregister_mixer(registered)
    process = _fresh_process(["evaluate", str(run)], cwd=tmp_path)
    assert process.returncode == 2
    line = _one_line(process)
    assert f"unknown arch '{registered}': not registered in this process" in line
    assert "name the mixer by import path instead (arch=package.module:Name" in line
    # The report reads tables alone: it goes on, the run's code marked as not checked.
    report = _fresh_process(["report", str(run)], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    (note,) = [line for line in report.stderr.splitlines() if "note:" in line]
    assert note.startswith("mecheval: note: 1 run(s)' code not checked, their architecture")
    assert "| not checked |" in (run / "report" / "report.md").read_text()


def test_a_module_that_is_not_on_the_path_is_named_with_the_fix(tmp_path, own_module):
    """Evaluated from another directory: before, "internal error", exit 3."""
    name, _ = own_module
    run = tmp_path / "runs" / "own"
    _train(run, f"{name}:Mix")
    process = _fresh_process(["evaluate", str(run)], cwd=tmp_path)
    assert process.returncode == 2
    line = _one_line(process)
    assert f"arch '{name}:Mix': cannot import '{name}'" in line
    assert "run from the folder that holds it, or put that folder on PYTHONPATH" in line
    ok = _fresh_process(["evaluate", str(run), "--positions", "key"], cwd=tmp_path / "code")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(
    "source, line_number, error",
    [
        (MIXER.replace("super().__init__()", "super().__init__()\n        1 / 0"), 11,
         "ZeroDivisionError: division by zero"),
        (MIXER.replace("def forward(self, x):", "def forward(self, x)"), 13, "SyntaxError: "),
        (MIXER.replace("from torch import nn", "from torch import nn\nimport no_such_dep"), 4,
         "ModuleNotFoundError: No module named 'no_such_dep'"),
    ],
    ids=["constructor-raises", "syntax-error", "import-fails"],
)  # fmt: skip
def test_the_users_own_code_failing_is_their_error_with_file_and_line(
    tmp_path, own_module, capsys, source, line_number, error
):
    """Before: a constructor that raises, or a syntax error, was "a bug of mecheval", exit 3."""
    name, path = own_module
    path.write_text(source)
    argv = ["train", "--out", str(tmp_path / "run"), *TINY, f"arch={name}:Mix"]
    code, line = cli_line(argv, capsys)
    assert code == 2
    assert line.startswith(f"mecheval: error in the architecture's code: arch '{name}:Mix': ")
    assert f"failed at {path}, line {line_number}: {error}" in line


def test_das_of_a_run_whose_module_no_longer_compiles_names_the_users_line(tmp_path, own_module):
    name, path = own_module
    run = tmp_path / "runs" / "own"
    _train(run, f"{name}:Mix")
    path.write_text(MIXER.replace("def forward(self, x):", "def forward(self, x)"))
    process = _fresh_process(["das", str(run), "--steps", "1"], cwd=path.parent)
    assert process.returncode == 2
    line = _one_line(process)
    assert line.startswith(f"mecheval: error in the architecture's code: arch '{name}:Mix': ")
    assert f"importing '{name}' failed at {path}, line 13: SyntaxError: " in line
    assert not (run / "das.parquet").exists()
