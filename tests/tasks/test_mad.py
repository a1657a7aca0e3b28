"""MAD's recall tasks, read off the documents as mad-lab's generators define them: pairs whose
key keeps its value within a document, noise pairs, the final probe, the test targets (every
repeated key with multi_query) as rows, training on every next token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.tasks import make_task


def _recalls_read_off(tokens: np.ndarray, keys: range, motif=1) -> list[tuple[int, int]]:
    """(position that predicts, answer) of every repeated key in a sequence of pairs."""
    seen, out = {}, []
    for at in range(0, len(tokens) - 1, 2):
        key, value = int(tokens[at]), int(tokens[at + 1])
        if key in keys:
            if key in seen:
                out.append((at, value))
            seen[key] = value
    return out


@pytest.mark.parametrize("name", ["mad_recall", "mad_noisy_recall"])
def test_in_context_recall_rows_are_the_repeated_keys(name):
    task = make_task(name)
    batch = task.sample(30, 0, "dev")
    keys, values = range(task.key_ids), range(task.key_ids, task.first_noise)
    for d in range(30):
        rows = batch.document == d
        tokens = batch.tokens[rows][0].numpy()
        full = np.append(tokens, batch.targets[rows][0, -1].item())  # the final value
        pairs = full.reshape(-1, 2)
        mapping = {}
        for key, value in pairs:
            if key in keys:
                assert value in values and mapping.setdefault(key, value) == value
            else:
                assert key >= task.first_noise and value >= task.first_noise  # noise pair
        expected = _recalls_read_off(full, keys)
        got = list(zip(batch.positions["query"][rows].tolist(), batch.answers[rows].tolist(),
                       strict=True))  # fmt: skip
        assert got == expected
    if name == "mad_noisy_recall":
        noise = (batch.tokens >= task.first_noise).float().mean()
        assert 0.1 < noise < 0.3  # a fifth of the pairs


def test_training_learns_every_next_token_and_keeps_the_final_probe_as_its_row():
    task = make_task("mad_recall")
    batch = task.sample(10, 0, "train")
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    assert batch.num_documents == len(batch) == 10
    assert torch.equal(batch.positions["query"], torch.full((10,), 126))


def test_single_query_puts_the_copy_prefix_before_the_probe():
    task = make_task("mad_recall", multi_query=False)
    batch = task.sample(10, 0, "test")
    assert len(batch) == 10 and batch.lengths.eq(128).all()
    assert (batch.tokens[:, -2] == task.vocab_size - 1).all()
    assert task.format(batch.tokens[0]).split()[-2] == "COPY"
    rows = torch.arange(10)
    assert torch.equal(batch.tokens[rows, batch.positions["key"]], batch.tokens[:, -1])


@pytest.mark.parametrize("split, sizes", [("test", {3}), ("train", {1, 2, 3})])
def test_fuzzy_recall_motifs(split, sizes):
    task = make_task("mad_fuzzy_recall")
    batch = task.sample(40, 0, split)
    key_sizes = set()
    for row in range(len(batch)):
        tokens = batch.tokens[row]
        (k0, k1), (v0, v1) = batch.spans["key"][row].tolist(), batch.spans["value"][row].tolist()
        q0, q1 = batch.spans["query"][row].tolist()
        key, value, asked = tokens[k0:k1], tokens[v0:v1], tokens[q0:q1]
        assert k1 == v0 and torch.equal(key, asked) and len(set(key.tolist())) == len(key)
        assert (key < task.key_ids).all() and (
            (value >= task.key_ids) & (value < task.first_noise)
        ).all()
        assert batch.answers[row] == value[0] and batch.positions["query"][row] == q1 - 1
        key_sizes.add(k1 - k0)
    assert key_sizes <= sizes and (split == "test" or len(key_sizes) > 1)
    assert (batch.tokens[:, 0] == task.vocab_size - 1).any()  # padded on the left


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("mad_recall", {"seq_len": 127}, "must be even"),
        ("mad_recall", {"frac_noise": 0.2}, "needs noise_vocab_size > 0"),
        ("mad_recall", {"vocab_size": 4, "noise_vocab_size": 4}, "leaves no key ids"),
        ("mad_fuzzy_recall", {"seq_len": 16}, "too short"),
    ],
)
def test_impossible_settings_are_refused_by_name(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_task(name, **options)
