"""The grid's plan (plan_grid) says what interchange_grid runs: which cells, from where, in how
many patched forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.interventions import engine, interchange_grid, per_cell_loop, plan_grid
from mecheval.interventions import grid as grid_module
from mecheval.interventions.plan import (
    query_alike_sites,
    query_reach,
    token_local_sites,
    window_local_sites,
)
from mecheval.models import ARCHITECTURES, build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _setup(arch):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, d_model=16, max_len=TASK.max_document_length)
    batch = TASK.sample(5, seed=0, split="dev")
    return model.eval(), batch, TASK.corrupt(batch, "key", seed=0)


@pytest.mark.parametrize("arch", ["attention", "hyena", "based"])
@pytest.mark.parametrize("positions", [None, ["all"]], ids=["named", "all"])
def test_the_plan_counts_the_forwards_the_grid_runs(arch, positions, monkeypatch):
    model, batch, corrupted = _setup(arch)
    budget = 1 << 22  # small: several chunks
    plan = plan_grid(model, batch, positions=positions, corrupted=corrupted, memory_budget=budget)
    summary = plan.summary()
    assert list(summary["site"]) == [s.ref.short for s in plan.sites]
    assert (summary["run"] <= summary["cells"]).all()
    calls = []
    real = engine.hidden_at
    for module in (grid_module, engine):  # the grid's clean run, the engine's patched ones
        monkeypatch.setattr(
            module, "hidden_at", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
        )
    interchange_grid(model, batch, corrupted, positions=positions, memory_budget=budget)
    # + the clean run, and the corrupted run unless it runs in segments (through resume_from)
    assert plan.points
    one_pass = model.context_sites() is not None
    assert len(calls) == 1 + one_pass + summary["forwards"].sum()


def test_cells_the_plan_skips_keep_the_corrupted_result():
    model, batch, corrupted = _setup("mamba")
    plan = plan_grid(model, batch, positions=["all"], corrupted=corrupted)
    table = interchange_grid(model, batch, corrupted, positions=["all"])
    for site in plan.sites:
        rows = table[(table["layer"] == site.ref.layer) & (table["site"] == site.ref.short)]
        skipped = np.ones(len(rows), dtype=bool)
        for cells in (site.live, site.copied, site.restored):
            skipped[cells.numpy()] = False
        part = rows.iloc[np.flatnonzero(skipped)]
        np.testing.assert_array_equal(part["p_restored"], part["p_corrupted"])


def test_resuming_runs_fewer_positions():
    model, batch, _ = _setup("mamba")
    plan = plan_grid(model, batch, positions=["all"])
    summary = plan.summary()
    assert plan.points, "a resumable model gets resume points"
    assert (summary["positions_run"] < summary["run"] * plan.needed).any()


def test_cells_before_the_corruption_are_not_run():
    """The documents agree before the corrupted key: those cells are identities, left out of
    the plan given the corrupted documents, and their results equal the corrupted run's."""
    model, batch, corrupted = _setup("deltanet")
    without = plan_grid(model, batch, positions=["all"]).summary()
    plan = plan_grid(model, batch, positions=["all"], corrupted=corrupted)
    first = (batch.tokens != corrupted).int().argmax(1)
    assert (first > 0).all()
    before = without["run"] + without["copied"]
    for site, before_site in zip(plan.sites, before, strict=True):
        for cells in (site.live, site.copied):
            assert (plan.positions[cells] >= first[plan.example[cells]]).all()
        # Only cells at or just before the query run at the sites that reach a few positions
        # (after the last mixer, the last queries' convs): none of them lies before the key.
        near_query = site.ref.name in query_reach(model)
        assert len(site.live) + len(site.copied) < before_site or near_query


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_token_local_sites_depend_on_their_own_token_alone(arch):
    """What `token_local_sites()` declares, checked on the model itself: two documents that
    differ at one position hold the same values at every other position of those sites."""
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, d_model=16, max_len=TASK.max_document_length)
    batch = TASK.sample(4, seed=1, split="dev")
    changed, at = batch.tokens.clone(), 5
    changed[:, at] = (changed[:, at] + 1 - 3) % (TASK.vocab_size - 3) + 3
    local = token_local_sites(model)
    assert {"layers.0.block_input", "layers.0.mixer_input"} <= set(local)
    assert all(name.startswith("layers.0.") for name in local)
    reads = {name: None for name in model.site_names() if name.startswith("layers.0.")}
    reads.pop("layers.0.state", None)
    with torch.no_grad():
        with model.intervene(reads=reads) as first:
            model(batch.tokens)
        with model.intervene(reads=reads) as second:
            model(changed)
    others = [p for p in range(batch.tokens.shape[1]) if p != at]
    for name in local:
        torch.testing.assert_close(first[name][:, others], second[name][:, others], msg=name)
        assert not torch.equal(first[name][:, at], second[name][:, at]), name
    # The mixer's output mixes positions: it is not token-local, and it does differ later on.
    mixed = "layers.0.mixer_output"
    assert mixed not in local
    assert not torch.equal(first[mixed][:, at + 1 :], second[mixed][:, at + 1 :])


