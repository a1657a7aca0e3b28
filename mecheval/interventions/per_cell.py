"""The plain per-cell patching loop, as pyvene and the study run interchange interventions:
one full forward pass per (layer, site, position) cell, the patch applied by a forward hook on
the site's module. It is the oracle of the batched engine's tests and the baseline of its
benchmark; use `interchange_grid` for real work.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from mecheval.interventions.grid import COLUMNS, select_sites
from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.tasks import Batch


def _answer_distribution(model, tokens, query):
    logits = model(tokens)
    return logits[torch.arange(tokens.shape[0], device=tokens.device), query].float()


def _capture(model, module, tokens) -> torch.Tensor:
    """The (B, L, C) activation a site's module outputs on `tokens`, through a forward hook."""
    captured = []
    handle = module.register_forward_hook(lambda m, i, out: captured.append(out))
    try:
        model(tokens)
    finally:
        handle.remove()
    return captured[0]


@torch.no_grad()
def per_cell_loop(
    model, batch: Batch, corrupted: torch.Tensor, layers=None, sites=None, positions=None
) -> pd.DataFrame:
    """Same arguments and result as `interchange_grid`, computed one cell at a time."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    base = torch.as_tensor(corrupted, device=device)
    model.eval()
    n, length = batch.tokens.shape
    rows = torch.arange(n, device=device)
    query, answers = batch.positions["query"], batch.answers
    labels = expand_positions(positions, length, batch.roles)

    clean = _answer_distribution(model, batch.tokens, query)
    log_p_original = F.log_softmax(clean, -1)
    p_original = log_p_original.gather(1, answers[:, None])[:, 0].exp()
    corrupt = _answer_distribution(model, base, query)
    p_corrupted = F.softmax(corrupt, -1).gather(1, answers[:, None])[:, 0]

    records = []
    for ref in select_sites(model, layers, sites):
        module = model.site(ref.name)
        if ref.short != "state":
            source = _capture(model, module, batch.tokens)
        for label in labels:
            where = resolve_position(label, batch)
            if ref.short == "state":
                # No hook reaches inside a scan: read and patch it through the model's own API,
                # still one full forward (from the embedding) per cell.
                with model.intervene(reads={ref.name: where}) as record:
                    model(batch.tokens)
                with model.intervene(patches={ref.name: (where, record[ref.name])}):
                    logits = _answer_distribution(model, base, query)
            else:
                values = source[rows, where]

                def patch(m, i, out, where=where, values=values):
                    out = out.clone()
                    out[rows, where] = values
                    return out

                handle = module.register_forward_hook(patch)
                logits = _answer_distribution(model, base, query)
                handle.remove()
            log_p = F.log_softmax(logits, -1)
            p_restored = log_p.gather(1, answers[:, None])[:, 0].exp()
            kl = (log_p_original.exp() * (log_p_original - log_p)).sum(-1)
            for i in range(n):
                records.append(
                    (
                        i,
                        ref.layer,
                        ref.short,
                        label,
                        int(where[i]),
                        float(p_original[i]),
                        float(p_corrupted[i]),
                        float(p_restored[i]),
                        float(logits[i, answers[i]]),
                        float(kl[i]),
                    )
                )
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))
