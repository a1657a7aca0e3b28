"""mecheval.testing.check_mixer: every mixer of the zoo and the example mixers pass it; mixers
whose declarations are wrong fail it by the check that catches them; declarations that
contradict a mixer's own sites are refused when it is built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.retention import DeclaredRetention, ResumableRetention, Retention
from mecheval.layers import DeltaNet, Mamba, Mixer, MixerError, Site
from mecheval.layers.resume import Resume, pick
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

    with pytest.raises(MixerError, match=r"window_sites\['inner'\] must be >= 1, got 0"):
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


# Probes of issue 51: each fault a line of MixerCheckError naming its cause, never a raw error.


class WrongShape(Plain):
    def forward(self, x):
        return torch.cat([super().forward(x), x[..., :1]], -1)


class Unreached(Plain):
    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.never = Site("never")


class TupleOutput(Plain):
    def forward(self, x):
        return super().forward(x), None


class Float64Output(Plain):
    def forward(self, x):
        return super().forward(x).double()


class MixesRows(Plain):
    def forward(self, x):
        y = super().forward(x)
        return y + y.mean(0, keepdim=True)


class HiddenLookAhead(Plain):
    """Reads the next position through a gate that starts at zero."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.gate = torch.nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        ahead = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)
        return super().forward(x) + self.gate * ahead


class BatchSecond(ResumableRetention):
    """Keeps its context with the heads first and the batch second (consistently)."""

    def forward(self, x, resume=None):
        inner = None
        if resume is not None:
            state = None if resume.context is None else (resume.context[0].transpose(0, 1),)
            inner = Resume(state, resume.leave)
        out = super().forward(x, inner)
        if resume is not None:
            resume.context = (inner.context[0].transpose(0, 1).contiguous(),)
        return out


class InPlace(ResumableRetention):
    """Adds to the context it resumes from in place."""

    def state_after(self, k, v, before, powers):
        state = super().state_after(k, v, None, powers)
        if before is None:
            return state
        return before.mul_(powers[:, -1, None, None]).add_(state)


class OutputSite(DeclaredRetention):
    """A site on the retention's output, after the recurrence: its at= path forms it at
    `at` alone."""

    def __init__(self, d_model: int, num_heads: int = 2) -> None:
        super().__init__(d_model, num_heads)
        self.o = Site("o")

    def output(self, o, x):
        o = F.rms_norm(o, (self.head_dim,)).transpose(1, 2).flatten(2)
        return self.o_proj(F.silu(self.g_proj(x)) * self.o(o))


class OutputSiteEverywhere(OutputSite):
    """The same site, correct on the at= path: the output formed at every position, then
    picked at `at`."""

    def forward(self, x, resume=None, at=None):
        return pick(ResumableRetention.forward(self, x, resume), at)


@pytest.mark.parametrize(
    "mixer, check, words",
    [
        (WrongShape, "forward", "(3, 12, 16) torch.float32 -> (3, 12, 17) torch.float32"),
        (TupleOutput, "forward", "returns a tuple, not one tensor of shape (3, 12, 16)"),
        (Float64Output, "forward", "-> (3, 12, 16) torch.float64: the output must have its"),
        (Unreached, "sites", "never is never reached by forward"),
        (OutputSite, "sites", "o sees 1 of 12 positions on the at= path"),
        (MixesRows, "rows", "changing row 0's input changes other rows' outputs"),
        (HiddenLookAhead, "causal", "change earlier outputs (with every parameter perturbed)"),
        (BatchSecond, "resumable", "context entry 0 has shape (2, 3, 8, 8): its first axis"),
        (InPlace, "resumable", "resuming changed the context it resumed from in place"),
    ],
)
def test_each_fault_is_a_line_of_the_report_naming_its_cause(mixer, check, words):
    """Before: raw RuntimeError, KeyError, AttributeError or ValueError for the first five;
    for the others the grid check alone failed ("p_restored differs"), or nothing did."""
    with pytest.raises(MixerCheckError) as error:
        check_mixer(mixer, grid=False)
    lines = [c for c in error.value.report.failed if c.name.endswith(f" {check}")]
    assert lines and all(words in c.detail for c in lines), str(error.value)
    assert str(error.value).count("\n") == len(error.value.report.checks)  # one line each


def test_a_correct_site_after_the_recurrence_passes():
    report = check_mixer(OutputSiteEverywhere)
    assert not report.failed


def test_a_fault_in_the_grid_is_a_line_too():
    failed = _failed(Unreached)
    assert {"sites", "grid"} <= failed


@pytest.mark.parametrize(
    "arch, options",
    [
        ("attention", {}),
        ("mamba", {}),
        ("deltanet", {}),
        ("examples.retention:DeclaredRetention", {"num_heads": 2}),
    ],
)
def test_correct_mixers_pass_at_every_init(arch, options):
    """Before: the grid check failed them at init: pytorch (KL off by 1.5e-5 to 1.07e-4, where
    1e-5 was allowed): tolerances set for the study's init alone."""
    for init in ("study", "pytorch"):
        assert not check_mixer(arch, options={**options, "init": init}).failed


def test_every_part_of_a_hybrid_is_built_and_checked():
    """Before: check_mixer of a 3-part hybrid built 2 layers, and passed without DeltaNet."""
    report = check_mixer("mamba+attention+deltanet", grid=False)
    checked = {c.name.split(" ")[2] for c in report.checks if c.name.startswith("layer")}
    assert checked == {"(Mamba)", "(CausalSelfAttention)", "(DeltaNet)"}