def _restore_nothing(loop, short: str, cells) -> None:
    """The per-cell loop's (the oracle's) cells `cells` of site `short` restore nothing."""
    rows = loop[loop["site"] == short]
    restored, corrupted = rows["p_restored"].to_numpy(), rows["p_corrupted"].to_numpy()
    np.testing.assert_allclose(
        restored[cells], corrupted[cells], rtol=1e-5, atol=1e-7, err_msg=short
    )


@pytest.mark.parametrize("arch", ["mamba", "deltanet", "hyena", "attention"])
def test_token_local_cells_where_the_documents_agree_are_not_run(arch):
    """At a token-local site the patch of a position where both documents hold the same token
    is the identity: the plan leaves those cells out, and the per-cell loop (the oracle) finds
    that they restore nothing."""
    model, batch, corrupted = _setup(arch)
    plan = plan_grid(model, batch, positions=["all"], corrupted=corrupted)
    local = set(token_local_sites(model))
    same = batch.tokens[plan.example, plan.positions] == corrupted[plan.example, plan.positions]
    loop = per_cell_loop(model, batch, corrupted, layers=0, positions=["all"])
    for site in plan.sites:
        if site.ref.name not in local:
            continue
        assert not same[site.live].any(), site.ref.name
        _restore_nothing(loop, site.ref.short, same.numpy())
        # The cells at the corrupted key itself are still run (or restore the clean run).
        assert len(site.live) + len(site.restored) > 0
    assert any(s.ref.name in local for s in plan.sites)


@pytest.mark.parametrize("arch", ["mamba", "attention"])
def test_the_first_blocks_input_at_the_only_difference_restores_the_clean_run(arch):
    """Each document differs from its corruption at the key alone: patching the first block's
    input there gives the corrupted run the original's whole input. The plan runs none of
    those cells and the grid gives them the clean run's results, as the per-cell loop (the
    oracle) finds them."""
    model, batch, corrupted = _setup(arch)
    assert ((batch.tokens != corrupted).sum(1) == 1).all()
    plan = plan_grid(model, batch, layers=0, sites="block_input", corrupted=corrupted)
    (site,) = plan.sites
    key = plan.positions == batch.positions["key"][plan.example]
    assert len(site.live) == 0 and sorted(site.restored.tolist()) == key.nonzero()[:, 0].tolist()
    loop = per_cell_loop(model, batch, corrupted, layers=0, sites="block_input")
    grid = interchange_grid(model, batch, corrupted, layers=0, sites="block_input")
    restored = loop[key.numpy()]
    np.testing.assert_allclose(restored["p_restored"], restored["p_original"], rtol=1e-5)
    np.testing.assert_allclose(restored["kl"], 0.0, atol=1e-6)
    for column in ("p_restored", "logit_restored", "kl"):
        np.testing.assert_allclose(grid[column], loop[column], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["mamba", "hyena", "deltanet", "gated_deltanet"])
