"""DAS's data (mecheval.interventions.das_data): which rows' swaps can change the query."""

from __future__ import annotations

from tests.interventions.test_das import SETTINGS, _data, _model


def test_rows_whose_swap_cannot_change_the_query_are_not_live():
    """A swap is the identity where the documents' activations agree (the first block's input
    where they hold the same token), and cannot reach the query from the state after it or
    from after the last block's mixer anywhere but at it: those rows take the corrupted run's."""
    from mecheval.interventions.das_data import prepare

    model = _model("mamba")
    batch, corrupted = _data()
    sites = ["block_input", "state", "mixer_output"]
    data, *_ = prepare(
        model, batch, corrupted, sites, ["key", "value", "query"], [1], None, SETTINGS.holdout
    )
    live = {name: {label: bool(m.any()) for label, m in d.live.items()} for name, d in data.items()}
    assert live["layers.0.block_input"] == {"key": True, "value": False, "query": False}
    assert live["layers.1.mixer_output"] == {"key": False, "value": False, "query": True}
    for name in ("layers.0.state", "layers.1.state"):
        assert live[name] == {"key": True, "value": True, "query": False}
    assert data["layers.0.block_input"].live["key"].all()
