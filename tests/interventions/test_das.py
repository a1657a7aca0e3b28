"""Distributed alignment search (mecheval.interventions.das): the batched run equals training
each (site, position, k) alone through a hook, pyvene's way; at k = the site's width the
patch is the interchange grid's; the swap is pyvene's low-rank rotated-space intervention;
bad settings are refused by name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from mecheval.interventions import interchange_grid
from mecheval.interventions.das import Bases, DasSettings, das
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)
SETTINGS = DasSettings(steps=4, lr=5e-2, batch_size=4, holdout=0.5, seed=3)


def _model(arch: str):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length)
    with torch.no_grad():  # sharper than the init, so that patches matter
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


def _data(n: int = 10):
    batch = TASK.sample(n, seed=1, split="dev")
    return batch, TASK.corrupt(batch, "key", seed=1)


KEYS = ["example", "layer", "site", "position", "k"]


def test_the_full_swap_and_no_swap_are_the_grids_patched_and_corrupted_runs():
    model = _model("mamba")
    batch, corrupted = _data()
    sites = ["block_input", "state", "mixer_output", "block_output"]
    positions = ["key", "value", "query"]
    table, _ = das(
        model, batch, corrupted, sites=sites, positions=positions, dims=[2], settings=SETTINGS
    )
    full = table[table["k"] == table["width"]]
    grid = interchange_grid(model, batch, corrupted, sites=sites, positions=positions)
    merged = full.merge(grid, on=["example", "layer", "site", "position"], validate="one_to_one")
    assert len(merged) == len(full) > 0
    np.testing.assert_allclose(merged["p_target"], merged["p_restored"], atol=1e-5, rtol=1e-4)
    none = table[table["k"] == 0]  # no swap: the corrupted run
    merged = none.merge(grid, on=["example", "layer", "site", "position"], validate="one_to_one")
    assert len(merged) == len(none) > 0
    np.testing.assert_allclose(merged["p_target"], merged["p_corrupted"], atol=1e-5, rtol=1e-4)


RECURRENT = [
    "mamba",
    "mamba_noconv",
    "mamba2",
    "deltanet",
    "gated_deltanet",
    "gated_deltanet_noconv",
]


def test_the_bases_stay_orthonormal_and_swap_a_subspace():
    bases = Bases(6, 2, seeds=[0, 1])
    R = bases.weight
    torch.testing.assert_close(R.mT @ R, torch.eye(2).expand(2, 2, 2), atol=1e-6, rtol=0)
    g = torch.Generator().manual_seed(0)
    corrupted, clean = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g)
    patched = bases.swap(corrupted, clean)
    # In the subspace the patch is the clean run's; orthogonal to it, the corrupted run's.
    torch.testing.assert_close(patched @ R, clean @ R, atol=1e-5, rtol=0)
    rest = torch.eye(6) - R @ R.mT
    torch.testing.assert_close(patched @ rest, corrupted @ rest, atol=1e-5, rtol=0)


def test_pyvenes_rotated_space_intervention_gives_the_same_patched_logits():
    """pyvene's low-rank rotated-space intervention, with our trained R as its rotation and
    hooked onto the site in a full forward of the corrupted documents, gives the logits at the
    query that our batched run (from the site's block, read out at the query) gives."""
    pyvene = pytest.importorskip("pyvene")
    from mecheval.interventions.das import _SiteGroup
    from mecheval.interventions.das_data import prepare

    model = _model("attention")
    batch, corrupted = _data()
    data, combos, _, query, _, held = prepare(
        model, batch, corrupted, ["mixer_output"], ["value"], [3], [1], SETTINGS.holdout
    )
    (name,) = combos
    combo = next(c for c in combos[name] if c.k == 3)
    group = _SiteGroup(data[name], [combo], seed=SETTINGS.seed)
    with torch.no_grad():  # R as initialised: any orthonormal R will do
        ours = F.linear(group._patched(model, held, query)[0], model.unembedding)

    theirs = pyvene.LowRankRotatedSpaceIntervention(embed_dim=16, low_rank_dimension=3)
    theirs.rotate_layer.weight = group.bases["3"].weight[0].detach().clone()
    site = data[name]
    rows, where = torch.arange(len(held)), site.positions["value"][held]
    clean = site.clean["value"][held]

    def swap(module, inputs, output):
        patched = output.clone()
        patched[rows, where] = theirs(output[rows, where], clean)
        return patched

    handle = model.site(name).register_forward_hook(swap)
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(corrupted)[held])[rows, query[held]]
    finally:
        handle.remove()
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(steps=0), "steps must be >= 1"),
        (dict(lr=0.0), "lr must be > 0"),
        (dict(holdout=1.0), r"holdout must be in \(0, 1\)"),
        (dict(batch_size=2.5), "batch_size must be an int"),
    ],
)
def test_bad_settings_are_refused_by_name(settings, words):
    with pytest.raises(ValueError, match=words):
        DasSettings(**settings)


def test_bad_arguments_are_refused_by_name():
    model = _model("attention")
    batch, corrupted = _data()
    with pytest.raises(ValueError, match="unknown site"):
        das(model, batch, corrupted, sites=["state"], settings=SETTINGS)
    with pytest.raises(ValueError, match="dims must be subspace sizes >= 1"):
        das(model, batch, corrupted, dims=[0, 2], settings=SETTINGS)
    with pytest.raises(ValueError, match="corrupted must have the batch's shape"):
        das(model, batch, corrupted[:, :-1], settings=SETTINGS)
    with pytest.raises(ValueError, match=r"dims \[1000\]: larger than every site's width"):
        das(model, batch, corrupted, sites=["block_input"], dims=[1, 1000], settings=SETTINGS)
    with pytest.raises(ValueError, match="holdout 0.01 of 10 documents holds none out"):
        das(model, batch, corrupted, settings=DasSettings(holdout=0.01))
    result = das(
        model, batch, corrupted, sites=["block_output"], layers=[1], dims=[1], settings=SETTINGS
    )
    assert isinstance(result.table, pd.DataFrame) and set(result.bases) == {
        f"layers.1.block_output/{label}/1" for label in result.table["position"].unique()
    }


def test_the_answers_cross_entropy_and_its_gradient_are_torchs():
    from mecheval.interventions.das import AnswerCrossEntropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float64, generator=g).requires_grad_()
    weight = 3 * torch.randn(50, 16, dtype=torch.float64, generator=g)
    target = torch.randint(0, 50, (7,), generator=g)
    ours = AnswerCrossEntropy.apply(hidden, weight, target)
    torchs = F.cross_entropy(hidden @ weight.T, target, reduction="none")
    torch.testing.assert_close(ours, torchs)
    grad = torch.randn(7, dtype=torch.float64, generator=g)
    (expected,) = torch.autograd.grad(torchs, hidden, grad)
    (got,) = torch.autograd.grad(ours, hidden, grad, retain_graph=True)
    torch.testing.assert_close(got, expected)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(ours, hidden, grad)  # its saved softmax became the gradient
