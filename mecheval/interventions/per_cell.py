"""The plain per-cell patching loop, as pyvene and the study run interchange interventions:
one full forward pass per (layer, site, position) cell, the patch applied by a forward hook on
the site's module. It is the oracle of the batched engine's tests and the baseline of its
benchmark; use `interchange_grid` for real work.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from mecheval.interventions.grid import COLUMNS, select_sites
from mecheval.interventions.path import routes_of
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
    corrupted = torch.as_tensor(corrupted, device=device)
    model.eval()
    n, length = batch.tokens.shape
    rows = torch.arange(n, device=device)
    query, answers = batch.positions["query"], batch.answers
    labels = expand_positions(positions, length, batch.roles)

    clean = _answer_distribution(model, batch.tokens, query)
    log_p_original = F.log_softmax(clean, -1)
    p_original = log_p_original.gather(1, answers[:, None])[:, 0].exp()
    corrupt = _answer_distribution(model, corrupted, query)
    p_corrupted = F.softmax(corrupt, -1).gather(1, answers[:, None])[:, 0]

    records = []
    for ref in select_sites(model, layers, sites):
        module = model.site(ref.name)
        if ref.short != "state":
            clean_values = _capture(model, module, batch.tokens)
        for label in labels:
            where = resolve_position(label, batch)
            if ref.short == "state":
                # No hook reaches inside a scan: read and patch it through the model's own API,
                # still one full forward (from the embedding) per cell.
                with model.intervene(reads={ref.name: where}) as record:
                    model(batch.tokens)
                with model.intervene(patches={ref.name: (where, record[ref.name])}):
                    logits = _answer_distribution(model, corrupted, query)
            else:
                values = clean_values[rows, where]

                def patch(m, i, out, where=where, values=values):
                    out = out.clone()
                    out[rows, where] = values
                    return out

                handle = module.register_forward_hook(patch)
                logits = _answer_distribution(model, corrupted, query)
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


# ---- path patching, one document and one cell at a time ----------------------------------


@torch.no_grad()
def path_patching_loop(
    model, batch: Batch, corrupted: torch.Tensor, layer: int = 0, positions=("key",),
    routes=None, receiver: str | None = None,
) -> pd.DataFrame:  # fmt: skip
    """`path_patching`'s p_restored, one document, position and route at a time, every pass a
    plain forward from the embedding with forward hooks on the sites (the state through
    `model.intervene`): the oracle of its tests and the baseline of its benchmark."""
    model.eval()
    routes = routes_of(model, layer) if routes is None else routes
    frames = []
    for label in expand_positions(list(positions), batch.width, batch.roles):
        for route in routes:
            p = _route_loop(model, batch, corrupted, layer, label, route, receiver)
            frames.append(
                pd.DataFrame(
                    {
                        "example": range(len(batch)),
                        "layer": layer,
                        "position": label,
                        "route": route,
                        "p_restored": p,
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)


def _hooked(model, tokens, replace=None, capture=(), state=None):
    """One plain forward pass of `tokens` (1, L): `replace` site -> function of its (1, L, C)
    output giving the new one; returns the logits at every position, the captured outputs,
    and the state after position `state[1]` of site state[0] (patched with state[2] if given)."""
    replace, seen, handles = replace or {}, {}, []
    for name in {*replace, *capture}:

        def hook(module, inputs, output, name=name):
            output = replace[name](output) if name in replace else output
            seen[name] = output
            return output

        handles.append(model.site(name).register_forward_hook(hook))
    try:
        if state is None:
            logits = model(tokens)
        else:
            name, at, values = state
            patches = {name: (torch.tensor([at]), values)} if values is not None else {}
            with model.intervene(reads={name: torch.tensor([at])}, patches=patches) as record:
                logits = model(tokens)
            seen[name] = record[name]
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


def _at(p, value):
    def put(output):
        output = output.clone()
        output[0, p] = value
        return output

    return put


def _columns(p, values, positions):
    def put(output):
        output = output.clone()
        output[0, positions] = values[0, positions]
        return output

    return put


def _route_loop(model, batch, corrupted, layer, label, route, receiver=None):
    """p of the answer after the route's run, one document at a time."""
    sender = f"layers.{layer}.block_input"
    output, mixer = f"layers.{layer}.block_output", f"layers.{layer}.mixer_output"
    mixer_module = model.layers[layer].mixer
    windows = [f"layers.{layer}.{s}" for s in mixer_module.conv_sites
               if f"layers.{layer}.{s}" in model.site_names()]  # fmt: skip
    out, length = [], corrupted.shape[1]
    for i in range(len(batch)):
        clean, corrupted_doc = batch.tokens[i : i + 1], corrupted[i : i + 1]
        p = int(resolve_position(label, batch)[i])
        q, answer = int(batch.positions["query"][i]), int(batch.answers[i])
        _, c = _hooked(model, clean, capture=[sender])
        sent = c[sender][0, p]
        state = f"layers.{layer}.state"
        has_state = state in model.site_names()
        _, corrupt = _hooked(model, corrupted_doc, capture=[output, mixer, *windows],
                             state=(state, p, None) if has_state else None)  # fmt: skip
        _, patched = _hooked(model, corrupted_doc, replace={sender: _at(p, sent)},
                             capture=[mixer, *windows],
                             state=(state, p, None) if has_state else None)  # fmt: skip
        freeze = {output: _at(p, corrupt[output][0, p])}
        st = None
        if route == "kv":
            replace = {sender: _at(p, sent), **freeze}
        elif route == "state":
            replace, st = freeze, (state, p, patched[state])
        elif route == "residual":
            keep = [t for t in range(length) if t != p]
            replace = {sender: _at(p, sent), mixer: _columns(p, corrupt[mixer], keep)}
        else:
            replace = dict(freeze)
            for site in windows:
                replace[site] = _columns(p, patched[site], list(range(p + 1, length)))
        logits, seen = _hooked(model, corrupted_doc, replace=replace, state=st,
                               capture=[receiver] if receiver else [])  # fmt: skip
        if receiver is not None:
            logits, _ = _hooked(
                model, corrupted_doc, replace={receiver: _at(q, seen[receiver][0, q])}
            )
        out.append(F.softmax(logits[0, q].float(), -1)[answer].item())
    return np.array(out)
