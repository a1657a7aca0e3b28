"""DAS's patched runs that enter a recurrent model's last block, without its recurrence from the
patch to the query (mecheval.interventions.das runs every other site from its block on).

Every scan at positions is affine in its state (kernels.scan_at): the last block's scan output
at the query is the base run's plus a linear map, the readout, of the change a patch makes to
the state at a position before it. Each scan's output at a position reads the state
elementwise along the output's own axes and contracts the one left (`READOUT_AXES`), so the
readout from a position has the state's shape: the gradient of the summed scan output at the
query with respect to the state there. One pass of the base's scan, position by position, with
a zero added to the state after each, gives those gradients from every position at once (and
the base's contexts at every position), for every site of the block. Then:

- a state site of the last block needs no recurrence at all: the change is the swap's;
- a patch of the residual entering the last block at p (its block input, or a site after the
  previous block's mixer) changes the scan's inputs at positions p .. p + w - 1 alone: a
  recurrent mixer's scan inputs at a position are projections of its input there and, through
  its short convolutions (w the widest, 1 without), of its inputs at the w - 1 before. The
  block runs over those w positions from the base's context at p, and the state it leaves
  carries the patch on to the query; where the query lies among them, the block's output
  there is read directly.

The mixer's output, the rest of the block and the final norm then run at the query alone. In
exact arithmetic this is the full patched run's computation; the tests compare the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import kernels
from mecheval.interventions.das_data import SiteData
from mecheval.interventions.grid import block_output_at, hidden_at
from mecheval.interventions.plan import AFTER_MIXER, SiteRef
from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.resume import Resume

# Per drop-in scan: the state axis its output at a position contracts (it reads the others
# elementwise), and the time axis of that output (kernels.at_positions: the selective scan's
# (D, N) state gives (D, 1), Mamba-2's (H, P, N) gives (1, H, P), the delta rules' (H, K, V)
# give (1, H, V)).
READOUT_AXES = {
    kernels.selective_scan_fn: (-1, 2),
    kernels.mamba2_scan: (-1, 1),
    kernels.chunk_delta_rule: (-2, 1),
    kernels.chunk_gated_delta_rule: (-2, 1),
}
# Bytes of the per-position readouts (documents x positions x state) one pass holds: more
# documents run in several passes.
READOUT_BUDGET = 1 << 28


@dataclass
class LastBlock:
    """What one site's patched runs in the last block need, read once from the base run. Per
    position label (the first axis of each (P, n, ...) tensor, in the order of the site's
    `positions`) and document."""

    layer: int
    window: int  # positions the block runs from each patch (0: a state site, no run)
    axes: tuple[int, int]  # the readout's contracted state axis and its output's time axis
    positions: torch.Tensor  # (P, n) the patched positions
    readout: torch.Tensor  # (P, n, *state) from where the change is measured to the query
    base_state: torch.Tensor | None  # (P, n, *state) the base's state there
    scan_out: torch.Tensor  # (n, ...) the base's scan output at the query
    aside: torch.Tensor | None  # (n, ...) what the mixer's output reads beside it
    residual: torch.Tensor  # (n, needed, d_model) the base's residual entering the block
    query: torch.Tensor  # (n,)
    contexts: tuple | None = None  # each entry (P, n, ...): the base's context at each patch

    def hidden(self, model, values, labels, docs) -> torch.Tensor:
        """(rows, d_model) the head input at each row's query with `values` (rows, ...) put in
        at its label's position: the state there, or the residual entering the block."""
        if self.window:
            outputs, state = self._run_window(model, values, labels, docs)
        else:
            state = values.view(len(values), *self.base_state.shape[2:])
        change = state.to(self.readout.dtype) - self.base_state[labels, docs]
        contracted, time = self.axes
        moved = (self.readout[labels, docs] * change).sum(contracted).unsqueeze(time)
        at = self.query[docs]
        mixer = model.layers[self.layer].mixer
        aside = None if self.aside is None else self.aside[docs]
        mixed = mixer.output(self.scan_out[docs] + moved, aside, at)[:, 0]
        site = SiteRef(f"layers.{self.layer}.mixer_output", self.layer, "mixer_output")
        output = block_output_at(model, site, mixed, self.residual[docs, at])
        if self.window:  # the query among the positions the block ran
            local = at - self.positions[labels, docs]
            inside = (local >= 0) & (local < self.window)
            rows = torch.arange(len(docs), device=docs.device)
            direct = outputs[rows, local.clamp(0, self.window - 1)]
            output = torch.where(inside[:, None], direct, output)
        return hidden_at(model, self.layer + 1, output[:, None], torch.zeros_like(at))

    def _run_window(self, model, values, labels, docs) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over the `window` positions from each row's patch, `values` the residual
        at the first, from the base's context there: (its outputs (rows, window, d_model),
        the state it leaves)."""
        at = self.positions[labels, docs]
        last = self.residual.shape[1] - 1
        span = (at[:, None] + torch.arange(self.window, device=at.device)).clamp(max=last)
        suffix = self.residual[docs[:, None], span[:, 1:]]
        window = torch.cat([values[:, None].to(suffix.dtype), suffix], dim=1)
        resume = Resume(tuple(c[labels, docs] for c in self.contexts), leave=True)
        outputs = model.layers[self.layer](window, resume)
        return outputs, resume.state[-1]


def last_blocks(model, data: dict[str, SiteData], query: torch.Tensor) -> dict[str, LastBlock]:
    """Site name -> its `LastBlock`, for the sites whose patches enter a recurrent model's last
    block (a state site of the last block, its block input, a site after the previous block's
    mixer) when its scan has a known readout; the others' runs go from their block on."""
    layer = len(model.layers) - 1
    mixer = model.layers[layer].mixer
    kinds = {name: _kind(site.ref, layer) for name, site in data.items()}
    kinds = {name: kind for name, kind in kinds.items() if kind is not None}
    if not kinds or not isinstance(mixer, RecurrentMixer):
        return {}
    site = data[next(iter(kinds))]
    with torch.no_grad():
        h = _mixer_input(model, layer, site.residual)
        scan_at, _, aside = mixer.scan_inputs(h, *mixer.context_in(None), None)
    if not _known_scan(scan_at):
        return {}
    axes = READOUT_AXES[scan_at.args[0]]
    positions = torch.stack(list(site.positions.values()))  # (P, n), every site's the same
    last = site.residual.shape[1] - 1
    window = max([mixer.conv_width(prefix) for prefix in mixer.convs], default=1)
    measured = {0: positions.clamp(max=last), window: (positions + window - 1).clamp(max=last)}
    readouts, scan_out, contexts = _stepwise(mixer, h, query, measured, positions)
    blocks = {}
    for name, kind in kinds.items():
        width = 0 if kind == "state" else window
        blocks[name] = LastBlock(
            layer=layer,
            window=width,
            axes=axes,
            positions=positions,
            readout=readouts[width],
            base_state=None,
            scan_out=scan_out,
            aside=aside,
            residual=data[name].residual,
            query=query,
            contexts=None if kind == "state" else contexts,
        )
        blocks[name].base_state = _base_state(model, data[name], blocks[name])
    return blocks


