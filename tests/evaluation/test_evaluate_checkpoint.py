"""Probes: evaluation loads the checkpoint the run's result names (its step and the sha256 of
its weights), records the step it used, and when that checkpoint is missing, damaged or holds
other weights, says so in one line and stops; another step is used only when asked for
(`--step N`, `--step latest`)."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from mecheval.evaluation.evaluate import evaluate_run
from mecheval.run_folder.checkpoints import CheckpointError
from mecheval.train.loop import train
from tests.helpers import cli_line, tiny

pytestmark = pytest.mark.reliability

FINAL, OLDER = "step_000000008", "step_000000006"
SMALL = ["--positions", "key", "--corruptions", "key"]  # a small grid: the step is the point


def _trained(tmp_path):
    """8 steps, checkpoints 6 and 8 kept, the dev accuracy recorded every 2 steps."""
    run = tmp_path / "run"
    result = train(tiny("eval_every=2"), run)
    return run, result


def _dev_accuracy_at(run, step: int) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["dev_accuracy"] for r in records if r["step"] == step)


def test_the_results_checkpoint_is_evaluated_and_recorded(tmp_path):
    run, result = _trained(tmp_path)
    assert (result["checkpoint_step"], len(result["checkpoint_sha256"])) == (8, 64)
    table = evaluate_run(run, positions=["key"], corruptions=["key"])
    assert set(table["step"]) == {8}
    assert set(table["accuracy"]) == {result["dev_accuracy"]}  # the result's own accuracy


def test_a_missing_final_checkpoint_stops_evaluation_unless_another_is_asked_for(tmp_path, capsys):
    run, _ = _trained(tmp_path)
    shutil.rmtree(run / "checkpoints" / FINAL)
    code, line = cli_line(["evaluate", str(run), *SMALL], capsys)
    assert code == 1
    assert line == (
        f"mecheval: error: {run}/checkpoints/{FINAL}: missing; it is the checkpoint "
        f"{run}/result.json names (step 8); kept: steps 6; evaluate another step explicitly "
        "with --step N or --step latest"
    )
    assert not (run / "interventions.parquet").exists()
    for step in ("latest", "6"):
        from mecheval import cli

        assert cli.main(["evaluate", str(run), *SMALL, "--step", step]) == 0
        assert f"{run}: step 6, 32 documents" in capsys.readouterr().out
        table = pd.read_parquet(run / "interventions.parquet")
        assert set(table["step"]) == {6}
        assert set(table["accuracy"]) == {_dev_accuracy_at(run, 6)}  # recorded in training


@pytest.mark.parametrize("damage", ["garbage", "other-weights"])
def test_damaged_or_replaced_final_weights_stop_evaluation(tmp_path, capsys, damage):
    run, _ = _trained(tmp_path)
    final = run / "checkpoints" / FINAL
    if damage == "garbage":
        data = bytearray((final / "model.safetensors").read_bytes())
        data[-16:] = b"\x00" * 16
        (final / "model.safetensors").write_bytes(bytes(data))
        reason = "sha256 does not match the one recorded in state.json"
    else:  # a whole, self-consistent checkpoint, but not of the weights the result names
        shutil.rmtree(final)
        shutil.copytree(run / "checkpoints" / OLDER, final)
        reason = "not the weights the run's result names"
    code, line = cli_line(["evaluate", str(run), *SMALL], capsys)
    assert code == 1
    assert f"{final}/model.safetensors" in line and reason in line, line
    with pytest.raises(CheckpointError, match="evaluate another step explicitly"):
        evaluate_run(run)


def test_a_step_not_kept_is_named_with_the_steps_kept(tmp_path, capsys):
    run, _ = _trained(tmp_path)
    code, line = cli_line(["evaluate", str(run), *SMALL, "--step", "4"], capsys)
    assert code == 1
    assert line == (
        f"mecheval: error: {run}/checkpoints/step_000000004: missing; step 4 was asked for; "
        "kept: steps 6, 8"
    )


def test_a_result_written_before_it_named_step_and_checksum_still_names_its_checkpoint(
    tmp_path,
):
    run, _ = _trained(tmp_path)
    result = json.loads((run / "result.json").read_text())
    del result["checkpoint_step"], result["checkpoint_sha256"]
    (run / "result.json").write_text(json.dumps(result))
    table = evaluate_run(run, positions=["key"], corruptions=["key"])
    assert set(table["step"]) == {8}  # from the folder it names, step_000000008
