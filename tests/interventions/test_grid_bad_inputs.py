"""Probes: bad inputs get clear errors naming the argument: a model whose vocabulary is smaller
than the task's tokens, an empty batch, corrupting a task with one key, a scan with batch 0."""

from __future__ import annotations

import pytest
import torch

import mecheval_kernels
from mecheval.interventions import interchange_grid
from mecheval.models import build_model
from mecheval.tasks import make_task

pytestmark = pytest.mark.reliability

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _model(vocab_size: int):
    torch.manual_seed(0)
    return build_model("attention", vocab_size, 16, max_len=TASK.max_document_length)


def test_interchange_grid_refuses_a_model_with_a_smaller_vocabulary():
    batch = TASK.sample(3, seed=0, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=0)
    with pytest.raises(ValueError, match=r"batch.tokens holds token ids .*\(vocab_size 10\)"):
        interchange_grid(_model(10), batch, corrupted)


def test_interchange_grid_refuses_corrupted_tokens_outside_the_vocabulary():
    batch = TASK.sample(3, seed=0, split="dev")
    corrupted = batch.tokens.clone()
    corrupted[0, 1] = TASK.vocab_size + 5
    with pytest.raises(ValueError, match="corrupted holds token ids"):
        interchange_grid(_model(TASK.vocab_size), batch, corrupted)


def test_interchange_grid_refuses_an_empty_batch():
    batch = TASK.sample(3, seed=0, split="dev")[:0]
    with pytest.raises(ValueError, match="batch is empty"):
        interchange_grid(_model(TASK.vocab_size), batch, batch.tokens)


@pytest.mark.parametrize("at", ["key", "value"])
def test_corrupting_a_one_key_task_is_refused(at):
    task = make_task("ar", num_pairs=1, num_keys=1)
    batch = task.sample(4, seed=0)
    if at == "value":  # values are replaced by other ids than the original: still possible
        assert not torch.equal(task.corrupt(batch, "value", seed=0), batch.tokens)
        return
    with pytest.raises(ValueError, match=r"corrupt: .* draws replacements at 'key' from ids"):
        task.corrupt(batch, "key", seed=0)


def test_selective_scan_with_batch_zero_is_refused_by_name():
    d, n, length = 4, 3, 5
    u = torch.randn(0, d, length)
    A = -torch.rand(d, n)
    B = torch.randn(0, n, length)
    with pytest.raises(ValueError, match=r"selective_scan_fn: u .* \(batch B >= 1\), got B = 0"):
        mecheval_kernels.selective_scan_fn(u, u, A, B, B, backend="torch")
    with pytest.raises(ValueError, match="got B = 0"):
        mecheval_kernels.selective_scan_fn(u, u, A, B, B, backend="triton")
