"""Checkpoints: exact round trip of weights, optimiser and RNG; atomic publication; pruning."""

from __future__ import annotations

import pytest
import torch

from mecheval.io import atomic_write_text
from mecheval.models import ARCHITECTURES, build_model
from mecheval.run_folder.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    return model, optimizer


def _step(model, optimizer, seed):
    torch.manual_seed(seed)
    loss = model(torch.randn(5, 4)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_round_trip_continues_bitwise(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    for i in range(3):
        _step(model, optimizer, i)
    save_checkpoint(tmp_path, 3, model, optimizer, {"best_accuracy": 0.5})
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    for i in range(3, 6):
        _step(model, optimizer, i)

    restored, restored_opt = _model_and_optimizer(99)  # different initial weights
    state = load_checkpoint(latest_checkpoint(tmp_path), restored, restored_opt)
    assert state["step"] == 3 and state["best_accuracy"] == 0.5
    assert restored_opt.param_groups[0]["betas"][0] == 0.8
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), expected_draw)
    for i in range(3, 6):
        _step(restored, restored_opt, i)
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_latest_points_to_newest_complete_and_old_ones_are_pruned(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer, 0)
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=2)
    assert latest_checkpoint(tmp_path).name == "step_000000030"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000020", "step_000000030"]
    # A kill mid-write leaves a temporary folder: it is neither "latest" nor kept.
    (tmp_path / ".tmp-step_000000040-1").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000000030"
    save_checkpoint(tmp_path, 40, model, optimizer, {}, keep=2)
    assert not list(tmp_path.glob(".tmp-*"))


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_atomic_write_leaves_old_content_when_the_writer_fails(tmp_path):
    path = tmp_path / "file.txt"
    atomic_write_text(path, "old")

    class Boom(Exception):
        pass

    from mecheval.io import atomic_write

    def failing(p):
        p.write_text("half")
        raise Boom

    with pytest.raises(Boom):
        atomic_write(path, failing)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_round_trips(arch, tmp_path):
    """Hyena's filter shares one Sin module (one tensor under several names) across its MLP:
    the checkpoint stores it once and restores every name."""
    torch.manual_seed(0)
    model = build_model(arch, 20, 8, max_len=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_checkpoint(tmp_path, 1, model, optimizer, {})
    torch.manual_seed(1)
    restored = build_model(arch, 20, 8, max_len=6)
    load_checkpoint(latest_checkpoint(tmp_path), restored)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), restored.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    if arch == "hyena":
        act = restored.layers[0].mixer.filter_fn.implicit_filter
        assert act[1].freq is act[3].freq  # still one shared tensor after loading
