"""The patched-run engine every intervention kind runs on: the clean run and the run patched
(the corrupted documents', or the clean ones' in an ablation), that run's mixer contexts at
resume points, rows patched at one position each and run from their block and resume point
(`run_patched`), and the answer's metrics at the query. The interchange grid
(mecheval.interventions.grid), the ablations, DAS (mecheval.interventions.das) and path patching
are its clients; what a plan prunes and why: mecheval.interventions.plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mecheval.interventions.plan import METRIC_ROWS
from mecheval.layers.resume import context_rows

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def hidden_at(
    model, layer: int, residual: torch.Tensor, query: torch.Tensor, contexts: list | None = None
) -> torch.Tensor:
    """(B, d_model) the head's input at each row's query position, running blocks layer.. on
    `residual` (the positions after those `contexts`, one per block run, cover; None: from
    position 0)."""
    if contexts is None:
        return model.forward_from(layer, residual, at=query, head="hidden")
    return model.resume_from(layer, residual, contexts, at=query, head="hidden", leave=False)[0]


# Base-2 logits whose size stays within this bound need no shift in their log-sum-exp: 2^-100
# is a normal float32, and 2^100 times a vocabulary of up to 2^27 ids stays below 2^128.
UNSHIFTED = 100.0


@dataclass(frozen=True)
class Metrics:
    """What the metrics need besides a patched run's head input: the head (the model's
    unembedding itself in float32, no copy: the logits are formed in base 2 from the head input
    times log2(e), so that exp2 of them is exp of the true ones: about 2.5x faster on CPU, where
    the log-sum-exp is a tenth of a grid), and the clean run's distribution at the query as its
    probabilities times the head (probs_head (n, d_model): <p, logits> = <p W, hidden>, a
    product over d_model instead of the vocabulary) and neg_entropy (n,) = sum_v p log p.
    `rows`: head inputs whose logits are formed at a time (the plan's `metric_rows`)."""

    weight: torch.Tensor
    probs_head: torch.Tensor
    neg_entropy: torch.Tensor
    head_norm2: float  # the largest norm of a row of the head, times log2(e)
    rows: int = METRIC_ROWS
    # The logits of every block of rows are written into one buffer: a fresh one per call
    # costs page faults on CPU.
    _buffer: list = field(default_factory=list, repr=False)

    @staticmethod
    def of(model, clean_hidden: torch.Tensor, rows: int = METRIC_ROWS) -> Metrics:
        # A float32 head is used as it is; another dtype's is copied to float32 once (the
        # metrics' precision), the one copy of the head a grid then holds.
        weight = model.unembedding.detach().float()
        log_p = F.log_softmax(F.linear(clean_hidden.float(), weight), dim=-1)
        probs = log_p.exp()
        norm2 = float(weight.norm(dim=1).max()) * _LOG2E
        return Metrics(weight, probs @ weight, (probs * log_p).sum(-1), norm2, max(1, rows))

    def __call__(self, hidden: torch.Tensor, answers: torch.Tensor, rows: torch.Tensor | None):
        """(p of the answer, the answer's logit, KL(clean || patched)) per row of `hidden`
        (B, d_model), the head input of documents `rows` (None: every document in order).

        KL = sum p log p - sum p (logits - lse) = neg_entropy - <p, logits> + lse, as sum p = 1:
        one log-sum-exp and one product over d_model per row, not a log-softmax.
        """
        hidden = hidden.float()
        lse2, logit2 = hidden.new_empty(len(hidden)), hidden.new_empty(len(hidden))
        for first in range(0, len(hidden), self.rows):
            block = slice(first, first + self.rows)
            part = hidden[block]
            # |logit2| <= |hidden| |row of the head| log2(e): within +-UNSHIFTED, exp2 of every
            # logit and their sum stay normal floats, and the log-sum-exp needs no shift.
            unshifted = float(part.norm(dim=1).max()) * self.head_norm2 <= UNSHIFTED
            # The head input, not the head, scaled to base 2: (rows, d_model) floats, not a copy
            # of the (vocabulary, d_model) head.
            logits2 = torch.mm(part * _LOG2E, self.weight.t(), out=self._logits(len(part)))
            logit2[block] = logits2.gather(1, answers[block, None])[:, 0]
            if unshifted:
                lse2[block] = logits2.exp2_().sum(-1).log2()
            else:
                top = logits2.amax(-1, keepdim=True)  # (log2(e) times the logits)
                lse2[block] = top[:, 0] + logits2.sub_(top).exp2_().sum(-1).log2()
        probs_head = self.probs_head if rows is None else self.probs_head[rows]
        neg_entropy = self.neg_entropy if rows is None else self.neg_entropy[rows]
        dot = torch.linalg.vecdot(probs_head, hidden)
        kl = (neg_entropy - dot + lse2 * _LN2).clamp_min(0.0)
        return torch.exp2(logit2 - lse2), logit2 * _LN2, kl

    def _logits(self, rows: int) -> torch.Tensor:
        if not self._buffer or len(self._buffer[0]) < rows:
            self._buffer[:] = [self.weight.new_empty(rows, len(self.weight))]
        return self._buffer[0][:rows]


def corrupted_run(
    model, embedded: torch.Tensor, query: torch.Tensor, reads: dict, points: list[int], needed: int
):
    """The run patched (the corrupted documents', or the clean ones' in an ablation), once and
    unpatched, over positions [0, needed): its head input at each row's query, the sites
    `reads` names (n, needed, C), and point -> every layer's mixer context after positions
    [0, point) (only given resume `points`: the run then goes in segments split at them, or is
    one pass whose reads give the contexts)."""
    if not points:
        with model.intervene(reads=reads) as record:
            hidden = hidden_at(model, 0, embedded[:, :needed], query)
        return hidden, {name: record[name] for name in reads}, {}
    sites = model.context_sites()
    if sites is not None:  # one run, whose reads give the contexts at the resume points
        points = [p for p in points if p > 0]
        before = torch.tensor(points, device=query.device) - 1
        wanted = {name: None for name in sites}
        wanted.update({n: before.expand(len(query), -1) for n in sites if n.endswith(".state")})
        with model.intervene(reads={**wanted, **reads}) as record:
            hidden = hidden_at(model, 0, embedded[:, :needed], query)
        contexts = {0: [None] * len(model.layers), **model.contexts_from(record, points)}
        return hidden, {name: record[name] for name in reads}, contexts
    contexts: dict[int, list] = {0: [None] * len(model.layers)}
    parts: dict[str, list] = {name: [] for name in reads}
    hidden, start = None, 0
    for end in [p for p in points if p > 0] + [needed]:
        here = (query >= start) & (query < end)  # the rows whose query this segment holds
        at = (query - start).clamp(0, end - start - 1)  # (the others' are ignored)
        with model.intervene(reads=reads) as record:
            segment, contexts[end] = model.resume_from(
                0,
                embedded[:, start:end],
                contexts[start],
                at=at,
                head="hidden" if here.any() else False,
            )
        for name in reads:
            parts[name].append(record[name])
        if segment is not None:
            if hidden is None:
                hidden = segment.new_empty(segment.shape)
            hidden[here] = segment[here]
        start = end
    return hidden, {name: torch.cat(p, 1) for name, p in parts.items()}, contexts


class Contexts:
    """The mixer contexts of the run patched at each resume point, handed out for a chunk's
    rows. The rows of a chunk recur from site to site (the same cells, bucketed the same
    way), so each selection is gathered once and kept while the kept ones fit in `budget`
    bytes; a chunk of every document in order takes the contexts as they are."""

    def __init__(self, at_point: dict[int, list], n: int, budget: int) -> None:
        self.at_point, self.n, self.budget = at_point, n, budget
        self.kept: dict[tuple, tuple[torch.Tensor, list]] = {}
        self.kept_bytes = 0

    def rows(self, point: int, first_block: int, rows: torch.Tensor) -> list:
        contexts = self.at_point[point][first_block:]
        if len(rows) == self.n and torch.equal(rows, torch.arange(self.n, device=rows.device)):
            return contexts
        key = (point, first_block, len(rows), int(rows[0]), int(rows[-1]))
        kept = self.kept.get(key)
        if kept is not None and torch.equal(kept[0], rows):
            return kept[1]
        gathered = [context_rows(c, rows) for c in contexts]
        size = sum(t.nbytes for c in gathered if c for t in c if t is not None)
        if self.kept_bytes + size <= self.budget:
            self.kept[key] = (rows, gathered)
            self.kept_bytes += size
        return gathered


def run_patched(
    model,
    site: str,
    first_block: int,
    residual: torch.Tensor,
    values: torch.Tensor,
    docs: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    query: torch.Tensor,
    contexts: Callable[[int, int, torch.Tensor], list] | None,
    output: bool = False,
    chunk: int | None = None,
) -> torch.Tensor:
    """(rows, d_model) the head input at each row's query, row r its document docs[r] with
    `site` patched at positions[r] with values[r] (`output`: the block before `first_block`'s
    output there, which the next block reads exactly: the residual entering it is patched).
    Rows run in buckets by resume point starts[r], from `residual` (the residual of the
    run patched entering `first_block`, (n, L, d_model)) and, past position 0, from that run's
    mixer contexts there (`contexts(start, first_block, docs)`), `chunk` rows at a time."""
    hidden = residual.new_empty(len(docs), residual.shape[-1])
    if values.requires_grad:
        hidden = hidden.to(values.dtype)
    for start in starts.unique().tolist():
        bucket = (starts == start).nonzero()[:, 0]
        size = chunk or max(1, len(bucket))
        for first in range(0, len(bucket), size):
            picked = bucket[first : first + size]
            rows = docs[picked]
            patch_at, at = positions[picked] - start, query[rows] - start
            suffix = residual[rows, start:]
            resumed = contexts(start, first_block, rows) if start and contexts else None
            if output:
                index = (torch.arange(len(picked), device=at.device), patch_at)
                patched = suffix.index_put(index, values[picked].to(suffix.dtype))
                h = hidden_at(model, first_block, patched, at, resumed)
            else:
                with model.intervene(patches={site: (patch_at, values[picked])}):
                    h = hidden_at(model, first_block, suffix, at, resumed)
            hidden[picked] = h.to(hidden.dtype)
    return hidden


def block_output_at(model, ref, values, block_input, mixer_output=None) -> torch.Tensor:
    """(m, d_model): the output of block ref.layer at one position per row when the site after
    its mixer (ref) is patched there with values (m, ...). After its mixer a block acts on each
    position alone, so a one-position run of it from the run patched's input there (block_input
    (m, d_model)), its mixer's output set to that run's (mixer_output (m, d_model), for the
    sites after the MLP's input) and the site's patch on top, gives that output; a patched run
    then restarts at the next block, on that run's block output with this one put in."""
    zero = torch.zeros(len(values), dtype=torch.long, device=values.device)
    patches = {ref.name: (zero, values)}
    if mixer_output is not None:
        patches[f"layers.{ref.layer}.mixer_output"] = (zero, mixer_output)
    with model.intervene(patches=patches):
        return model.forward_from(ref.layer, block_input[:, None], stop=ref.layer + 1)[:, 0]
