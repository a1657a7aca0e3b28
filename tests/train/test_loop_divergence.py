"""Probe: a run whose loss is NaN stops with a clear error after `max_nonfinite_steps`
consecutive steps, keeping its last good checkpoint and writing no result, instead of
"finishing" with NaN weights."""

from __future__ import annotations

import math

import pytest
import torch.nn.functional as F

from mecheval.config import ConfigError
from mecheval.train.loop import TrainingDiverged, train
from tests.helpers import checkpoint_steps, tiny

pytestmark = pytest.mark.reliability


def _nan_loss(monkeypatch, steps, poison_weights=True):
    """The training loss is NaN at these (1-based) steps. Poisoned: NaN gradients too (as a real
    blow-up); else only the loss value is NaN and the weights stay finite."""
    real = F.cross_entropy
    calls = []

    def cross_entropy(logits, target, *args, **kwargs):
        loss = real(logits, target, *args, **kwargs)
        if logits.requires_grad:  # training steps only, not evaluation
            calls.append(1)
            if len(calls) in steps:
                return loss * math.nan if poison_weights else loss + (loss.detach() * math.nan)
        return loss

    monkeypatch.setattr("mecheval.train.steps.F.cross_entropy", cross_entropy)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _nan_loss(monkeypatch, steps=range(6, 100))
    run = tmp_path / "run"
    config = tiny("steps=20", "checkpoint_every=4", "keep_checkpoints=1")
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps \(6\.\.8") as error:
        train(config, run)
    assert "step_000000004" in str(error.value) and "no result written" in str(error.value)
    assert not (run / "result.json").exists()
    assert checkpoint_steps(run) == ["step_000000004"]  # step 8's NaN weights never saved


def test_the_limit_is_a_config_field(tmp_path, monkeypatch):
    _nan_loss(monkeypatch, steps=range(3, 100))
    with pytest.raises(TrainingDiverged, match=r"1 consecutive steps \(3\.\.3"):
        train(tiny("steps=20", "max_nonfinite_steps=1"), tmp_path / "run")
    with pytest.raises(ConfigError, match="max_nonfinite_steps must be >= 1"):
        tiny("max_nonfinite_steps=0")


def test_a_short_nan_streak_with_finite_weights_does_not_stop_the_run(tmp_path, monkeypatch):
    _nan_loss(monkeypatch, steps={3, 4}, poison_weights=False)
    result = train(tiny(), tmp_path / "run")
    assert result["steps"] == 8 and (tmp_path / "run" / "result.json").exists()


def test_nan_at_the_last_steps_writes_no_result(tmp_path, monkeypatch):
    _nan_loss(monkeypatch, steps={7, 8}, poison_weights=False)
    with pytest.raises(TrainingDiverged, match="non-finite at the last 2 step"):
        train(tiny(), tmp_path / "run")
    assert not (tmp_path / "run" / "result.json").exists()


def test_non_finite_weights_are_never_checkpointed(tmp_path, monkeypatch):
    """NaN gradients at step 4 (just before a checkpoint), one step short of the limit: the
    checkpoint of step 4 would hold NaN weights, so the run stops there instead."""
    _nan_loss(monkeypatch, steps={4})
    with pytest.raises(TrainingDiverged, match="weights are non-finite after step 4"):
        train(tiny(), tmp_path / "run")
    assert checkpoint_steps(tmp_path / "run") == ["step_000000002"]
