"""Named sites: every site of every architecture can be read and patched, with the semantics
`model.intervene` documents; state patches equal an independent recurrence (the published
equations, patched in the loop, in tests/layers/references.py)."""

from __future__ import annotations

import pytest
import torch

from mecheval.layers import Site, StateSite
from mecheval.models import ARCHITECTURES, build_model
from tests.layers.references import (
    delta_net_reference,
    gated_delta_net_reference,
    mamba2_reference,
    mamba_reference,
)

V, D, L = 40, 16, 8
POSITIONS = torch.tensor([2, 5, 7])  # one per row, rows differ; 7 is the last position
B = len(POSITIONS)
# Several per row (repeats allowed); more than the delta rule's few-positions path takes.
MANY_POSITIONS = torch.tensor([[2, 0, 7, 7, 3, 1], [5, 5, 1, 0, 6, 4], [7, 3, 6, 2, 2, 0]])
# Before the patched position the outputs must not move; the delta rule's chunked path solves
# a chunk's positions together, so there "not move" holds up to float32 rounding.
ATOL_UNCHANGED = 1e-5


def make(arch, **options):
    """A model whose mixers all pass a change on: at the study's initialisation (Linear weights
    N(0, 0.02)) Hyena's mixer output is ~1e-8, too small to see a patch through, so Linear
    weights are redrawn at the usual 1 / sqrt(fan_in) scale."""
    torch.manual_seed(0)
    model = build_model(arch, V, D, max_len=L, **options)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
    return model


def tokens_for(seed=1):
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


def rows():
    return torch.arange(B)


