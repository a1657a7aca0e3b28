"""Attribution patching: a first-order estimate of every interchange cell from one forward and
one backward pass, to screen large grids before running the exact ones.

For a cell (layer, site, position) the effect of patching the clean activation a_clean into
the corrupted run is estimated as (a_clean - a_corrupted) . d p_answer / d a_corrupted, the
gradient taken in the corrupted run. `screening_correlation` reports how well the estimates
rank cells the way exact patching does (Spearman's rank correlation of their Attrib scores).
Recurrent `state` sites are not screened (their activation is not a single tensor of the
forward pass).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from mecheval.interventions.grid import COLUMNS, select_sites
from mecheval.interventions.metric import attrib
from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.tasks import Batch


def attribution_patching(
    model, batch: Batch, corrupted: torch.Tensor, layers=None, sites=None, positions=None
) -> pd.DataFrame:
    """Estimated p_restored of every cell; same columns as `interchange_grid` (logit_restored
    and kl are NaN: only the answer probability is estimated)."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    corrupted = torch.as_tensor(corrupted, device=device)
    was_training = model.training
    model.eval()
    refs = [r for r in select_sites(model, layers, sites) if r.short != "state"]
    names = {r.name: None for r in refs}
    query, answers = batch.positions["query"], batch.answers
    rows = torch.arange(len(batch), device=device)

    with torch.no_grad(), model.intervene(reads=names) as record:
        clean = model(batch.tokens, at=query)
    clean_acts = dict(record)
    with torch.enable_grad(), model.intervene(reads=names) as record:
        logits = model(corrupted, at=query)
        for tensor in record.values():
            tensor.retain_grad()
        p_answer = F.softmax(logits.float(), -1)[rows, answers]
        p_answer.sum().backward()  # rows are independent: each row's gradient is its own
    corrupted_acts = dict(record)
    model.zero_grad(set_to_none=True)
    if was_training:
        model.train()

    p_original = F.softmax(clean.float(), -1)[rows, answers].detach()
    p_corrupted = p_answer.detach()
    labels = expand_positions(positions, batch.width, batch.roles)
    frames = []
    for ref in refs:
        act = corrupted_acts[ref.name]
        effect = ((clean_acts[ref.name] - act.detach()) * act.grad).sum(-1)  # (n, L)
        for label in labels:
            where = resolve_position(label, batch)
            frames.append(
                pd.DataFrame(
                    {
                        "example": np.arange(len(batch)),
                        "layer": ref.layer,
                        "site": ref.short,
                        "position": label,
                        "position_index": where.cpu().numpy(),
                        "p_original": p_original.cpu().numpy(),
                        "p_corrupted": p_corrupted.cpu().numpy(),
                        "p_restored": (p_corrupted + effect[rows, where]).detach().cpu().numpy(),
                        "logit_restored": np.nan,
                        "kl": np.nan,
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)[list(COLUMNS)]


def screening_correlation(exact: pd.DataFrame, estimate: pd.DataFrame) -> float:
    """Spearman rank correlation between the exact and the estimated Attrib of the cells both
    tables hold (NaN if the model's corruption has no effect)."""
    a, b = attrib(exact), attrib(estimate)
    keys = ["layer", "site", "position"]
    merged = a[[*keys, "attrib"]].merge(
        b[[*keys, "attrib"]], on=keys, suffixes=("_exact", "_estimate")
    )
    if len(merged) < 2:
        return float("nan")
    return float(merged["attrib_exact"].rank().corr(merged["attrib_estimate"].rank()))
