"""DAS's patched runs that enter a recurrent model's last block, without its recurrence from the
patch to the query (mecheval.interventions.das runs every other site from its block on).

Every scan at positions is affine in its state (mecheval_kernels.scan_at): the last block's scan
output at the query is the corrupted run's plus a linear map, the readout, of the change a patch
makes to the state after a position before it. Each scan's output at a position reads the state
elementwise along the output's own axes and contracts the one left (`READOUT_AXES`), so the readout
from a position has the state's shape: the gradient of the scan's output at the query, summed, with
respect to the state it starts from there, formed once per document and position label (a backward
of the corrupted run's scan from the position to the query, all of them in a few runs of similar
lengths).

A recurrent mixer's scan inputs at a position are projections of its input there and, through
its short convolutions (w the widest, 1 without), of its inputs at the w - 1 before. So a patch
of the residual entering the last block at p (its block input, or a site after the previous
block's mixer) changes the scan's inputs at p .. p + w - 1 alone, and a patch of its state
after p changes none: the block runs over those positions (from p, or from p + 1 with the
patched state) from the corrupted run's context there, and the change in the state it leaves
after p + w - 1 reaches the query through the readout from there. Where the query lies among the
positions run, the block's output there is read directly. The mixer's output, the rest of the
block and the final norm then run at the query alone. In exact arithmetic this is the full
patched run's computation; the tests compare the two.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

import mecheval_kernels
from mecheval.interventions.das_data import SiteData
from mecheval.interventions.engine import block_output_at, hidden_at
from mecheval.interventions.plan import AFTER_MIXER, SiteRef
from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.resume import Resume

# Per drop-in scan: the state axis its output at a position contracts (it reads the others
# elementwise), and the time axis of that output (mecheval_kernels.at_positions: the selective
# scan's (D, N) state gives (D, 1), Mamba-2's (H, P, N) gives (1, H, P), the delta rules' (H, K, V)
# give (1, H, V)).
READOUT_AXES = {
    mecheval_kernels.selective_scan_fn: (-1, 2),
    mecheval_kernels.mamba2_scan: (-1, 1),
    mecheval_kernels.chunk_delta_rule: (-2, 1),
    mecheval_kernels.chunk_gated_delta_rule: (-2, 1),
}
# The readouts' backward runs its rows (documents and labels) in this many groups of similar
# lengths, more where a group's floats of scan state x positions would pass READOUT_FLOATS.
READOUT_GROUPS = 8
READOUT_FLOATS = 1 << 26


@dataclass
class LastBlock:
    """What one site's patched runs in the last block need, read once from the corrupted
    run. Per position label (the first axis of each (P, n, ...) tensor, in the order of the site's
    `positions`) and document."""

    layer: int
    state_site: bool  # a state site (else the residual entering the block is patched)
    window: int  # positions the block runs from the patch (from p, or p + 1 at a state site)
    axes: tuple[int, int]  # the readout's contracted state axis and its output's time axis
    positions: torch.Tensor  # (P, n) the patched positions
    readout: torch.Tensor  # (P, n, *state) from the state after p + w - 1 to the query
    corrupted_state: torch.Tensor  # (P, n, *state) the corrupted run's state there
    scan_out: torch.Tensor  # (n, ...) the corrupted run's scan output at the query
    aside: torch.Tensor | None  # (n, ...) what the mixer's output reads beside it
    residual: torch.Tensor  # (n, needed, d_model) the corrupted run's residual entering the block
    query: torch.Tensor  # (n,)
    # each entry (P, n, ...): the corrupted run's context where the block's run starts
    contexts: tuple

    def hidden(self, model, values, labels, docs) -> torch.Tensor:
        """(rows, d_model) the head input at each row's query with `values` (rows, ...) put in
        at its label's position: the state after it, or the residual entering the block."""
        if self.state_site:
            values = values.view(len(values), *self.readout.shape[2:])
        outputs, state = self._run(model, values, labels, docs)
        change = state.to(self.readout.dtype) - self.corrupted_state[labels, docs]
        contracted, time = self.axes
        moved = (self.readout[labels, docs] * change).sum(contracted).unsqueeze(time)
        at = self.query[docs]
        mixer = model.layers[self.layer].mixer
        aside = None if self.aside is None else self.aside[docs]
        mixed = mixer.output(self.scan_out[docs] + moved, aside, at)[:, 0]
        site = SiteRef(f"layers.{self.layer}.mixer_output", self.layer, "mixer_output")
        output = block_output_at(model, site, mixed, self.residual[docs, at])
        if outputs is not None:  # the query among the positions the block ran
            local = at - self.positions[labels, docs] - int(self.state_site)
            inside = (local >= 0) & (local < self.window)
            rows = torch.arange(len(docs), device=docs.device)
            direct = outputs[rows, local.clamp(0, self.window - 1)]
            output = torch.where(inside[:, None], direct, output)
        return hidden_at(model, self.layer + 1, output[:, None], torch.zeros_like(at))

    def _run(self, model, values, labels, docs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The block over its `window` positions from each row's patch, from the corrupted run's
        context there: (its outputs (rows, window, d_model), None without a run; the state it
        leaves). `values`: the residual at the first position, or the state that starts the
        run."""
        context = tuple(c[labels, docs] for c in self.contexts)
        if self.state_site:
            if not self.window:
                return None, values
            context = (*context[:-1], values)
        first = self.positions[labels, docs] + int(self.state_site)
        span = first[:, None] + torch.arange(self.window, device=first.device)
        window = self.residual[docs[:, None], span.clamp(max=self.residual.shape[1] - 1)]
        if not self.state_site:
            window = torch.cat([values[:, None].to(window.dtype), window[:, 1:]], dim=1)
        resume = Resume(context, leave=True)
        outputs = model.layers[self.layer](window, resume)
        return outputs, resume.context[-1]


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
        scan_at, _, aside = mixer.scan_inputs(site.mixer_input, *mixer.context_in(None), None)
        if not _known_scan(scan_at):
            return {}
        corrupted = scan_at(out_at=query, return_final_state=True)
    positions = torch.stack(list(site.positions.values()))  # (P, n), every site's the same
    last = site.residual.shape[1] - 1
    width = max([mixer.conv_width(prefix) for prefix in mixer.convs], default=1)
    shape = corrupted.final_state.shape[1:]
    measured = (positions + width - 1).clamp(max=last)
    reads = _read_block(model, layer, site.residual, positions)
    readout = _readouts(mixer, site.mixer_input, query, measured, shape, reads)
    before = reads["state"].transpose(0, 1)  # (P, n, *state) after p - 1
    residual = LastBlock(
        layer=layer, state_site=False, window=width, axes=READOUT_AXES[scan_at.args[0]],
        positions=positions, readout=readout, corrupted_state=readout, scan_out=corrupted.out,
        aside=aside, residual=site.residual, query=query,
        contexts=_contexts_at(mixer, reads, before, positions, last),
    )  # fmt: skip
    residual.corrupted_state = _corrupted_state(model, residual)
    blocks = {}
    for name, kind in kinds.items():
        if kind == "residual":
            blocks[name] = dataclasses.replace(residual, residual=data[name].residual)
            continue
        after = torch.stack([v.view(-1, *shape) for v in data[name].corrupted.values()])
        contexts = _contexts_at(mixer, reads, after.to(before), positions + 1, last)
        blocks[name] = dataclasses.replace(
            residual, state_site=True, window=width - 1, contexts=contexts
        )
    return blocks


@torch.no_grad()
def _corrupted_state(model, found: LastBlock) -> torch.Tensor:
    """(P, n, *state) the corrupted run's state after p + w - 1, where a `LastBlock` measures
    the change a patch makes: `found`'s block run (of the residual's kind) on the corrupted run's
    residual."""
    rows = torch.arange(len(found.query), device=found.query.device)
    last = found.residual.shape[1] - 1
    states = []
    for j, at in enumerate(found.positions):
        residual = found.residual[rows, at.clamp(max=last)]
        states.append(found._run(model, residual, torch.full_like(at, j), rows)[1])
    return torch.stack(states).to(found.readout)


def _kind(ref: SiteRef, layer: int) -> str | None:
    """What a site's patch changes in block `layer`: "state" (a state site of the block),
    "residual" (the residual entering it: its block input, a site after the previous block's
    mixer), or None (anything else)."""
    if ref.short == "state" and ref.layer == layer:
        return "state"
    if (ref.short == "block_input" and ref.layer == layer) or (
        ref.short in AFTER_MIXER and ref.layer == layer - 1
    ):
        return "residual"
    return None


def _known_scan(scan_at) -> bool:
    """Whether a mixer's scan is `mecheval_kernels.at_positions` of a drop-in with a known
    readout."""
    return (
        isinstance(scan_at, functools.partial)
        and scan_at.func is mecheval_kernels.at_positions
        and bool(scan_at.args)
        and scan_at.args[0] in READOUT_AXES
    )


def _readouts(mixer, h, query, measured, shape, reads: dict) -> torch.Tensor:
    """(P, n, *shape) the readouts from the state after positions `measured` (P, n) to the
    query of each document (zero where the position is not before it): the gradient of the
    scan's output at the query, summed, with respect to the state it starts from at the next
    position (the scan of the corrupted run's inputs there, their short convolutions resumed from
    the corrupted run's windows in `reads`). Rows of similar length run together, in
    READOUT_GROUPS runs or more (within READOUT_FLOATS each)."""
    weights = h.new_zeros(*measured.shape, *shape, dtype=torch.float32)
    label, doc = (measured < query).nonzero(as_tuple=True)
    start = measured[label, doc] + 1
    length = query[doc] - start + 1  # positions start .. query
    order = torch.argsort(length)
    size = max(1, -(-len(order) // READOUT_GROUPS))
    size = min(size, max(1, READOUT_FLOATS // (h.shape[1] * shape.numel())))
    last = h.shape[1] - 1
    for first in range(0, len(order), size):
        picked = order[first : first + size]
        j, rows, begin = label[picked], doc[picked], start[picked]
        span = begin[:, None] + torch.arange(int(length[picked].max()), device=h.device)
        windows = tuple(
            _inputs_before(reads[f"{prefix}_input"][rows], begin, mixer.conv_width(prefix), last)
            for prefix in mixer.convs
        )
        put = torch.zeros(len(rows), *shape, device=h.device, requires_grad=True)
        with torch.no_grad():
            scan_at, _, _ = mixer.scan_inputs(
                h[rows[:, None], span.clamp(max=last)], windows, put, None
            )
        with torch.enable_grad():
            out = scan_at(out_at=query[rows] - begin).out
            (grad,) = torch.autograd.grad(out.sum(), put, allow_unused=True)
        if grad is not None:
            weights[j, rows] = grad.to(weights.dtype)
    return weights


def _inputs_before(inputs: torch.Tensor, starts: torch.Tensor, width: int, last: int):
    """(rows, C, width - 1) a short convolution's window after positions [0, s) for each row's start
    s (rows,): its inputs (rows, needed, C) at s - width + 1 .. s - 1, zeros before position 0 (the
    layout `mecheval_kernels.causal_conv1d_fn` takes); starts past `last` read there."""
    at = starts[:, None] + torch.arange(1 - width, 0, device=starts.device)
    rows = torch.arange(len(starts), device=starts.device)[:, None]
    kept = inputs[rows, at.clamp(0, last)] * (at >= 0)[..., None].to(inputs.dtype)
    return kept.transpose(1, 2).contiguous()


def _read_block(model, layer: int, residual, positions) -> dict:
    """The last block's short convolutions' inputs (n, needed, C) and its states after the
    positions just before `positions` (P, n) (n, P, *state), by short site name: one no-grad
    run of the block on the corrupted run's residual."""
    mixer = model.layers[layer].mixer
    name = lambda short: f"layers.{layer}.{short}"  # noqa: E731
    reads = {name(f"{prefix}_input"): None for prefix in mixer.convs}
    reads[name("state")] = (positions.T - 1).clamp(0, residual.shape[1] - 1)
    with torch.no_grad(), model.intervene(reads=reads) as record:
        model.forward_from(layer, residual, stop=layer + 1)
    return {full.split(".", 2)[2]: record[full] for full in reads}


def _contexts_at(mixer, reads: dict, before, starts: torch.Tensor, last: int) -> tuple:
    """Each entry (P, n, ...) of a recurrent mixer's context (mecheval.layers.recurrent: its
    convolutions' windows, then the state) after positions [0, s) for each start s of
    `starts` (P, n), a patched position p or p + 1: the convolutions' last width - 1 inputs
    before s (zeros before position 0, from `_read_block`'s reads) and the state `before`
    (P, n, *state) after p - 1 (zero at p = 0; a state site's start p + 1 puts its own in);
    starts past `last` read there."""
    entries = [
        torch.stack([_inputs_before(reads[f"{prefix}_input"], s, mixer.conv_width(prefix), last)
                     for s in starts])
        for prefix in mixer.convs
    ]  # fmt: skip
    started = (starts > 0).view(*starts.shape, *(1,) * (before.dim() - 2))
    entries.append(before * started.to(before.dtype))
    return tuple(entries)