EXPECTED_SITES = {
    "attention": [],
    "base_conv": ["conv_input", "conv_output", "long_conv_input", "long_conv_output"],
    "base_conv_long": ["long_conv_input", "long_conv_output"],
    "based": ["conv_input", "conv_output"],
    "based_long": ["long_conv_input", "long_conv_output"],
    "h3": ["conv_input", "conv_output", "long_conv_input", "long_conv_output"],
    "hyena": ["conv_input", "conv_output", "long_conv_input", "long_conv_output"],
    "mamba": ["conv_input", "conv_output", "state"],
    "mamba_noconv": ["state"],
    "mamba2": ["conv_input", "conv_output", "state"],
    "mamba2_noconv": ["state"],
    "deltanet": [f"{n}_conv_{e}" for n in "qkv" for e in ("input", "output")] + ["state"],
    "deltanet_noconv": ["state"],
    "gated_deltanet": [f"{n}_conv_{e}" for n in "qkv" for e in ("input", "output")] + ["state"],
    "gated_deltanet_noconv": ["state"],
    "kda": [f"{n}_conv_{e}" for n in "qkv" for e in ("input", "output")] + ["state"],
    "gated_deltaproduct": [f"{n}_conv_{e}" for n in "qkv" for e in ("input", "output")] + ["state"],
    "comba": [f"{n}_conv_{e}" for n in "qkv" for e in ("input", "output")] + ["state"],
    "rwkv7": ["shift_input", "r", "w", "k", "v", "a", "g", "state"],
    "mamba3": ["in_proj_output", "x", "B", "C", "z", "state"],
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_site_names(arch):
    names = make(arch).site_names()
    block = ["block_input", "mixer_input", "mixer_output", "block_output"]
    if not arch.startswith("mamba"):
        block += ["mlp_input", "mlp_output"]
    short = {n.split(".", 2)[2] for n in names}
    assert short == set(block) | set(EXPECTED_SITES[arch])
    assert len(names) == len(set(names))
    if arch in ("mamba", "base_conv", "based"):
        assert {"layers.0.conv_input", "layers.0.conv_output"} <= set(names)
    if arch in ("base_conv",):
        assert "layers.1.long_conv_output" in names and "layers.1.conv_output" not in names
    if arch == "based":
        assert "layers.1.conv_input" not in names  # layer 1 is Based linear attention


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reads_at_positions_and_in_full(arch):
    model = make(arch)
    tokens = tokens_for()
    names = model.site_names()
    with torch.no_grad():
        clean = model(tokens)
        with model.intervene(reads={n: None for n in names}) as full:
            logits_full = model(tokens)
        with model.intervene(reads={n: POSITIONS for n in names}) as at:
            logits_at = model(tokens)
        with model.intervene(reads={n: MANY_POSITIONS for n in names}) as many:
            logits_many = model(tokens)
    # Reading changes nothing (state reads split the scan: equal up to rounding).
    torch.testing.assert_close(logits_full, clean)
    torch.testing.assert_close(logits_at, clean)
    torch.testing.assert_close(logits_many, clean)
    for name in names:
        assert full[name].shape[:2] == (B, L), name
        assert at[name].shape == (B, *full[name].shape[2:]), name
        torch.testing.assert_close(at[name], full[name][rows(), POSITIONS], msg=name)
        expected = full[name][rows()[:, None], MANY_POSITIONS]
        torch.testing.assert_close(many[name], expected, msg=name)
        if name.endswith("state"):
            assert at[name].dtype == torch.float32
    d_inner = 2 * D
    if arch in ("mamba", "mamba_noconv"):
        assert at["layers.0.state"].shape == (B, d_inner, 16)
    if arch.startswith("mamba2"):  # (heads, head dim, state size)
        assert at["layers.0.state"].shape == (B, d_inner // 16, 16, 64)
    if arch.startswith(("deltanet", "gated_deltanet", "kda", "gated_deltaproduct", "comba")):
        assert at["layers.1.state"].shape == (B, 1, D, D)
    assert full["layers.0.block_input"].shape == (B, L, D)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_patching_a_site_with_its_own_value_changes_nothing(arch):
    model = make(arch)
    tokens = tokens_for()
    names = model.site_names()
    with torch.no_grad():
        clean = model(tokens)
        with model.intervene(reads={n: POSITIONS for n in names}) as own:
            model(tokens)
        for name in names:
            with model.intervene(patches={name: (POSITIONS, own[name])}):
                torch.testing.assert_close(model(tokens), clean, msg=name)
        # All at once.
        with model.intervene(patches={n: (POSITIONS, own[n]) for n in names}):
            torch.testing.assert_close(model(tokens), clean)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_patching_changes_outputs_only_from_the_patched_position(arch):
    """A different value at (row, p) leaves outputs before p as they were and changes later
    ones; a state patch at p takes effect from p + 1 (the output at p read the old state)."""
    model = make(arch)
    tokens = tokens_for()
    names = model.site_names()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        clean = model(tokens)
        with model.intervene(reads={n: POSITIONS for n in names}) as own:
            model(tokens)
        for name in names:
            # Large, so that even the nearly inert mixers at initialisation pass it on.
            scale = 10 * (own[name].abs().mean() + 1)
            values = own[name] + torch.randn(own[name].shape, generator=g) * scale
            with model.intervene(patches={name: (POSITIONS, values)}):
                out = model(tokens)
            first = POSITIONS + 1 if name.endswith("state") else POSITIONS
            for b, p in enumerate(first.tolist()):
                torch.testing.assert_close(
                    out[b, :p], clean[b, :p], atol=ATOL_UNCHANGED, rtol=0, msg=name
                )
                if p < L:
                    assert (out[b, p:] - clean[b, p:]).abs().max() > 1e-4, (name, b)


@pytest.mark.parametrize(
    "arch",
    [
        "mamba",
        "mamba_noconv",
        "mamba2",
        "mamba2_noconv",
        "deltanet",
        "deltanet_noconv",
        "gated_deltanet",
        "gated_deltanet_noconv",
    ],
)
@pytest.mark.parametrize("layer", [0, 1])
def test_state_patch_equals_an_independent_patched_recurrence(arch, layer):
    """Model with `layers.{layer}.state` patched (scan split by the site) vs the same model
    where that layer's mixer is replaced by the test's own loop over the published equations,
    which replaces the state after position p and carries on."""
    model = make(arch)
    tokens = tokens_for()
    block = model.layers[layer]
    mixer = block.mixer
    params = mixer.state_dict()
    state_shape = {"mamba": (2 * D, 16), "mamba2": (2, 16, 64)}.get(arch.split("_")[0], (1, D, D))
    values = torch.randn(B, *state_shape, generator=torch.Generator().manual_seed(4)) * 0.5
    name = f"layers.{layer}.state"
    with torch.no_grad():
        with model.intervene(
            reads={f"layers.{layer}.block_input": None, name: POSITIONS},
            patches={name: (POSITIONS, values)},
        ) as record:
            out = model(tokens)
        # Independent computation of the same patched model.
        residual = record[f"layers.{layer}.block_input"]
        if arch.startswith("mamba2"):
            mixed, states = mamba2_reference(
                params,
                block.norm(residual),
                headdim=16,
                patch=(POSITIONS, values),
                use_conv=arch == "mamba2",
            )
        elif arch.startswith("mamba"):
            mixed, states = mamba_reference(
                params, block.norm(residual), patch=(POSITIONS, values), use_conv=arch == "mamba"
            )
        else:
            reference = (
                gated_delta_net_reference if arch.startswith("gated") else delta_net_reference
            )
            mixed, states = reference(
                params,
                block.norm1(residual),
                num_heads=1,
                patch=(POSITIONS, values),
                use_short_conv=not arch.endswith("noconv"),
            )
        stream = residual + mixed.float()
        if not arch.startswith("mamba"):
            stream = stream + block.mlp(block.norm2(stream))
        expected = model.forward_from(layer + 1, stream)
        # Without the patch the reference differs: the patch does something.
        unpatched = model(tokens)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert (unpatched - out).abs().max() > 1e-3
    # Reads come after patches: the read state is the patched one.
    torch.testing.assert_close(record[name], values)
    torch.testing.assert_close(record[name].double(), states[rows(), POSITIONS])


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "deltanet", "gated_deltanet"])
def test_state_reads_match_the_recurrence(arch):
    model = make(arch)
    tokens = tokens_for()
    block = model.layers[0]
    with torch.no_grad():
        with model.intervene(
            reads={"layers.0.block_input": None, "layers.0.state": POSITIONS}
        ) as record:
            model(tokens)
        with model.intervene(reads={"layers.0.state": None}) as full:
            model(tokens)
        residual = record["layers.0.block_input"]
        if arch == "mamba":
            _, states = mamba_reference(block.mixer.state_dict(), block.norm(residual))
        elif arch == "mamba2":
            _, states = mamba2_reference(block.mixer.state_dict(), block.norm(residual), 16)
        else:
            reference = (
                gated_delta_net_reference if arch.startswith("gated") else delta_net_reference
            )
            _, states = reference(block.mixer.state_dict(), block.norm1(residual), num_heads=1)
    torch.testing.assert_close(
        record["layers.0.state"].double(), states[rows(), POSITIONS], atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(full["layers.0.state"].double(), states, atol=1e-5, rtol=1e-4)


def test_reads_come_after_patches_and_gradients_flow():
    model = make("hyena")
    tokens = tokens_for()
    name = "layers.0.conv_output"
    values = torch.randn(B, 3 * D, requires_grad=True)
    with model.intervene(reads={name: POSITIONS}, patches={name: (POSITIONS, values)}) as record:
        logits = model(tokens)
    torch.testing.assert_close(record[name], values)
    logits.sum().backward()
    assert values.grad is not None and values.grad.abs().sum() > 0
    # Full-tensor patches replace the whole activation.
    with torch.no_grad(), model.intervene(reads={name: None}) as own:
        clean = model(tokens)
    with torch.no_grad(), model.intervene(patches={name: (None, own[name])}):
        torch.testing.assert_close(model(tokens), clean)


def test_forward_from_records_only_the_layers_it_runs():
    model = make("mamba")
    tokens = tokens_for()
    with torch.no_grad():
        with model.intervene(reads={"layers.1.block_input": None}) as record:
            clean = model(tokens)
        residual = record["layers.1.block_input"]
        with model.intervene(
            reads={"layers.0.mixer_output": POSITIONS, "layers.1.state": POSITIONS}
        ) as record:
            out = model.forward_from(1, residual)
    torch.testing.assert_close(out, clean)
    assert record["layers.1.state"].shape == (B, 2 * D, 16)
    with pytest.raises(KeyError, match="did not reach"):
        record["layers.0.mixer_output"]


def test_idle_sites_cost_nothing_and_hooks_see_them():
    model = make("mamba")
    tokens = tokens_for()
    with torch.no_grad():
        clean = model(tokens)
        with model.intervene(reads={"layers.0.conv_output": POSITIONS}):
            model(tokens)
    sites = [m for m in model.modules() if isinstance(m, (Site, StateSite))]
    assert len(sites) == len(model.site_names())
    assert all(s.plan is None for s in sites)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(tokens), clean)

    # Sites are submodules; a forward hook sees (and may replace) the activation.
    site = model.site("layers.0.conv_output")
    assert site is model.get_submodule("layers.0.mixer.conv_output")
    seen = {}

    def hook(module, args, output):
        seen["x"] = output
        return output * 0

    handle = site.register_forward_hook(hook)
    try:
        with torch.no_grad(), model.intervene(reads={"layers.0.conv_output": None}) as record:
            hooked = model(tokens)
    finally:
        handle.remove()
    torch.testing.assert_close(seen["x"], record["layers.0.conv_output"])
    assert (hooked - clean).abs().max() > 1e-4


