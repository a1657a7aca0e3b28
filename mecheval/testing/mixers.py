"""`check_mixer`: a mixer against the contract of docs/mixers.md.

It builds the mixer (which checks its declarations against its sites; every part of a hybrid),
then checks on random inputs what the interchange grid relies on: that its output is one
tensor of its input's shape and dtype; that every site is reached and sees every position (on
the `at=` path too); that its rows are independent; that it is causal, also with every
parameter perturbed; that a run in segments resumed from contexts equals one run (contexts
batch-first, never changed in place), and that it reads out at positions, when it says so;
that every declaration holds on the mixer itself (local and window sites, the reach site, the
read-out sites, the context sites, the state sites); and that the interchange grid equals the
per-cell patching loop on a small model built with it. Each check compares against an
independent run of the mixer, never against the mechanism it checks, and whatever the mixer
raises is a failed check, never a raw error. A failure raises `MixerCheckError` with the
report; a declaration the mixer does not make is skipped. `structure_problems` is the part
`train` runs before it starts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator

import torch

from mecheval.layers import Mixer
from mecheval.layers.resume import Resume, context_rows
from mecheval.layers.sites import SitePlan, StateSite
from mecheval.models import LanguageModel, model_config
from mecheval.models.registry import architecture, register_mixer, unregister_mixer
from mecheval.tasks import make_task
from mecheval.testing.report import Check, MixerCheckError, MixerReport, grid_against_loop


def check_mixer(
    arch: str | Callable[..., Mixer],
    *,
    d_model: int = 16,
    options: dict | None = None,
    length: int = 12,
    batch: int = 3,
    grid: bool = True,
    seed: int = 0,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> MixerReport:
    """Check a mixer against the contract (see the module docstring).

    Args:
        arch: a registered name, an import path (`package.module:Name`), a hybrid of them, or a
            factory (a `Mixer` subclass or a function returning one, as `register_mixer` takes
            it).
        d_model: the width it is checked at.
        options: the model's and the mixer's options, as a model config gives them (init,
            position_embeddings and the mixer's own).
        length, batch: the random inputs' sequence length and batch size (batch >= 2).
        grid: also compare the interchange grid with the per-cell loop on a small model of this
            mixer, one layer per part of a hybrid and at least two (the slowest check).
        seed: the seed of the inputs and of the mixers' weights.
        atol, rtol: tolerances of every comparison (the grid's scaled to its logits'
            magnitude: see `_grid_check`).

    Returns:
        the report; raises MixerCheckError when a check fails, whatever the mixer raised.
    """
    with _named(arch) as name:
        report = MixerReport(name)
        try:
            config = _config(name, d_model, length, options or {})
        except (ValueError, TypeError) as error:  # an option, or declarations against sites
            report.checks.append(Check("build", False, _line(error)))
            raise MixerCheckError(report) from None
        for layer in range(config.n_layers):
            torch.manual_seed(seed + layer)
            mixer = config.mixer(layer).eval()
            prefix = f"layer {layer} ({type(mixer).__name__})"
            probe = _Probe(mixer, d_model, length, batch, seed, atol, rtol)
            for check in probe.checks():
                report.checks.append(Check(f"{prefix} {check.name}", check.passed, check.detail))
        if grid:
            check = functools.partial(_grid_check, config, seed, atol, rtol)
            report.checks.append(_guarded("grid", check))
    if report.failed:
        raise MixerCheckError(report)
    return report


def _config(name: str, d_model: int, length: int, options: dict):
    """The config checked: one layer per part of a hybrid (every part built), at least two."""
    n_layers = max(2, len(architecture(name).parts))
    return model_config(name, 64, d_model, n_layers, max_len=length, **options)


def _line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """`check()`, or a failed Check naming what the mixer raised: never a raw error."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001  (the mixer's own code raises anything)
        return Check(name, False, f"raised {type(error).__name__}: {_line(error)}")


def structure_problems(mixer: Mixer, d_model: int, length: int = 4) -> list[str]:
    """What `check_mixer` would fail on structure, from one run of `mixer` on random input:
    its output not a tensor of its input's shape and dtype, a site that forward never reaches
    or that sees fewer positions than the input has (also on the `at=` path). `train` refuses
    a mixer with any (mecheval.train.config.validate_config)."""
    with torch.random.fork_rng(devices=[]):
        probe = _Probe(mixer.eval(), d_model, length, 2, 0, 1e-5, 1e-4)
        checks = [_guarded("forward", probe.forward)]
        if checks[0].passed:
            checks.append(_guarded("sites", probe.sites))
    return [f"{c.name}: {c.detail}" for c in checks if c.passed is False]


@contextlib.contextmanager
def _named(arch) -> Iterator[str]:
    """The name to build `arch` by: itself, or a factory registered for the check's time."""
    if isinstance(arch, str):
        yield arch
        return
    name = f"check_mixer.{getattr(arch, '__qualname__', 'mixer')}".replace("<", "").replace(">", "")
    register_mixer(name, arch, replace=True)
    try:
        yield name
    finally:
        unregister_mixer(name)


class _Probe:
    """Runs one mixer with reads and patches of its own sites and checks each declaration."""

    def __init__(self, mixer: Mixer, d_model, length, batch, seed, atol, rtol) -> None:
        self.mixer, self.length, self.batch = mixer, length, batch
        self.atol, self.rtol = atol, rtol
        g = torch.Generator().manual_seed(seed)
        self.random = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        self.x = self.random(batch, length, d_model)
        self.rows = torch.arange(batch)

    def run(self, x, reads=None, patches=None, **kwargs):
        """(the mixer's output, its sites' reads) with `reads` {site: positions or None} and
        `patches` {site: (positions, values)} planned on its own sites."""
        record: dict[str, torch.Tensor] = {}
        sites = self.mixer.sites()
        plans = {}
        for name, positions in (reads or {}).items():
            plans[name] = SitePlan(name, record, read=True, read_positions=positions)
        for name, (positions, values) in (patches or {}).items():
            plan = plans.setdefault(name, SitePlan(name, record))
            plan.patch_positions, plan.patch_values = positions, values
        for name, plan in plans.items():
            sites[name].plan = plan
        try:
            with torch.no_grad():
                out = self.mixer(x, **kwargs)
        finally:
            for name in plans:
                sites[name].plan = None
        return out, record

    def same(self, a, b) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, atol=self.atol, rtol=self.rtol)

    def checks(self) -> Iterator[Check]:
        forward = _guarded("forward", self.forward)
        yield forward
        for name, check in (
            ("sites", self.sites),
            ("rows", self.rows_apart),
            ("causal", self.causal),
            ("resumable", self.resumes),
            ("reads_out_at", self.reads_out_at),
            ("local_sites", self.local_sites),
            ("window_sites", self.window_sites),
            ("reach_site", self.reach_site),
            ("readout_sites", self.readout_sites),
            ("context_sites", self.context_sites),
            ("state sites", self.state_sites),
        ):
            yield _guarded(name, check) if forward.passed else Check(name, None, "forward failed")

    def forward(self) -> Check:
        out, _ = self.run(self.x)
        shape = tuple(self.x.shape)
        if not isinstance(out, torch.Tensor):
            got = type(out).__name__
            return Check("forward", False, f"returns a {got}, not one tensor of shape {shape}")
        if out.shape != self.x.shape or out.dtype != self.x.dtype:
            return Check(
                "forward",
                False,
                f"{shape} {self.x.dtype} -> {tuple(out.shape)} {out.dtype}: the output must "
                "have its input's shape and dtype",
            )
        return Check("forward", True, f"{shape} -> {tuple(out.shape)}")

    def sites(self) -> Check:
        """Every site is reached, and sees every position, also on the `at=` path."""
        names = list(self.mixer.sites())
        if not names:
            return Check("sites", None, "none")
        problems = self._unseen(names, {})
        if self.mixer.reads_out_at and not problems:
            at = torch.zeros(self.batch, dtype=torch.long)
            plain = [n for n in names if not isinstance(self.mixer.sites()[n], StateSite)]
            problems = [f"{p} on the at= path" for p in self._unseen(plain, {"at": at})]
        if problems:
            detail = "; ".join(problems) + " (every site sees every position: docs/mixers.md)"
            return Check("sites", False, detail)
        return Check("sites", True, f"{', '.join(names)}: reached, at every position")

    def _unseen(self, names: list[str], kwargs: dict) -> list[str]:
        _, record = self.run(self.x, reads=dict.fromkeys(names), **kwargs)
        problems = []
        for name in names:
            if name not in record:
                problems.append(f"{name} is never reached by forward")
            elif record[name].shape[1] != self.length:
                seen = record[name].shape[1]
                problems.append(f"{name} sees {seen} of {self.length} positions")
        return problems

    def rows_apart(self) -> Check:
        """A row's output depends on its own input alone (the grid stacks documents)."""
        whole, _ = self.run(self.x)
        other = self.x.clone()
        other[0] = self.random(*self.x.shape[1:])
        changed, _ = self.run(other)
        if not self.same(changed[1:], whole[1:]):
            detail = "changing row 0's input changes other rows' outputs: rows must be independent"
            return Check("rows", False, detail)
        return Check("rows", True, "each row's output depends on its own input alone")

    def causal(self) -> Check:
        """Causal as built, and with every parameter perturbed: a look-ahead that the default
        init hides (a gate at zero) shows then."""
        live = copy.deepcopy(self.mixer)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in live.parameters():
                scale = float(p.float().pow(2).mean().sqrt()) or 1.0
                p.add_(0.1 * scale * torch.randn(p.shape, generator=g).to(p.dtype))
        for mixer, how in ((self.mixer, ""), (live, " (with every parameter perturbed)")):
            p = self._peeks(mixer)
            if p is not None:
                detail = f"inputs from position {p} on change earlier outputs{how}"
                return Check("causal", False, detail)
        detail = "later inputs never change earlier outputs, also with every parameter perturbed"
        return Check("causal", True, detail)

    def _peeks(self, mixer: Mixer) -> int | None:
        """The first cut position whose later inputs change `mixer`'s earlier outputs."""
        with torch.no_grad():
            whole = mixer(self.x)
            for p in (1, self.length // 2, self.length - 1):
                later = self.x.clone()
                later[:, p:] = self.random(self.batch, self.length - p, self.x.shape[-1])
                if not self.same(mixer(later)[:, :p], whole[:, :p]):
                    return p
        return None

    def _pieces(self, cuts, **kwargs):
        """The outputs of the segments [0, cuts[0]), [cuts[0], cuts[1]), ..., each resuming
        from the context the one before left, and the context left after the last."""
        resume, outs = Resume(), []
        for start, stop in itertools.pairwise([0, *cuts, self.length]):
            out, _ = self.run(self.x[:, start:stop], resume=resume, **kwargs)
            outs.append(out)
        return torch.cat(outs, 1), resume.context

    def resumes(self) -> Check:
        if not self.mixer.resumable:
            return Check("resumable", None, "not declared: the grid reruns whole documents")
        whole, _ = self.run(self.x)
        cuts = [1, self.length // 2]
        first = Resume()
        self.run(self.x[:, : cuts[1]], resume=first)
        context = first.context or ()
        for i, t in enumerate(context):
            if t is not None and (t.dim() == 0 or t.shape[0] != self.batch):
                detail = (
                    f"context entry {i} has shape {tuple(t.shape)}: its first axis must be the "
                    f"batch ({self.batch})"
                )
                return Check("resumable", False, detail)
        pieces, _ = self._pieces(cuts)
        if not self.same(pieces, whole):
            return Check("resumable", False, f"a run cut at {cuts} differs from one run")
        kept = [None if t is None else t.clone() for t in context]
        rows = torch.tensor([self.batch - 1, 0])
        rest, _ = self.run(
            self.x[rows, cuts[1] :], resume=Resume(context_rows(first.context, rows))
        )
        if not self.same(rest, whole[rows, cuts[1] :]):
            return Check("resumable", False, "resuming a selection of the context's rows differs")
        quiet, _ = self.run(self.x[:, cuts[1] :], resume=Resume(first.context, leave=False))
        if not _same_context(tuple(kept), first.context, torch.equal):
            detail = (
                "resuming changed the context it resumed from in place (leave a new one in "
                "resume.context: the grid resumes many runs from one context)"
            )
            return Check("resumable", False, detail)
        if not self.same(quiet, whole[:, cuts[1] :]):
            return Check("resumable", False, "resuming with leave=False changes the outputs")
        return Check("resumable", True, f"a run cut at {cuts} equals one run")

    def reads_out_at(self) -> Check:
        if not self.mixer.reads_out_at:
            return Check("reads_out_at", None, "not declared: the grid forms every output")
        whole, _ = self.run(self.x)
        at = torch.tensor([self.length - 1, 0, self.length // 2][: self.batch])
        out, _ = self.run(self.x, at=at)
        if not self.same(out, whole[self.rows, at][:, None]):
            return Check("reads_out_at", False, "forward(x, at=at) differs from forward(x) at at")
        if self.mixer.resumable:  # and in a resumed run, at positions of its own
            cut = self.length // 3
            resume = Resume()
            self.run(self.x[:, :cut], resume=resume)
            later = cut + at % (self.length - cut)
            out, _ = self.run(self.x[:, cut:], resume=resume, at=later - cut)
            if not self.same(out, whole[self.rows, later][:, None]):
                return Check("reads_out_at", False, "reading out at positions of a resumed run")
        return Check(
            "reads_out_at", True, "the output at one position per row equals the whole run's"
        )

    def _agreeing(self, keep: slice) -> torch.Tensor:
        """New random inputs that agree with self.x at positions `keep` alone."""
        other = self.random(*self.x.shape)
        other[:, keep] = self.x[:, keep]
        return other

    def local_sites(self) -> Check:
        return self._windowed("local_sites", {s: 1 for s in self.mixer.local_sites})

    def window_sites(self) -> Check:
        return self._windowed("window_sites", dict(self.mixer.window_sites))

    def _windowed(self, declaration: str, widths: dict[str, int]) -> Check:
        if not widths:
            return Check(declaration, None, "none declared")
        t = self.length - 1
        for site, n in widths.items():
            start = max(0, t - n + 1)
            _, ours = self.run(self.x, reads={site: None})
            _, theirs = self.run(self._agreeing(slice(start, t + 1)), reads={site: None})
            if not self.same(ours[site][:, t], theirs[site][:, t]):
                what = "its own position" if n == 1 else f"positions {start}..{t}"
                return Check(declaration, False, f"{site} at {t} depends on more than {what}")
        return Check(declaration, True, ", ".join(f"{s} ({n})" for s, n in widths.items()))

    def reach_site(self) -> Check:
        site = self.mixer.reach_site
        if site is None:
            return Check("reach_site", None, "none declared")
        p = self.length // 3
        changed = self.x.clone()
        changed[:, p] = self.random(self.batch, self.x.shape[-1])
        theirs, read = self.run(changed, reads={site: torch.full((self.batch,), p)})
        ours, _ = self.run(self.x, patches={site: (torch.full((self.batch,), p), read[site])})
        if not self.same(ours[:, p + 1 :], theirs[:, p + 1 :]):
            return Check("reach_site", False, f"the input at {p} reaches later outputs past {site}")
        return Check("reach_site", True, f"{site} carries the input to later positions")

    def readout_sites(self) -> Check:
        widths = dict(self.mixer.readout_sites)
        if not widths:
            return Check("readout_sites", None, "none declared")
        whole, _ = self.run(self.x)
        p = 1
        for site, n in widths.items():
            _, read = self.run(self.x, reads={site: torch.full((self.batch,), p)})
            values = read[site] + self.random(*read[site].shape)
            out, _ = self.run(self.x, patches={site: (torch.full((self.batch,), p), values)})
            far = torch.ones(self.length, dtype=torch.bool)
            far[p : p + n] = False
            if not self.same(out[:, far], whole[:, far]):
                return Check(
                    "readout_sites", False, f"{site} at {p} reaches outputs past {p + n - 1}"
                )
        return Check("readout_sites", True, ", ".join(f"{s} ({n})" for s, n in widths.items()))

    def context_sites(self) -> Check:
        names = self.mixer.context_sites
        if names is None:
            return Check("context_sites", None, "not declared: the grid runs its base in segments")
        points = [self.length // 3, self.length - 2]
        sites = self.mixer.sites()
        before = torch.tensor(points)[None].expand(self.batch, -1) - 1
        reads = {s: before if isinstance(sites[s], StateSite) else None for s in names}
        _, values = self.run(self.x, reads=reads)
        for index, point in enumerate(points):
            resume = Resume()
            self.run(self.x[:, :point], resume=resume)
            ours = self.mixer.context_from(values, point, index)
            if not _same_context(ours, resume.context, self.same):
                detail = f"context_from at {point} differs from what a run of [0, {point}) leaves"
                return Check("context_sites", False, detail)
        return Check("context_sites", True, f"{', '.join(names)} give the contexts at {points}")

    def state_sites(self) -> Check:
        states = [s for s, m in self.mixer.sites().items() if isinstance(m, StateSite)]
        if not states:
            return Check("state sites", None, "none")
        whole, _ = self.run(self.x)
        p = self.length // 2
        at = torch.full((self.batch,), p)
        compared = []
        for site in states:
            _, read = self.run(self.x, reads={site: at})
            same, _ = self.run(self.x, patches={site: (at, read[site])})
            if not self.same(same, whole):
                detail = f"patching {site} with its own value changes the run"
                return Check("state sites", False, detail)
            slot = self._state_slot(read[site], p)
            if slot is None:
                continue
            values = read[site] + self.random(*read[site].shape)
            patched, _ = self.run(self.x, patches={site: (at, values)})
            first = Resume()
            self.run(self.x[:, : p + 1], resume=first)
            context = list(first.context)
            context[slot] = values
            resumed, _ = self.run(self.x[:, p + 1 :], resume=Resume(tuple(context)))
            before, after = patched[:, : p + 1], patched[:, p + 1 :]
            if not self.same(before, whole[:, : p + 1]) or not self.same(after, resumed):
                detail = f"a patch of {site} at {p} differs from resuming from the patched state"
                return Check("state sites", False, detail)
            compared.append(site)
        detail = f"{', '.join(states)}: a patch with the state's own value is the identity"
        if compared:
            detail += f"; patches of {', '.join(compared)} equal resuming from the patched state"
        return Check("state sites", True, detail)

    def _state_slot(self, state: torch.Tensor, p: int) -> int | None:
        """The place of the state in the context a run of [0, p] leaves, if it holds it."""
        if not self.mixer.resumable:
            return None
        first = Resume()
        self.run(self.x[:, : p + 1], resume=first)
        for i, t in enumerate(first.context or ()):
            if t is not None and t.shape == state.shape and self.same(t, state):
                return i
        return None


def _same_context(ours, theirs, same) -> bool:
    if ours is None or theirs is None:
        return ours is theirs
    if len(ours) != len(theirs):
        return False
    return all(
        (a is None and b is None) or (a is not None and b is not None and same(a, b))
        for a, b in zip(ours, theirs, strict=True)
    )


# The grid check's model is sharpened (weights x 4: patches then matter) and its head tempered
# to logits of at most this magnitude, whatever the init: float32 rounding in the logits grows
# with their magnitude (PyTorch's init makes them ~200), and saturated softmaxes compare nothing.
LOGIT_SCALE = 8.0


def _grid_check(config, seed: int, atol: float, rtol: float) -> Check:
    """The interchange grid equals the per-cell loop on a small model of the mixer (one layer
    per part of a hybrid, at least two; its options and init), every site, the named
    positions."""
    task = make_task("ar", num_pairs=4, num_keys=16)
    config = dataclasses.replace(
        config, vocab_size=task.vocab_size, max_len=task.max_document_length
    )
    torch.manual_seed(seed)
    model = LanguageModel(config).eval()
    batch = task.sample(6, seed=seed, split="dev")
    corrupted = task.corrupt(batch, "key", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
        scale = float(model(batch.tokens).abs().max())
        if scale > LOGIT_SCALE:  # the final norm's output scales the logits alone
            model.norm_f.weight.mul_(LOGIT_SCALE / scale)
            model.norm_f.bias.mul_(LOGIT_SCALE / scale)
    return grid_against_loop(model, batch, corrupted, atol, rtol, "cells equal the per-cell loop")
