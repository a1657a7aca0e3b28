"""Mixer: the contract between a sequence mixer and mecheval's models and interchange grid.

A mixer maps its input (B, L, d_model) to its output (B, L, d_model) causally: the output at a
position depends on the input at that position and before it alone. That is all a mixer has to
do. Subclass `Mixer`, write `forward(x)`, and the models train it and the interchange grid
evaluates it exactly, rerunning whole documents for every patch (docs/mixers.md).

Everything else is optional and declared on the class (or as a property), each declaration with
a default that is correct for any mixer: an undeclared mixer is slower, never wrong. Each
declaration is checked against the mixer's own sites when the mixer is built (`check_sites`),
and against its behaviour by `mecheval.testing.check_mixer`.

Sites. Activations an intervention may read or patch are routed through `Site` submodules
((B, L, C) tensors) or run through a `StateSite` (a scan's recurrent state); the block around
the mixer adds its own sites. A site's name is short ("conv_input"), unique within the mixer.

Declarations:
    resumable       forward(x, resume=None) continues a sequence: given a `Resume`, x holds the
                    positions after those whose context resume.context holds (None: the sequence
                    starts here), and the mixer leaves in resume.context the context after x's
                    last position (a tuple of tensors with the batch axis first, or None
                    entries; not needed when resume.leave is False). Two calls on [0, p) and
                    [p, L), the second resuming from the first, equal one call on [0, L). The
                    grid then restarts a patched run at the patch instead of position 0.
    reads_out_at    forward(x, resume=None, at=None) with `at` (B,) returns (B, 1, d_model), the
                    output at one position per row alone (still leaving the whole context). The
                    last block asks for it when only the query's logits are wanted.
    local_sites     sites whose value at a position is a function of the mixer's input at that
                    position alone (input projections): in the first block, where two documents
                    hold the same token, such a patch is the identity and is not run.
    window_sites    {site: n}: sites whose value at a position is a function of the input at it
                    and the n - 1 positions before it alone (a short convolution's output).
    reach_site      the site through which alone the input at a position reaches the output at
                    other positions (the rest of the input acts at its own position, as Mamba's
                    gate z): in the last block, a patch of the block's input, of the mixer's
                    input or of this site before the query changes the query alike, and the
                    grid runs one of them.
    readout_sites   {site: n}: sites whose value at a position reaches the output at that
                    position and the next n - 1 alone, never the state (DeltaNet's queries): in
                    the last block, such a patch n or more positions before the query is not run.
    context_sites   sites whose values in one run give the context after any position, through
                    `context_from(values, point, index)` (the context a run of [0, point)
                    leaves); values of a "state" site are the states after the positions just
                    before the resume points, `index` the point's place among them. The grid
                    then takes its contexts from one run instead of a run in segments.
    conv_sites      sites holding a short convolution's output ((B, L, C)): the evaluation
                    reads the association out of them at the value and the two positions
                    after it (the report's "Inside the short convs"); the grid uses nothing.
    state_size(L)   floats carried between tokens when generating, after L tokens; None (the
                    default) lets the model count the context the mixer leaves instead.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from mecheval.checks import check_int
from mecheval.layers.sites import Site, StateSite

DECLARATIONS = (
    "resumable",
    "reads_out_at",
    "local_sites",
    "window_sites",
    "reach_site",
    "readout_sites",
    "context_sites",
    "context_from",
    "conv_sites",
    "state_size",
)
EMPTY: Mapping[str, int] = MappingProxyType({})


class MixerError(TypeError):
    """A mixer's declarations contradict its code; the message names the declaration."""


class _CheckedAfterInit(type(nn.Module)):
    """Checks a mixer's declarations once its constructor (the outermost `__init__`) is done."""

    def __call__(cls, *args, **kwargs):
        mixer = super().__call__(*args, **kwargs)
        mixer.check_sites()
        return mixer


