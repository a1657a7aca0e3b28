"""Mixer declarations (mecheval.layers.mixer): `conv_sites`, checked against the mixer's sites,
and its default for RecurrentMixer (its `convs`)."""

from __future__ import annotations

import pytest

from mecheval.layers import DeltaNet, Mamba, Mixer, MixerError, Site
from tests.evaluation.conv_mixer import ShortConvAttention


def test_conv_sites_default_from_a_recurrent_mixers_convs():
    assert Mamba(16, d_state=4).conv_sites == ("conv_output",)
    assert Mamba(16, d_state=4, use_conv=False).conv_sites == ()
    assert DeltaNet(d_model=16, num_heads=1).conv_sites == (
        "q_conv_output",
        "k_conv_output",
        "v_conv_output",
    )
    assert Mixer.conv_sites == ()
    assert ShortConvAttention(16).conv_sites == ("q_short", "k_short", "v_short")


def test_a_declared_conv_site_that_does_not_exist_is_refused_by_name():
    class Wrong(Mixer):
        conv_sites = ("q_conv",)

        def __init__(self, d_model):
            super().__init__()
            self.q = Site("q")

        def forward(self, x):
            return self.q(x)

    with pytest.raises(MixerError, match="Wrong.conv_sites names 'q_conv', which is no"):
        Wrong(4)
    with pytest.raises(MixerError, match="did you mean conv_sites"):

        class Misspelt(Mixer):  # noqa: F841
            conv_site = ("q",)
