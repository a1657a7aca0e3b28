"""Edge attribution patching over the path cells: a first-order estimate of each route's path
patch (mecheval.interventions.path), from gradients, to screen before running them exactly.

A route's patch changes its carriers alone: the sender at p (kv, residual), the short convs'
outputs after p (conv) or the state after p (state), by delta = their value with the sender
patched minus the corrupted run's. EAP (Syed et al. 2023) estimates the answer's probability
after the patch as p_corrupted + <delta, d p / d carriers> at the corrupted run, everything
off the route frozen as the path patch freezes it (so no gradient flows around it); EAP-IG
(Hanna et al. 2024) averages the gradient over `steps` points of the carriers between their
corrupted and patched values (integrated gradients). One backward pass per route and step,
batched over documents.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from mecheval.checks import check_int
from mecheval.interventions.engine import hidden_at
from mecheval.interventions.path import PATH_COLUMNS, _check, _convs, _reads
from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.tasks import Batch


@contextlib.contextmanager
def _replacing(model, edits: dict):
    """Forward hooks on sites: name -> function of the site's output giving the new one."""
    handles = [
        model.site(name).register_forward_hook(lambda m, i, out, f=f: f(out))
        for name, f in edits.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _at_rows(at: torch.Tensor, values: torch.Tensor):
    """Output with row r's position at[r] replaced by values[r] (gradients flow to values)."""

    def edit(output):
        mask = torch.zeros(output.shape[:2], dtype=torch.bool, device=output.device)
        mask[torch.arange(len(at)), at] = True
        full = output.detach().clone()
        full[torch.arange(len(at)), at] = values.to(output.dtype)
        return torch.where(mask[..., None], full, output)

    return edit


def _but(mask: torch.Tensor, frozen: torch.Tensor):
    """Output with the positions `mask` (B, L) marks replaced by the constant `frozen`."""
    return lambda output: torch.where(mask[..., None], frozen.to(output.dtype), output)


def _estimate(model, layer, route, at, site, sent, corrupt, patched, residual, query, answers,
              steps) -> torch.Tensor:  # fmt: skip
    """(B,) the route's estimated change of the answer's probability."""
    rows = torch.arange(len(at), device=at.device)
    length = residual.shape[1]
    output = f"layers.{layer}.block_output"
    frozen_at_p = _at_rows(at, corrupt[output][rows, at].detach())
    if route in ("kv", "residual"):
        start, delta = corrupt[site][rows, at], sent - corrupt[site][rows, at]
        carriers = {site: (start, delta)}
    elif route == "state":
        name = f"layers.{layer}.state"
        carriers = {name: (corrupt[name], patched[name] - corrupt[name])}
    else:
        carriers = {}
        after = torch.arange(length, device=at.device) > at[:, None]
        for name in _convs(model, layer):
            delta = (patched[name] - corrupt[name]) * after[..., None]
            carriers[name] = (corrupt[name], delta)
    total = torch.zeros(len(at), device=at.device)
    for step in range(steps):
        alpha = 0.0 if steps == 1 else (step + 0.5) / steps
        leaves = {n: (s + alpha * d).detach().requires_grad_() for n, (s, d) in carriers.items()}
        edits, patches = {}, {}
        for name, leaf in leaves.items():
            if name.endswith(".state"):
                patches[name] = (at, leaf)
            elif route in ("kv", "residual"):
                edits[name] = _at_rows(at, leaf)
            else:
                edits[name] = lambda out, leaf=leaf: leaf.to(out.dtype) + 0 * out
        if route == "residual":
            mixer = f"layers.{layer}.mixer_output"
            others = torch.ones(len(at), length, dtype=torch.bool, device=at.device)
            others[rows, at] = False
            edits[mixer] = _but(others, corrupt[mixer].detach())
        else:
            edits[output] = frozen_at_p
        with torch.enable_grad(), _replacing(model, edits), model.intervene(patches=patches):
            logits = model.forward_from(layer, residual, at=query)
            F.softmax(logits.float(), -1)[rows, answers].sum().backward()
        total += sum((leaves[n].grad * carriers[n][1]).flatten(1).sum(1) for n in leaves)
    return total / steps


def edge_attribution(
    model,
    batch: Batch,
    corrupted: torch.Tensor,
    *,
    layer: int = 0,
    sender: str = "block_input",
    positions=("key",),
    routes=None,
    steps: int = 1,
) -> pd.DataFrame:
    """EAP (steps 1) or EAP-IG (steps > 1) estimates of `path_patching`'s cells, the answer's
    logits the receiver; the same rows and columns (p_restored estimated; logit_restored,
    kl and p_sender NaN)."""
    routes, _ = _check(model, layer, sender, routes, None)
    check_int("steps", steps, 1)
    device = next(model.parameters()).device
    batch = batch.to(device)
    corrupted = torch.as_tensor(corrupted, device=device)
    query, answers = batch.positions["query"], batch.answers
    site = f"layers.{layer}.{sender}"
    was_training = model.training
    model.eval()
    frames = []
    try:
        with torch.no_grad(), model.intervene(reads={site: None}) as record:
            clean = model(batch.tokens, at=query)
        clean_values = record[site]
        entering = f"layers.{layer}.block_input"
        reads = {entering: None, site: None, **_reads(model, layer, routes)}
        for label in expand_positions(positions, batch.width, batch.roles):
            at = resolve_position(label, batch)
            rows = torch.arange(len(batch), device=device)
            state = {f"layers.{layer}.state": at} if "state" in routes else {}
            with torch.no_grad(), model.intervene(reads={**reads, **state}) as corrupt:
                logits = model(corrupted, at=query)
            residual = corrupt[entering]
            sent = clean_values[rows, at]
            with (
                torch.no_grad(),
                model.intervene(
                    reads={**_reads(model, layer, routes), **state}, patches={site: (at, sent)}
                ) as patched,
            ):
                hidden_at(model, layer, residual, query)
            p_corrupted = F.softmax(logits.float(), -1)[rows, answers]
            p_original = F.softmax(clean.float(), -1)[rows, answers]
            for route in routes:
                change = _estimate(model, layer, route, at, site, sent, corrupt, patched,
                                   residual, query, answers, steps)  # fmt: skip
                frames.append(_rows(layer, sender, label, at, route, p_original, p_corrupted,
                                    p_corrupted + change))  # fmt: skip
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return pd.concat(frames, ignore_index=True)[list(PATH_COLUMNS)]


def _rows(layer, sender, label, at, route, p_original, p_corrupted, p_restored) -> pd.DataFrame:
    cpu = lambda t: t.detach().cpu().numpy()  # noqa: E731
    return pd.DataFrame(
        {
            "example": np.arange(len(at)),
            "layer": layer,
            "site": sender,
            "position": label,
            "position_index": cpu(at),
            "route": route,
            "receiver": "logits",
            "p_original": cpu(p_original),
            "p_corrupted": cpu(p_corrupted),
            "p_restored": cpu(p_restored),
            "logit_restored": np.nan,
            "kl": np.nan,
            "p_sender": np.nan,
        }
    )