class Mixer(nn.Module, metaclass=_CheckedAfterInit):
    """Base class of every sequence mixer (see the module docstring for the contract).

    A subclass writes `forward(x)` ((B, L, d_model) -> (B, L, d_model)), and may add `resume`
    and `at` keyword arguments together with the declarations `resumable` and `reads_out_at`.
    """

    resumable: bool = False
    reads_out_at: bool = False
    local_sites: tuple[str, ...] = ()
    window_sites: Mapping[str, int] = EMPTY
    reach_site: str | None = None
    readout_sites: Mapping[str, int] = EMPTY
    context_sites: tuple[str, ...] | None = None
    conv_sites: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in vars(cls):
            near = difflib.get_close_matches(name, DECLARATIONS, n=1, cutoff=0.85)
            if near and name not in DECLARATIONS:
                raise MixerError(
                    f"{cls.__name__}.{name} is not a mixer declaration: did you mean {near[0]}? "
                    "(declarations: " + ", ".join(DECLARATIONS) + ")"
                )

    def context_from(self, values: dict[str, torch.Tensor], point: int, index: int) -> tuple:
        """The context after positions [0, point) from one run's values of `context_sites`
        (see the module docstring). Only called when `context_sites` is declared."""
        raise NotImplementedError(f"{type(self).__name__} declares no context_sites")

    def state_size(self, sequence_length: int) -> int | None:
        """Floats carried between tokens when generating, after `sequence_length` tokens; None:
        not declared (the model counts the context the mixer leaves)."""
        return None

    def add_sites(self, *names: str) -> None:
        """A `Site` for each name, registered at the attribute of that name (so module paths
        match site names), in order."""
        for name in names:
            self.add_module(name, Site(name))

    def sites(self) -> dict[str, Site | StateSite]:
        """The mixer's own sites by short name, in the order the forward pass reaches them
        (registration order)."""
        found: dict[str, Site | StateSite] = {}
        for module in self.modules():
            if isinstance(module, (Site, StateSite)):
                if module.name in found:
                    raise MixerError(f"{type(self).__name__} has two sites named {module.name!r}")
                found[module.name] = module
        return found

    def check_sites(self) -> None:
        """Check every declaration against the mixer's own sites and forward's signature; a
        MixerError names the first that does not hold."""
        name, sites = type(self).__name__, self.sites()
        plain = {s for s, module in sites.items() if isinstance(module, Site)}

        def known(declaration: str, names, allowed: set[str]) -> None:
            for site in names:
                if not isinstance(site, str) or site not in allowed:
                    kind = "site" if allowed is not plain else "(B, L, C) site"
                    raise MixerError(
                        f"{name}.{declaration} names {site!r}, which is no {kind} of this mixer "
                        f"(its sites: {sorted(allowed) or 'none'})"
                    )

        for flag in ("resumable", "reads_out_at"):
            if not isinstance(getattr(self, flag), bool):
                raise MixerError(f"{name}.{flag} must be True or False")
        known("local_sites", _names(name, "local_sites", self.local_sites), plain)
        known("conv_sites", _names(name, "conv_sites", self.conv_sites), plain)
        for declaration in ("window_sites", "readout_sites"):
            widths = getattr(self, declaration)
            if not isinstance(widths, Mapping):
                raise MixerError(f"{name}.{declaration} must be a mapping site -> int")
            known(declaration, widths, plain)
            for site, n in widths.items():
                try:
                    check_int(f"{name}.{declaration}[{site!r}]", n, 1)
                except ValueError as error:
                    raise MixerError(str(error)) from None
        if self.reach_site is not None:
            known("reach_site", [self.reach_site], plain)
        if self.context_sites is not None:
            known("context_sites", _names(name, "context_sites", self.context_sites), set(sites))
            if not self.resumable:
                raise MixerError(f"{name} declares context_sites but is not resumable")
            if type(self).context_from is Mixer.context_from:
                raise MixerError(f"{name} declares context_sites but no context_from")
        takes = inspect.signature(self.forward).parameters
        for flag, argument in (("resumable", "resume"), ("reads_out_at", "at")):
            if getattr(self, flag) and argument not in takes:
                raise MixerError(f"{name}.{flag} is True but its forward takes no {argument!r}")


def _names(mixer: str, declaration: str, names: object) -> tuple:
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise MixerError(f"{mixer}.{declaration} must be a tuple of site names, got {names!r}")
    return tuple(names)
