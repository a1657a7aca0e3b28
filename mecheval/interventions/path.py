"""Path patching: a sender's effect on the answer along one route, everything off the route
frozen at its value in the corrupted run (Wang et al. 2022; Goldowsky-Dill et al. 2023), inside
a mixer's short conv and through its recurrent state too (docs/interventions.md).

The sender is the input of layer m's block (or of its mixer) at one position p of each
document, set to its value in the clean document. The routes out of position p through layer m:

    conv      the mixer's short convolutions (its `conv_sites`) at the positions after p:
              their outputs take the values they take with the sender patched (those within
              the convolution's width of p change), everything else in layer m keeps the
              corrupted run's values
    state     the mixer's recurrent state after p: it takes the value it takes with the sender
              patched, the rest of the scan (and the convolutions after p) the corrupted run's
    kv        every read of position p by the mixer at later positions, and nothing at p
              itself (for attention: p's keys and values)
    residual  the residual stream at position p alone: the mixer's outputs at the positions
              after p keep the corrupted run's values

For every route but residual, layer m's block output at p keeps the corrupted run's value, so
the effect leaves p only along the route. The receiver is the answer's logits, or a site of a
later layer at the query: then its value under the route is patched, alone, into the
corrupted run (two passes). Each cell is one patched run per document, batched over documents,
each run from layer m on; the tests compare it with a loop of plain hooked forward passes, one
document and one cell at a time.
"""

from __future__ import annotations

import pandas as pd
import torch

from mecheval.checks import check_int
from mecheval.interventions.engine import Metrics, hidden_at
from mecheval.interventions.grid import COLUMNS
from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.tasks import Batch

ROUTES = ("conv", "state", "kv", "residual")
SENDERS = ("block_input", "mixer_input")
PATH_COLUMNS = (*COLUMNS[:5], "route", "receiver", *COLUMNS[5:], "p_sender")


def routes_of(model, layer: int) -> tuple[str, ...]:
    """The routes layer `layer`'s mixer has: conv where it declares short-conv sites, state
    where it has a state site; kv and residual always."""
    names = set(model.site_names())
    found = []
    if _convs(model, layer):
        found.append("conv")
    if f"layers.{layer}.state" in names:
        found.append("state")
    return (*found, "kv", "residual")


def _check(model, layer: int, sender: str, routes, receiver) -> tuple[tuple[str, ...], str | None]:
    n_layers = len(model.layers)
    check_int("layer", layer, 0, n_layers - 1)
    if sender not in SENDERS:
        raise ValueError(f"sender must be one of {SENDERS}, got {sender!r}")
    have = routes_of(model, layer)
    routes = have if routes is None else tuple([routes] if isinstance(routes, str) else routes)
    missing = [r for r in routes if r not in have]
    if missing:
        raise ValueError(
            f"layer {layer}'s {type(model.layers[layer].mixer).__name__} has no route "
            f"{', '.join(map(repr, missing))} (its routes: {', '.join(have)})"
        )
    if receiver is not None:
        receiver_layer = int(receiver.split(".")[1]) if receiver.startswith("layers.") else -1
        if receiver not in model.site_names() or receiver_layer <= layer:
            raise ValueError(
                f"receiver must be a site of a layer after {layer} (or None: the logits), "
                f"got {receiver!r}"
            )
    return routes, receiver


def _convs(model, layer: int) -> list[str]:
    """The full names of layer `layer`'s short-conv output sites (its mixer's `conv_sites`)."""
    names = set(model.site_names())
    sites = (f"layers.{layer}.{site}" for site in model.layers[layer].mixer.conv_sites)
    return [name for name in sites if name in names]


def route_patches(model, layer, route, at, sender, sent, corrupt, patched) -> dict:
    """The patches of a route's run from the corrupted run at layer `layer` (see the module
    docstring): `at` (B,) the sender's positions, `sent` (B, C) its clean values, `corrupt`
    and `patched` the corrupted run's and the sender-patched run's reads (full tensors, and
    the state after `at`)."""
    rows = torch.arange(len(at), device=at.device)
    output = f"layers.{layer}.block_output"
    freeze = {output: (at, corrupt[output][rows, at])}
    if route == "kv":
        return {sender: (at, sent), **freeze}
    if route == "state":
        return {f"layers.{layer}.state": (at, patched[f"layers.{layer}.state"]), **freeze}
    if route == "residual":
        mixer = f"layers.{layer}.mixer_output"
        values = corrupt[mixer].clone()
        values[rows, at] = patched[mixer][rows, at]
        return {sender: (at, sent), mixer: (None, values)}
    patches = dict(freeze)
    for site in _convs(model, layer):
        after = torch.arange(corrupt[site].shape[1], device=at.device) > at[:, None]
        patches[site] = (None, torch.where(after[..., None], patched[site], corrupt[site]))
    return patches


