"""LanguageModel (mecheval/models/language_model.py): the floats of state one sequence carries,
per layer and in all, against each mixer's count written out from its sizes."""

from __future__ import annotations

from mecheval.models import build_model


def test_state_sizes_per_layer_and_in_all():
    """A Mamba + attention hybrid: Mamba's SSM state (d_inner x d_state) and conv window
    (d_inner x (d_conv - 1)), attention's key and value cache (2 d_model L); the total is
    their sum."""
    model = build_model("mamba+attention", 32, d_model=16, n_layers=2, max_len=24)
    mamba = model.layers[0].mixer
    expected_mamba = mamba.d_inner * mamba.d_state + mamba.d_inner * (mamba.d_conv - 1)
    for length in (1, 10, 24):
        assert model.layer_state_sizes(length) == [expected_mamba, 2 * 16 * length]
        assert model.state_size(length) == expected_mamba + 2 * 16 * length
    assert model.layer_state_sizes() == model.layer_state_sizes(24)  # default: max_len