def test_bad_interventions_are_refused():
    model = make("mamba")
    tokens = tokens_for()
    refused = [
        ({"reads": {"layers.0.mlp_output": None}}, ValueError, "unknown site.*layers.0.mlp_output"),
        ({"reads": {"layers.0.block_input": POSITIONS.float()}}, ValueError, "integer tensor"),
        ({"reads": {"layers.0.block_input": POSITIONS[None, None]}}, ValueError, "integer tensor"),
        (
            {"patches": {"layers.0.block_input": (POSITIONS[None], torch.zeros(B, D))}},
            ValueError,
            "patch positions.*\\(B,\\) integer tensor",
        ),
        ({"patches": {"layers.0.block_input": torch.zeros(B, D)}}, ValueError, "tuple"),
    ]
    for kwargs, error, match in refused:
        with pytest.raises(error, match=match), model.intervene(**kwargs):
            pass
    with (
        model.intervene(reads={"layers.0.block_input": None}),
        pytest.raises(RuntimeError, match="nest"),
        model.intervene(reads={"layers.0.block_input": None}),
    ):
        pass
    cases = [
        ({"patches": {"layers.0.block_input": (POSITIONS, torch.zeros(B, D + 1))}}, "shape"),
        ({"patches": {"layers.0.state": (POSITIONS, torch.zeros(B, 3, 16))}}, "shape"),
        ({"patches": {"layers.0.state": (None, torch.zeros(B, 2 * D, 16))}}, "needs positions"),
        ({"reads": {"layers.0.block_input": torch.tensor([0, 1, L])}}, "must lie in"),
        ({"reads": {"layers.0.state": torch.tensor([0, -1, 2])}}, "must lie in"),
        ({"reads": {"layers.0.conv_input": torch.tensor([0, 1])}}, "batch size"),
        ({"reads": {"layers.0.state": POSITIONS[None]}}, "batch size"),
        ({"reads": {"layers.0.block_input": torch.tensor([[0], [1], [L]])}}, "must lie in"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match), model.intervene(**kwargs):
            model(tokens)
    # A failed forward leaves the sites idle.
    assert all(s.plan is None for s in model.modules() if isinstance(s, (Site, StateSite)))
