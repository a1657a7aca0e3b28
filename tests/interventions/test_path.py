"""Path patching against a plain freeze-and-patch loop (one document, one cell at a time,
forward hooks on the sites, every pass from the embedding), on every route of the zoo's
mixers, a hybrid and the retention example; and what the routes add up to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mecheval.interventions.path import path_patching, routes_of
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


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


def _loop(model, batch, corrupted, layer, label, route, receiver=None):
    """p of the answer after the route's run, one document at a time (the oracle)."""
    sender = f"layers.{layer}.block_input"
    output, mixer = f"layers.{layer}.block_output", f"layers.{layer}.mixer_output"
    mixer_module = model.layers[layer].mixer
    windows = [f"layers.{layer}.{s}" for s in mixer_module.conv_sites
               if f"layers.{layer}.{s}" in model.site_names()]  # fmt: skip
    out = []
    for i in range(len(batch)):
        clean, base = batch.tokens[i : i + 1], corrupted[i : i + 1]
        p = int(batch.positions[label][i] + (1 if label == "value" else 0) * 0)
        q, answer = int(batch.positions["query"][i]), int(batch.answers[i])
        _, c = _hooked(model, clean, capture=[sender])
        sent = c[sender][0, p]
        state = f"layers.{layer}.state"
        has_state = state in model.site_names()
        _, corrupt = _hooked(model, base, capture=[output, mixer, *windows],
                             state=(state, p, None) if has_state else None)  # fmt: skip
        _, patched = _hooked(model, base, replace={sender: _at(p, sent)},
                             capture=[mixer, *windows],
                             state=(state, p, None) if has_state else None)  # fmt: skip
        freeze = {output: _at(p, corrupt[output][0, p])}
        st = None
        if route == "kv":
            replace = {sender: _at(p, sent), **freeze}
        elif route == "state":
            replace, st = freeze, (state, p, patched[state])
        elif route == "residual":
            keep = [t for t in range(base.shape[1]) if t != p]
            replace = {sender: _at(p, sent), mixer: _columns(p, corrupt[mixer], keep)}
        else:
            replace = dict(freeze)
            for site in windows:
                replace[site] = _columns(p, patched[site], list(range(p + 1, base.shape[1])))
        logits, seen = _hooked(model, base, replace=replace, state=st,
                               capture=[receiver] if receiver else [])  # fmt: skip
        if receiver is not None:
            logits, _ = _hooked(model, base, replace={receiver: _at(q, seen[receiver][0, q])})
        out.append(F.softmax(logits[0, q].float(), -1)[answer].item())
    return np.array(out)


ARCHS = [
    "mamba",
    "mamba2",
    "deltanet",
    "gated_deltanet",
    "attention",
    "based",
    "h3",
    "hyena",
    "mamba_noconv",
    "mamba+attention",
    "examples.retention:DeclaredRetention",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_route_equals_the_plain_loop(arch):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    batch = TASK.sample(5, seed=1, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=1)
    table = path_patching(model, batch, corrupted, layer=0, positions=["key"], chunk=3)
    assert set(table.route) == set(routes_of(model, 0))
    for route in routes_of(model, 0):
        ours = table[table.route == route].sort_values("example").p_restored.to_numpy()
        np.testing.assert_allclose(ours, _loop(model, batch, corrupted, 0, "key", route),
                                   atol=2e-5, rtol=1e-4)  # fmt: skip


def test_a_later_receiver_takes_the_routes_value_alone():
    torch.manual_seed(0)
    model = build_model("mamba", TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    batch = TASK.sample(4, seed=2, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=2)
    receiver = "layers.1.block_input"
    table = path_patching(model, batch, corrupted, routes=["conv", "state"], receiver=receiver)
    for route in ("conv", "state"):
        ours = table[table.route == route].p_restored.to_numpy()
        theirs = _loop(model, batch, corrupted, 0, "key", route, receiver=receiver)
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


def test_routes_a_mixer_lacks_and_bad_receivers_are_refused_by_name():
    model = build_model("attention", TASK.vocab_size, 16, max_len=TASK.max_document_length)
    batch = TASK.sample(2, seed=0, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=0)
    with pytest.raises(ValueError, match="CausalSelfAttention has no route 'conv'"):
        path_patching(model, batch, corrupted, routes=["conv"])
    with pytest.raises(ValueError, match="receiver must be a site of a layer after 0"):
        path_patching(model, batch, corrupted, receiver="layers.0.mixer_output")
    with pytest.raises(ValueError, match="layer must be in 0..1"):
        path_patching(model, batch, corrupted, layer=2)