def test_window_local_sites_depend_on_their_window_alone(arch):
    """What `window_local_sites()` declares, checked on the model itself: two documents that
    differ at one position hold the same values at those sites everywhere but the window of
    positions after it; the plan runs none of those cells, and the per-cell loop (the
    oracle) finds that they restore nothing."""
    model, batch, corrupted = _setup(arch)
    windows = window_local_sites(model)
    assert windows and all(n > 1 for n in windows.values())
    changed, at = batch.tokens.clone(), 5
    changed[:, at] = (changed[:, at] + 1 - 3) % (TASK.vocab_size - 3) + 3
    with torch.no_grad():
        with model.intervene(reads=dict.fromkeys(windows)) as first:
            model(batch.tokens)
        with model.intervene(reads=dict.fromkeys(windows)) as second:
            model(changed)
    for name, n in windows.items():
        others = [p for p in range(batch.tokens.shape[1]) if not at <= p < at + n]
        torch.testing.assert_close(first[name][:, others], second[name][:, others], msg=name)
        assert not torch.equal(first[name][:, at + n - 1], second[name][:, at + n - 1]), name
    plan = plan_grid(model, batch, layers=0, positions=["all"], corrupted=corrupted)
    loop = per_cell_loop(model, batch, corrupted, layers=0, positions=["all"])
    key = batch.positions["key"][plan.example]
    for site in plan.sites:
        if site.ref.name not in windows:
            continue
        n = windows[site.ref.name]
        inside = (plan.positions >= key) & (plan.positions < key + n)
        assert not (~inside)[site.live].any(), site.ref.name
        _restore_nothing(loop, site.ref.short, (~inside).numpy())


@pytest.mark.parametrize("arch", ["mamba", "hyena", "base_conv", "deltanet"])
def test_query_alike_sites_restore_alike_before_the_query(arch):
    """What `query_alike_sites()` declares, checked by the per-cell loop (the oracle): in the
    last block, at every position before the query, those sites' patches give the same
    results; the plan runs them at the last of them and copies them to the others."""
    model, batch, corrupted = _setup(arch)
    alike = query_alike_sites(model)
    last = len(model.layers) - 1
    shorts = [name.split(".", 2)[2] for name in alike]
    assert shorts[:2] == ["block_input", "mixer_input"]
    # DeltaNet's input reaches other positions through q, k, v and beta: no one site.
    assert len(shorts) == (2 if arch == "deltanet" else 3)
    loop = per_cell_loop(model, batch, corrupted, layers=last, sites=shorts, positions=["all"])
    query = batch.positions["query"].numpy()[loop["example"].to_numpy()]
    before = loop[loop["position_index"].to_numpy() < query]
    per_site = before.pivot_table(
        index=["example", "position_index"], columns="site", values="p_restored"
    )
    for short in shorts[:-1]:
        np.testing.assert_allclose(per_site[short], per_site[shorts[-1]], rtol=1e-5, atol=1e-7)
    plan = plan_grid(model, batch, layers=last, sites=shorts, positions=["all"])
    copied = {s.ref.short: len(s.copied) for s in plan.sites}
    assert copied[shorts[-1]] == 0 and all(copied[short] > 0 for short in shorts[:-1])


