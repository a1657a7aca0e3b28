"""Mean and resample ablation against a plain loop: one clean document at a time, the site's
activation at the position replaced by the mean over documents (or another document's) with a
forward hook, every pass from the embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mecheval.interventions.ablation import ablation_grid, derangement
from mecheval.interventions.plan import select_sites
from mecheval.interventions.positions import resolve_position
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _values(model, batch, name, where):
    """Each document's clean activation of site `name` at its position `where` (n, ...)."""
    rows = torch.arange(len(batch))
    if name.endswith(".state"):
        with model.intervene(reads={name: where}) as record:
            model(batch.tokens)
        return record[name]
    with model.intervene(reads={name: None}) as record:
        model(batch.tokens)
    return record[name][rows, where]


def _loop(model, batch, kind, seed=0):
    n, other = len(batch), derangement(len(batch), seed)
    out = {}
    for ref in select_sites(model):
        for label in ("key", "value", "divider", "query"):
            where = resolve_position(label, batch)
            values = _values(model, batch, ref.name, where)
            values = (
                values.mean(0, keepdim=True).expand_as(values) if kind == "mean" else values[other]
            )
            for i in range(n):
                patch = {ref.name: (where[i : i + 1], values[i : i + 1])}
                with model.intervene(patches=patch):
                    logits = model(batch.tokens[i : i + 1])
                q, a = int(batch.positions["query"][i]), int(batch.answers[i])
                out[(i, ref.layer, ref.short, label)] = F.softmax(logits[0, q], -1)[a].item()
    return out


@pytest.mark.parametrize("kind", ["mean", "resample"])
@pytest.mark.parametrize("arch", ["mamba", "deltanet", "attention", "mamba+attention"])
def test_ablation_equals_the_plain_loop(arch, kind):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    batch = TASK.sample(5, seed=3, split="dev")
    table = ablation_grid(model, batch, kind)
    loop = _loop(model, batch, kind)
    assert len(table) == len(loop)
    ours = np.array([loop[(r.example, r.layer, r.site, r.position)] for r in table.itertuples()])
    np.testing.assert_allclose(table.p_restored.to_numpy(), ours, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(table.p_corrupted, table.p_original, atol=1e-5, rtol=1e-4)


def test_a_derangement_moves_every_document_and_bad_kinds_are_refused():
    for n in (2, 3, 10):
        perm = derangement(n, seed=n)
        assert sorted(perm.tolist()) == list(range(n)) and (perm != torch.arange(n)).all()
    model = build_model("attention", TASK.vocab_size, 16, max_len=TASK.max_document_length)
    with pytest.raises(ValueError, match="kind must be one of"):
        ablation_grid(model, TASK.sample(3, seed=0), "zero")
    with pytest.raises(ValueError, match="at least 2 documents"):
        ablation_grid(model, TASK.sample(1, seed=0))