def _kind(ref: SiteRef, layer: int) -> str | None:
    """ "state" for a state site of block `layer`, "residual" for a site whose patch is put in
    the residual entering it, None otherwise."""
    if ref.short == "state" and ref.layer == layer:
        return "state"
    if (ref.short == "block_input" and ref.layer == layer) or (
        ref.short in AFTER_MIXER and ref.layer == layer - 1
    ):
        return "residual"
    return None


def _known_scan(scan_at) -> bool:
    """Whether a mixer's scan is `kernels.at_positions` of a drop-in with a known readout."""
    return (
        isinstance(scan_at, functools.partial)
        and scan_at.func is kernels.at_positions
        and bool(scan_at.args)
        and scan_at.args[0] in READOUT_AXES
    )


def _mixer_input(model, layer: int, residual: torch.Tensor) -> torch.Tensor:
    """The base's mixer input in block `layer`, (n, needed, d_model): one run of the block."""
    name = f"layers.{layer}.mixer_input"
    with model.intervene(reads={name: None}) as record:
        model.forward_from(layer, residual, stop=layer + 1)
    return record[name]


def _stepwise(mixer, h, query, measured: dict, context_at) -> tuple:
    """The base's scan in the last block, position by position (documents in passes that keep
    the readouts within READOUT_BUDGET): (key -> the readouts (P, n, *state) from the states
    after the positions measured[key] (P, n) to the query, the scan's output at the query
    (n, ...), each entry of the contexts (P, n, ...) after positions [0, p) for p in
    context_at (P, n))."""
    n, needed = h.shape[:2]
    per_doc = 4 * needed * max(1, mixer.state_size(needed) or 1)
    step = max(1, READOUT_BUDGET // per_doc)
    parts = []
    for first in range(0, n, step):
        picked = slice(first, first + step)
        chosen = {key: at[:, picked] for key, at in measured.items()}
        parts.append(_stepwise_rows(mixer, h[picked], query[picked], chosen, context_at[:, picked]))
    readouts = {key: torch.cat([p[0][key] for p in parts], dim=1) for key in measured}
    contexts = tuple(torch.cat(entry, dim=1) for entry in zip(*(p[2] for p in parts), strict=True))
    return readouts, torch.cat([p[1] for p in parts]), contexts


def _stepwise_rows(mixer, h, query, measured: dict, context_at) -> tuple:
    """`_stepwise` for one pass of documents: a zero that needs a gradient is added to the
    state after each position, and the gradients of the summed output at the query with
    respect to them are the readouts from there (zero from the query on)."""
    n, needed = h.shape[:2]
    rows = torch.arange(n, device=h.device)
    windows, state = mixer.context_in(None)
    outs, zeros, contexts = [], [], None
    resume = Resume(leave=True)
    with torch.enable_grad():
        for t in range(needed):
            scan_at, windows, _ = mixer.scan_inputs(h[:, t : t + 1], windows, state, resume)
            result = scan_at(return_final_state=True)
            zero = torch.zeros_like(result.final_state, requires_grad=True)
            state = result.final_state + zero
            outs.append(result.out)
            zeros.append(zero)
            contexts = _keep_context(contexts, (*windows, state), context_at == t + 1)
        at_query = torch.stack(outs)[query, rows]  # (n, ...) with the time axis of length 1
        grads = torch.autograd.grad(at_query.sum(), zeros, allow_unused=True)
    after = torch.stack(
        [torch.zeros_like(z) if g is None else g for g, z in zip(grads, zeros, strict=True)]
    )
    readouts = {key: after[at, rows] for key, at in measured.items()}
    return readouts, at_query.detach(), contexts


def _keep_context(kept: tuple | None, context: tuple, here: torch.Tensor) -> tuple:
    """The contexts kept so far (each entry (P, n, ...), zeros where not yet reached; None:
    none yet) with `context` (each entry (n, ...)) put in where `here` (P, n) holds."""
    if kept is None:
        kept = tuple(c.new_zeros(here.shape[0], *c.shape) for c in context)
    for j, label in enumerate(here):
        rows = label.nonzero()[:, 0]
        if len(rows):
            for old, new in zip(kept, context, strict=True):
                old[j, rows] = new.detach()[rows]
    return kept


@torch.no_grad()
def _base_state(model, data: SiteData, found: LastBlock) -> torch.Tensor:
    """(P, n, *state) the base's state where `found` measures the change a patch makes: at a
    state site, the state after the patch; else after the block's window from it, run on the
    base's residual."""
    if not found.window:
        shape = found.readout.shape[2:]
        return torch.stack([v.view(-1, *shape) for v in data.base.values()]).to(found.readout)
    rows = torch.arange(len(found.query), device=found.query.device)
    last = data.residual.shape[1] - 1
    states = []
    for j, at in enumerate(found.positions):
        base = data.residual[rows, at.clamp(max=last)]
        states.append(found._run_window(model, base, torch.full_like(at, j), rows)[1])
    return torch.stack(states).to(found.readout)