@pytest.mark.parametrize("arch", ["mamba", "attention", "based"])
def test_the_first_mixers_output_where_the_tokens_agree_restores_as_the_blocks_output(arch):
    """Where both documents hold the same token the first block's residual is the same: the
    per-cell loop (the oracle) finds patches of its mixer's output there restore what patches
    of its output do; the plan copies those cells from the block's output."""
    model, batch, corrupted = _setup(arch)
    shorts = ["mixer_output", "block_output"]
    loop = per_cell_loop(model, batch, corrupted, layers=0, sites=shorts, positions=["all"])
    where = loop["position_index"].to_numpy(), loop["example"].to_numpy()
    same = (batch.tokens == corrupted).numpy()[where[1], where[0]]
    per_site = loop[same].pivot_table(
        index=["example", "position_index"], columns="site", values="p_restored"
    )
    np.testing.assert_allclose(per_site[shorts[0]], per_site[shorts[1]], rtol=1e-5, atol=1e-7)
    plan = plan_grid(model, batch, layers=0, sites=shorts, positions=["all"], corrupted=corrupted)
    mixer = plan.sites[0]
    assert mixer.copy_from == "layers.0.block_output" and len(mixer.copied) > 0
    same_cells = (
        batch.tokens[plan.example, plan.positions] == corrupted[plan.example, plan.positions]
    )
    assert same_cells[mixer.copied].all() and not same_cells[mixer.live].any()


READOUT = {
    "deltanet": {"q_conv_input": 4, "q_conv_output": 1},
    "gated_deltanet": {"q_conv_input": 4, "q_conv_output": 1},
    "h3": {"long_conv_output": 1},
    "hyena": {"long_conv_output": 1},
    "base_conv": {"long_conv_output": 1},  # layer 1 of base_conv: the long conv
    "mamba": {},
}


@pytest.mark.parametrize("arch", list(READOUT))
def test_readout_sites_reach_the_query_from_nearby_alone(arch):
    """What `query_reach()` declares, checked by the per-cell loop: in the last block a patch
    of such a site restores nothing at positions `reach` or more before the query, and the
    plan does not run those cells."""
    model, batch, corrupted = _setup(arch)
    reach = query_reach(model)
    last = len(model.layers) - 1
    after = {"mixer_output", "block_output"} | ({"mlp_output"} if arch != "mamba" else set())
    readout = READOUT[arch]
    expected = {f"layers.{last}.{s}": 1 for s in after} | {
        f"layers.{last}.{s}": n for s, n in readout.items()
    }
    assert {k: v for k, v in reach.items() if k in expected} == expected
    shorts = [name.split(".", 2)[2] for name in reach]
    loop = per_cell_loop(model, batch, corrupted, layers=last, sites=shorts, positions=["all"])
    query = batch.positions["query"].numpy()[loop["example"].to_numpy()]
    n = loop["site"].map(lambda short: reach[f"layers.{last}.{short}"]).to_numpy()
    far = loop["position_index"].to_numpy() <= query - n
    assert far.any()
    np.testing.assert_allclose(
        loop["p_restored"][far], loop["p_corrupted"][far], rtol=1e-5, atol=1e-7
    )
    plan = plan_grid(model, batch, layers=last, sites=shorts, positions=["all"])
    for site in plan.sites:
        gap = batch.positions["query"][plan.example[site.live]] - plan.positions[site.live]
        assert (gap < reach[site.ref.name]).all(), site.ref.name


def test_a_mixer_that_cannot_resume_makes_the_grid_rerun_from_position_zero():
    """The contract's fallback: a model whose mixer says it cannot resume gets no resume
    points, `resume_from` refuses it, and every cell of its grid still equals the loop's."""
    model, batch, corrupted = _setup("mamba")
    model.layers[1].mixer.resumable = False  # as a mixer without resume support would say
    assert model.can_resume(0) is False and model.can_resume(1) is False
    with pytest.raises(ValueError, match="cannot resume"):
        model.resume_from(0, model.embed(batch.tokens))
    plan = plan_grid(model, batch, corrupted=corrupted)
    assert plan.points == []
    assert all((site.starts == 0).all() for site in plan.sites)
    fast = interchange_grid(model, batch, corrupted)
    slow = per_cell_loop(model, batch, corrupted)
    keys = ["example", "layer", "site", "position"]
    merged = fast.merge(slow, on=keys, suffixes=("", "_loop"), validate="one_to_one")
    assert len(merged) == len(fast) == len(slow)
    np.testing.assert_allclose(
        merged["p_restored"], merged["p_restored_loop"], rtol=1e-4, atol=1e-6
    )
