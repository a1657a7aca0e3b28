"""Batch: validation, indexing, device moves, trimming and concatenation."""

import numpy as np
import pytest
import torch

from mecheval.tasks import POSITION_NAMES, Batch, concat_batches, make_task


def toy_batch(n=4, width=6):
    """Documents of lengths width-1, width-2, width-3, ... cycling; PAD after each length."""
    lengths = torch.tensor([width - 1 - i % 3 for i in range(n)])
    tokens = torch.arange(3, 3 + n * width).reshape(n, width)
    tokens = tokens.masked_fill(torch.arange(width) >= lengths[:, None], 0)
    positions = {name: torch.full((n,), k) for k, name in enumerate(POSITION_NAMES)}
    return Batch(tokens, tokens[:, 0] + 100, positions, lengths)


def test_indexing_selects_documents_in_every_form():
    batch = toy_batch(6)
    cases = {
        "int": (batch[2], [2]),
        "numpy int": (batch[np.int64(3)], [3]),
        "0-d tensor": (batch[torch.tensor(1)], [1]),
        "numpy array": (batch[np.array([5, 1])], [5, 1]),
        "negative int": (batch[-1], [5]),
        "slice": (batch[1:4], [1, 2, 3]),
        "tensor": (batch[torch.tensor([4, 0])], [4, 0]),
        "list": (batch[[3, 3]], [3, 3]),
        "mask": (batch[torch.tensor([True, False, True, False, False, False])], [0, 2]),
    }
    for label, (selected, rows) in cases.items():
        assert isinstance(selected, Batch), label
        assert torch.equal(selected.tokens, batch.tokens[rows]), label
        assert torch.equal(selected.answers, batch.answers[rows]), label
        assert torch.equal(selected.lengths, batch.lengths[rows]), label
        for name in POSITION_NAMES:
            assert torch.equal(selected.positions[name], batch.positions[name][rows]), label
    assert len(batch) == 6 and len(batch[2:2]) == 0
    with pytest.raises(IndexError):
        batch[6]
    with pytest.raises(TypeError):
        batch[torch.tensor([0.5])]


def test_to_trim_and_concat():
    batch = toy_batch(4, width=8)
    assert batch.to("cpu").equals(batch) and batch.to(torch.device("cpu")).device.type == "cpu"
    trimmed = batch[1:3].trim()
    assert trimmed.width == int(batch.lengths[1:3].max())
    assert torch.equal(trimmed.tokens, batch.tokens[1:3, : trimmed.width])
    joined = concat_batches([batch[:1], batch[1:].trim()])
    assert joined.width == batch.width and joined.equals(batch)


def test_concat_pads_narrow_batches_with_pad():
    task = make_task("atr", max_rhs_len=5, num_terminals=20)
    a, b = task.sample(5, 0).trim(), task.sample(5, 1).trim()
    joined = concat_batches([a, b])
    assert joined.width == max(a.width, b.width)
    assert torch.equal(joined.tokens[:5, : a.width], a.tokens)
    assert (joined.tokens[:5, a.width :] == 0).all()


def test_validation_names_the_problem():
    batch = toy_batch()
    with pytest.raises(ValueError, match="2-D"):
        Batch(batch.tokens[0], batch.answers, batch.positions, batch.lengths)
    with pytest.raises(ValueError, match="positions"):
        Batch(batch.tokens, batch.answers, {"key": batch.answers}, batch.lengths)
    with pytest.raises(TypeError, match="int64"):
        Batch(batch.tokens.int(), batch.answers, batch.positions, batch.lengths)
    with pytest.raises(ValueError, match="answers"):
        Batch(batch.tokens, batch.answers[:2], batch.positions, batch.lengths)
