"""mecheval.testing.check_mixer: every mixer of the zoo and the example mixers pass it; mixers
whose declarations are wrong fail it by the check that catches them; declarations that
contradict a mixer's own sites are refused when it is built."""

from __future__ import annotations

import pytest
import torch

from examples.retention import DeclaredRetention, ResumableRetention, Retention
from mecheval.layers import DeltaNet, Mamba, Mixer, MixerError, Site
from mecheval.models import ARCHITECTURES, build_model
from mecheval.testing import MixerCheckError, check_mixer


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_zoo_mixer_passes(arch):
    report = check_mixer(arch)
    assert not report.failed
    passed = {c.name.rsplit(" ", 1)[-1] for c in report.checks if c.passed}
    assert {"forward", "causal", "resumable", "grid"} <= passed


@pytest.mark.parametrize("mixer", [Retention, ResumableRetention, DeclaredRetention])
def test_the_example_mixers_pass(mixer):
    report = check_mixer(mixer)
    skipped = {c.name.rsplit(" ", 1)[-1] for c in report.checks if c.passed is None}
    assert ("resumable" in skipped) == (mixer is Retention)
    assert ("context_sites" in skipped) == (mixer is not DeclaredRetention)


def _failed(mixer, **kwargs) -> set[str]:
    with pytest.raises(MixerCheckError) as error:
        check_mixer(mixer, **kwargs)
    return {c.name.rsplit(" ", 1)[-1] for c in error.value.report.failed}


class Peeking(Retention):
    """Reads the future: the decay matrix transposed."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.output(((q @ k.transpose(-1, -2)) * self.decay(x.shape[1]).mT) @ v, x)


class Forgetful(ResumableRetention):
    """Leaves a context but does not continue from it."""

    def forward(self, x, resume=None):
        out = super().forward(x, None)
        super().forward(x, resume)
        return out


class LateContext(DeclaredRetention):
    """context_from one position short."""

    def context_from(self, values, point, index):
        return super().context_from(values, max(point - 1, 0), index)


class OffByOne(DeclaredRetention):
    """Reads out at the position before the one asked for."""

    def forward(self, x, resume=None, at=None):
        return super().forward(x, resume, None if at is None else (at - 1).clamp(min=0))


class LocalConvOutput(Mamba):
    local_sites = ("conv_input", "conv_output")  # the conv's output reads 4 positions


class NarrowWindow(Mamba):
    window_sites = {"conv_output": 2}  # the conv is 4 wide


class WrongReach(Mamba):
    reach_site = "conv_output"  # the conv's input reaches 4 outputs of it


class NarrowReadout(DeltaNet):
    readout_sites = {"q_conv_input": 1}  # through its conv, q's input reaches 4 positions


@pytest.mark.parametrize(
    "mixer, check",
    [
        (Peeking, "causal"),
        (Forgetful, "resumable"),
        (LateContext, "context_sites"),
        (OffByOne, "reads_out_at"),
        (LocalConvOutput, "local_sites"),
        (NarrowWindow, "window_sites"),
        (WrongReach, "reach_site"),
        (NarrowReadout, "readout_sites"),
    ],
)
def test_a_wrong_declaration_fails_by_the_check_that_catches_it(mixer, check):
    assert check in _failed(mixer, grid=False)


def test_a_wrong_declaration_makes_the_grid_differ_from_the_loop():
    """Why the checks matter: the grid trusts declarations."""
    assert "grid" in _failed(NarrowWindow)


class Plain(Mixer):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d_model, d_model)
        self.inner = Site("inner")

    def forward(self, x):
        return self.inner(self.proj(x)).cumsum(1)


def test_declarations_that_contradict_the_sites_are_refused_when_built():
    class NoSuchSite(Plain):
        local_sites = ("outer",)

    with pytest.raises(MixerError, match=r"NoSuchSite.local_sites names 'outer', which is no"):
        NoSuchSite(8)

    class NotResumable(Plain):
        resumable = True

    with pytest.raises(MixerError, match="resumable is True but its forward takes no 'resume'"):
        NotResumable(8)

    class NoContextFrom(Plain):
        resumable = True
        context_sites = ("inner",)

        def forward(self, x, resume=None):
            return super().forward(x)

    with pytest.raises(MixerError, match="declares context_sites but no context_from"):
        NoContextFrom(8)

    class BadWidth(Plain):
        window_sites = {"inner": 0}

    with pytest.raises(MixerError, match=r"window_sites\['inner'\] must be an int >= 1"):
        BadWidth(8)


def test_a_misspelt_declaration_is_refused_by_name():
    with pytest.raises(MixerError, match="window_site is not a mixer declaration: did you mean"):

        class Misspelt(Plain):
            window_site = {"inner": 1}


def test_a_mixer_that_is_no_mixer_is_refused_by_name():
    from mecheval.models import register_mixer
    from mecheval.models.registry import unregister_mixer

    register_mixer("plain_linear", lambda d_model: torch.nn.Linear(d_model, d_model))
    try:
        with pytest.raises(TypeError, match="not a mecheval.layers.Mixer"):
            build_model("plain_linear", 10, 8, max_len=4)
    finally:
        unregister_mixer("plain_linear")