def _reads(model, layer: int, routes) -> dict[str, None]:
    reads = {f"layers.{layer}.block_output": None}
    if "residual" in routes:
        reads[f"layers.{layer}.mixer_output"] = None
    if "conv" in routes:
        reads.update(dict.fromkeys(_convs(model, layer)))
    return reads


@torch.no_grad()
def path_patching(
    model,
    batch: Batch,
    corrupted: torch.Tensor,
    *,
    layer: int = 0,
    sender: str = "block_input",
    positions=("key",),
    routes=None,
    receiver: str | None = None,
    chunk: int = 256,
) -> pd.DataFrame:
    """The effect of each route out of each sender position (see the module docstring).

    Args:
        model, batch, corrupted: as `interchange_grid` takes them (clean documents, their
            corrupted copies).
        layer: the layer m whose block input (or mixer input: `sender`) sends.
        positions: the sender's position specs (mecheval.interventions.positions).
        routes: some of `routes_of(model, layer)` (None: all of them).
        receiver: None (the answer's logits) or a site of a later layer, read at the query.
        chunk: documents per batched run.

    Returns:
        a row per (document, position, route): the grid's cell and metric columns (the cell
        is the sender: layer m, its site), `route`, `receiver`, and `p_sender`, the answer's
        probability with the sender patched along every route.
    """
    routes, receiver = _check(model, layer, sender, routes, receiver)
    device = next(model.parameters()).device
    batch = batch.to(device)
    corrupted = torch.as_tensor(corrupted, device=device)
    was_training = model.training
    model.eval()
    try:
        frames = [
            _chunk(
                model,
                batch[first : first + chunk],
                corrupted[first : first + chunk],
                first,
                layer,
                sender,
                positions,
                routes,
                receiver,
            )  # fmt: skip
            for first in range(0, len(batch), chunk)
        ]
    finally:
        model.train(was_training)
    return pd.concat(frames, ignore_index=True)[list(PATH_COLUMNS)]


def _chunk(model, batch, corrupted, first, layer, sender, positions, routes, receiver):
    query, answers = batch.positions["query"], batch.answers
    site = f"layers.{layer}.{sender}"
    with model.intervene(reads={site: None}) as record:
        clean = hidden_at(model, 0, model.embed(batch.tokens), query)
    clean_values = record[site]
    metrics = Metrics.of(model, clean)
    p_original = metrics(clean, answers, None)[0]
    entering = f"layers.{layer}.block_input"
    reads = {entering: None, **_reads(model, layer, routes)}
    if receiver is not None:
        reads[receiver] = query
    with model.intervene(reads=reads) as corrupt:
        hidden = hidden_at(model, 0, model.embed(corrupted), query)
    residual = corrupt[entering]
    p_corrupted = metrics(hidden, answers, None)[0]

    def run(patches: dict) -> tuple[torch.Tensor, ...]:
        wanted = {receiver: query} if receiver is not None else {}
        with model.intervene(reads=wanted, patches=patches) as seen:
            hidden = hidden_at(model, layer, residual, query)
        if receiver is not None:  # the receiver alone, under the route's value
            with model.intervene(patches={receiver: (query, seen[receiver])}):
                hidden = hidden_at(model, layer, residual, query)
        return metrics(hidden, answers, None)

    frames = []
    for label in expand_positions(positions, batch.width, batch.roles):
        at = resolve_position(label, batch)
        rows = torch.arange(len(batch), device=at.device)
        sent = clean_values[rows, at]
        state = {f"layers.{layer}.state": at} if "state" in routes else {}
        with model.intervene(reads={**_reads(model, layer, routes), **state},
                             patches={site: (at, sent)}) as patched:  # fmt: skip
            hidden_at(model, layer, residual, query)
        p_sender = run({site: (at, sent)})[0]
        for route in routes:
            patches = route_patches(model, layer, route, at, site, sent, corrupt, patched)
            p, logit, kl = run(patches)
            frames.append(
                pd.DataFrame(
                    {
                        "example": first + rows.cpu().numpy(),
                        "layer": layer,
                        "site": sender,
                        "position": label,
                        "position_index": at.cpu().numpy(),
                        "route": route,
                        "receiver": receiver or "logits",
                        "p_original": p_original.cpu().numpy(),
                        "p_corrupted": p_corrupted.cpu().numpy(),
                        "p_restored": p.cpu().numpy(),
                        "logit_restored": logit.cpu().numpy(),
                        "kl": kl.cpu().numpy(),
                        "p_sender": p_sender.cpu().numpy(),
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)
