"""Probes: damaged checkpoints (truncated weights or optimizer file, garbage bytes, broken or
altered state.json) are detected by their checksums, named, skipped with a warning, and the run
resumes from the newest intact one, ending bitwise where an undamaged run ends; a missing or
dangling `latest` pointer is derived from the folders; pruning never deletes the newest."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mecheval.run_folder.checkpoints import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mecheval.run_folder.weights import load_trained_model, run_checkpoint
from mecheval.train.loop import train
from tests.helpers import checkpoint_steps, tiny

pytestmark = pytest.mark.reliability

NEWEST, OLDER = "step_000000008", "step_000000006"


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _garbage(path):
    """64 bytes of garbage in the middle of the tensor data: the file still parses."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(range(64))
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated-weights": ("model.safetensors", _truncate),
    "garbage-in-weights": ("model.safetensors", _garbage),
    "truncated-optimizer": ("optimizer.safetensors", _truncate),
    "truncated-rng": ("rng.safetensors", lambda p: _truncate(p, 0.9)),
    "broken-state": ("state.json", lambda p: _truncate(p, 0.3)),
    "altered-state": (
        "state.json",
        lambda p: p.write_text(p.read_text().replace('"step": 8', '"step": 80')),
    ),
    "missing-weights": ("model.safetensors", lambda p: p.unlink()),
}


def _weights(run):
    return load_file(latest_checkpoint(run / "checkpoints") / "model.safetensors")


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture
def whole(tmp_path):
    """An undamaged 8-step run: what every damaged-and-resumed run must end as."""
    run = tmp_path / "whole"
    train(tiny(), run)
    return _weights(run)


def _finished_then_reopened(tmp_path, name="damaged"):
    """A finished run with its result removed, so that the next train() resumes it."""
    run = tmp_path / name
    train(tiny(), run)
    (run / "result.json").unlink()
    return run


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, whole, kind):
    run = _finished_then_reopened(tmp_path)
    file, damage = DAMAGE[kind]
    damage(run / "checkpoints" / NEWEST / file)
    with pytest.warns(RuntimeWarning, match=f"skipped checkpoint .*{NEWEST}.*{file}"):
        result = train(tiny(), run)
    assert result["steps"] == 8
    _assert_same_weights(whole, _weights(run))  # resumed from step 6, bitwise as if undamaged
    assert checkpoint_steps(run) == [OLDER, NEWEST]
    aside = run / "checkpoints" / f".damaged-{NEWEST}"  # kept for inspection, never loaded
    assert aside.is_dir() and ((aside / file).exists() or kind == "missing-weights")
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]  # none lost, none duplicated


def test_every_checkpoint_damaged_restarts_from_scratch_with_a_warning_each(tmp_path, whole):
    run = _finished_then_reopened(tmp_path)
    for name in (OLDER, NEWEST):
        _garbage(run / "checkpoints" / name / "model.safetensors")
    with pytest.warns(RuntimeWarning) as caught:
        train(tiny(), run)
    skipped = [str(w.message) for w in caught if "skipped checkpoint" in str(w.message)]
    assert len(skipped) == 2 and NEWEST in skipped[0] and OLDER in skipped[1]
    _assert_same_weights(whole, _weights(run))  # a fresh start, seeded as the first one


@pytest.mark.parametrize("pointer", ["missing", "dangling", "older"])
def test_latest_pointer_is_derived_from_the_folders(tmp_path, pointer):
    run = _finished_then_reopened(tmp_path)
    latest = run / "checkpoints" / "latest"
    if pointer == "missing":
        latest.unlink()
    else:
        latest.write_text("step_000000099\n" if pointer == "dangling" else OLDER + "\n")
    assert latest_checkpoint(run / "checkpoints").name == NEWEST
    result = train(tiny(), run)  # resumes at step 8: nothing to train, nothing pruned
    assert result["steps"] == 8
    assert checkpoint_steps(run) == [OLDER, NEWEST]
    assert latest.read_text().strip() == NEWEST


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=1)
    # A run that fell back to step 10 writes step 11: it is the newest and is kept; the
    # history past it (step 30) is gone, so `latest` cannot point back into it.
    save_checkpoint(tmp_path, 11, model, optimizer, {}, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000011"]
    assert latest_checkpoint(tmp_path).name == "step_000000011"


def test_loading_a_damaged_checkpoint_names_the_file(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    _truncate(path / "optimizer.safetensors")
    load_checkpoint(path, model)  # the weights alone are intact
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        load_checkpoint(path, model, optimizer)
    (path / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="state.json"):
        load_checkpoint(path, model)


def test_checkpoints_without_checksums_still_load(tmp_path):
    """Checkpoints written before checksums existed load as before."""
    model, optimizer = _model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"best_accuracy": 0.5})
    state = json.loads((path / "state.json").read_text())
    del state["checksums"], state["state_sha256"]
    (path / "state.json").write_text(json.dumps(state))
    assert load_checkpoint(path, model, optimizer)["best_accuracy"] == 0.5


def test_evaluation_refuses_damaged_final_weights_by_name(tmp_path):
    run = tmp_path / "run"
    train(tiny(), run)
    _garbage(run / "checkpoints" / NEWEST / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{NEWEST}/model.safetensors"):
        load_trained_model(run)
    shutil.rmtree(run / "checkpoints" / NEWEST)
    with pytest.raises(CheckpointError, match=f"{NEWEST}: missing; it is the checkpoint"):
        load_trained_model(run)  # never the older one, unless asked for
    older, step = run_checkpoint(run, "latest")
    assert (older.name, step) == (OLDER, 6)
    model, _, _ = load_trained_model(run, checkpoint=older)
    expected = load_file(older / "model.safetensors")
    assert all(torch.equal(p, expected[n]) for n, p in model.state_dict().items() if n in expected)
