"""DAS's last-block shortcut (mecheval.interventions.das_last_block) against the full run from
the site's block on."""

from __future__ import annotations

import pytest
import torch

from tests.interventions.test_das import RECURRENT, SETTINGS, _data, _model


@pytest.mark.parametrize("arch", RECURRENT)
def test_the_last_blocks_runs_without_its_recurrence_equal_the_full_runs(arch):
    """A state site of the last block and the sites whose patches enter it (its block input, a
    site after the previous block's mixer), run through the readout of the last block's scan,
    give the head input that the run from their block on gives, at every k."""
    from mecheval.interventions.das import _SiteGroup
    from mecheval.interventions.das_data import prepare
    from mecheval.interventions.das_last_block import last_blocks

    model = _model(arch)
    batch, corrupted = _data()
    sites = ["block_input", "state", "mixer_output", "block_output"]
    positions = ["key", "value", "value+1", "query", "0"]
    data, combos, _, query, _, held = prepare(
        model, batch, corrupted, sites, positions, [1, 3], None, SETTINGS.holdout
    )
    shortcuts = last_blocks(model, data, query)
    last = len(model.layers) - 1
    expected = {f"layers.{last}.block_input", f"layers.{last}.state"}
    expected |= {f"layers.{last - 1}.mixer_output", f"layers.{last - 1}.block_output"}
    assert set(shortcuts) == expected
    for name, shortcut in shortcuts.items():
        full = _SiteGroup(data[name], combos[name], seed=SETTINGS.seed)
        fast = _SiteGroup(data[name], combos[name], seed=SETTINGS.seed, last=shortcut)
        with torch.no_grad():
            expected_hidden, _ = full._patched(model, held, query)
            got, _ = fast._patched(model, held, query)
        torch.testing.assert_close(got, expected_hidden, atol=2e-5, rtol=1e-4, msg=name)
