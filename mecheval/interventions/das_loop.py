"""DAS one combination at a time, as pyvene runs it: for each (site, position, k) its own R,
trained by one full forward of the model per step (from the embedding, the logits at every
position), the swap applied by a forward hook on the site's module (for a recurrent state,
which no hook reaches, through the model's own `intervene`). It is the oracle of the batched
`das`'s tests and the baseline of its benchmark; use `das` for real work.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from mecheval.interventions.das import (
    COLUMNS,
    Bases,
    DasResult,
    DasSettings,
    _frozen,
    _minibatches,
    basis_key,
)
from mecheval.interventions.das_data import DEFAULT_DIMS, prepare, unswapped
from mecheval.tasks import Batch


def das_loop(
    model,
    batch: Batch,
    corrupted: torch.Tensor,
    sites=None,
    positions=None,
    dims=DEFAULT_DIMS,
    layers=None,
    settings: DasSettings | None = None,
) -> DasResult:
    """Same arguments and result as `das`, each combination trained alone."""
    settings = settings or DasSettings()
    data, combos, target, query, train, held = prepare(
        model, batch, corrupted, sites, positions, dims, layers, settings.holdout
    )
    corrupted = torch.as_tensor(corrupted, device=query.device)
    parts, learned = [], {}
    with _frozen(model):
        for name, mine in combos.items():
            site = data[name]
            for combo in mine:
                full = combo.k == site.width  # the full swap: nothing to learn
                bases = None if full else Bases(site.width, combo.k, [combo.seed(settings.seed)])
                run = _Run(model, site, combo.label, bases, corrupted, query)
                if not full:
                    _train(run, bases, train, target, settings)
                    R = bases.weight.detach()[0].float().cpu().contiguous()
                    learned[basis_key(combo.site.name, combo.label, combo.k)] = R
                with torch.no_grad():
                    logits = run(held)
                parts.append(_rows(site, combo, held, logits, target))
    parts.append(unswapped(model, data, held, target))
    return DasResult(pd.concat(parts, ignore_index=True)[list(COLUMNS)], learned)


def _train(run, bases, train, target, settings: DasSettings) -> None:
    optimizer = torch.optim.Adam(bases.parameters(), lr=settings.lr)
    order = _minibatches(train, settings)
    for _ in range(settings.steps):
        docs = next(order)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(run(docs), target[docs]).backward()
        optimizer.step()


class _Run:
    """One combination's patched forward: the logits at the query of documents `docs`."""

    def __init__(self, model, site, label, bases, corrupted, query) -> None:
        self.model, self.site, self.label, self.bases = model, site, label, bases
        self.corrupted, self.query = corrupted, query

    def _swap(self, corrupted: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        if self.bases is None:  # the full swap
            return clean
        return self.bases.swap(corrupted[None], clean[None])[0]

    def __call__(self, docs: torch.Tensor) -> torch.Tensor:
        model, site = self.model, self.site
        where = site.positions[self.label][docs]
        clean = site.clean[self.label][docs]
        rows = torch.arange(len(docs), device=docs.device)
        if site.ref.short == "state":  # no hook reaches inside a scan
            corrupted = site.corrupted[self.label][docs]
            values = self._swap(corrupted, clean).view(len(docs), *site.shape)
            with model.intervene(patches={site.ref.name: (where, values)}):
                logits = model(self.corrupted[docs])
        else:

            def swap(module, inputs, output):
                patched = output.clone()
                corrupted = output[rows, where].float()
                patched[rows, where] = self._swap(corrupted, clean).to(output)
                return patched

            handle = model.site(site.ref.name).register_forward_hook(swap)
            try:
                logits = model(self.corrupted[docs])
            finally:
                handle.remove()
        return logits[rows, self.query[docs]].float()


def _rows(site, combo, docs, logits, target) -> pd.DataFrame:
    wanted = target[docs]
    p_target = F.softmax(logits, -1).gather(1, wanted[:, None])[:, 0]
    return pd.DataFrame(
        {
            "example": docs.cpu().numpy(),
            "layer": site.ref.layer,
            "site": site.ref.short,
            "position": combo.label,
            "position_index": site.positions[combo.label][docs].cpu().numpy(),
            "k": combo.k,
            "width": site.width,
            "correct": (logits.argmax(-1) == wanted).cpu().numpy(),
            "p_target": p_target.cpu().numpy(),
        }
    )
