"""Resumable mixers (mecheval.layers.mixer): a sequence run in segments, each resuming from
the context the previous one left, gives the outputs of one run; also through a state patch."""

from __future__ import annotations

import pytest
import torch

from mecheval.layers.resume import Resume
from mecheval.models import ARCHITECTURES, build_model

V, D, L = 40, 16, 11


def _mixers(arch):
    """Each layer's mixer of a 2-layer model (based and base_conv alternate two kinds)."""
    torch.manual_seed(0)
    model = build_model(arch, V, D, max_len=L)
    with torch.no_grad():  # weights at the usual scale, so that every part of a mixer matters
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
    return [block.mixer.eval() for block in model.layers]


def _segments(mixer, x, cuts):
    resume = Resume()
    bounds = [0, *cuts, x.shape[1]]
    return torch.cat(
        [mixer(x[:, a:b], resume=resume) for a, b in zip(bounds, bounds[1:], strict=False)], 1
    )


def test_every_mixer_resumes():
    for arch in ARCHITECTURES:
        for mixer in _mixers(arch):
            assert mixer.resumable, (arch, type(mixer).__name__)
        assert build_model(arch, V, D, max_len=L).can_resume(0), arch


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cuts", [[1], [4], [3, 7, 10]], ids=str)
def test_segments_equal_one_run(arch, cuts):
    for mixer in _mixers(arch):
        x = torch.randn(3, L, D, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            whole = mixer(x)
            pieces = _segments(mixer, x, cuts)
        torch.testing.assert_close(pieces, whole, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "arch, site",
    [
        ("mamba", "state"),
        ("mamba2", "state"),
        ("mamba2_noconv", "state"),
        ("mamba2", "conv_input"),
        ("deltanet", "state"),
        ("gated_deltanet", "state"),
        ("gated_deltanet", "v_conv_input"),
        ("hyena", "long_conv_input"),
        ("h3", "long_conv_input"),
        ("h3", "conv_input"),
        ("base_conv", "conv_input"),
        ("base_conv_long", "long_conv_input"),
        ("based", "conv_output"),
    ],
)
def test_a_resumed_state_patch_equals_one_patched_run(arch, site):
    """Patching a site (a state, or a long or short convolution's input) at position 6 in a
    segment that starts at 4 (relative 2) gives what patching it in one run does."""
    model = build_model(arch, V, D, max_len=L).eval()
    name = f"layers.0.{site}"
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(2))
    x = model.embed(tokens)
    block = model.layers[0]
    with torch.no_grad():
        with model.intervene(reads={name: torch.tensor([3, 3])}) as record:
            model(tokens)
        value = record[name] * 1.5
        with model.intervene(patches={name: (torch.tensor([6, 6]), value)}):
            whole = block(x)
        first = Resume()
        block(x[:, :4], first)
        with model.intervene(patches={name: (torch.tensor([2, 2]), value)}):
            rest = block(x[:, 4:], first)
    torch.testing.assert_close(rest, whole[:, 4:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_context_size_counts_the_contexts_floats(arch):
    """model.context_size(P), which sizes the grid engine's stored contexts, is the number of
    floats per sequence the mixers' contexts hold after P positions."""
    model = build_model(arch, V, D, max_len=L).eval()
    x = model.embed(torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3)))
    held = 0
    with torch.no_grad():
        for block in model.layers:
            resume = Resume()
            block(x, resume)
            held += sum(t[0].numel() for t in resume.context if t is not None)
    assert held == model.context_size(7)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_resume_from_returns_the_contexts_to_continue_from(arch):
    """The model-level contract: logits of positions [p, L) from the contexts of [0, p) equal
    one run's, and the contexts it returns continue the sequence again."""
    model = build_model(arch, V, D, max_len=L).eval()
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(4))
    x = model.embed(tokens)
    with torch.no_grad():
        whole = model.forward_from(0, x)
        head, contexts = model.resume_from(0, x[:, :4])
        middle, contexts = model.resume_from(0, x[:, 4:8], contexts)
        tail, _ = model.resume_from(0, x[:, 8:], contexts)
    torch.testing.assert_close(torch.cat([head, middle, tail], 1), whole, atol=2e-5, rtol=1e-4)
    assert len(contexts) == len(model.layers)
    assert not any(hasattr(block.mixer, "resume") for block in model.layers)


@pytest.mark.parametrize("arch", ["attention", "mamba", "based"])
def test_resume_from_without_head_leaves_the_same_contexts_and_reads(arch):
    """head=False runs the blocks alone: no logits, but the same contexts and site reads."""
    model = build_model(arch, V, D, max_len=L).eval()
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(5))
    x = model.embed(tokens)
    reads = {name: None for name in model.site_names() if name.endswith("block_output")}
    with torch.no_grad():
        first, contexts = model.resume_from(0, x[:, :6])
        with model.intervene(reads=reads) as with_head:
            expected, _ = model.resume_from(0, x[:, 6:], contexts)
        none, contexts_without = model.resume_from(0, x[:, :6], head=False)
        with model.intervene(reads=reads) as without_head:
            logits, _ = model.resume_from(0, x[:, 6:], contexts_without, head=False)
    assert none is None and logits is None
    for name in reads:
        torch.testing.assert_close(without_head[name], with_head[name], msg=name)
    torch.testing.assert_close(torch.cat([first, expected], 1), model.forward_from(0, x))


WITH_CONTEXT_SITES = [a for a in ARCHITECTURES if build_model(a, V, D, max_len=L).context_sites()]


@pytest.mark.parametrize("arch", WITH_CONTEXT_SITES)
def test_contexts_from_one_run_equal_those_a_run_in_segments_leaves(arch):
    """`context_sites` / `contexts_from`: the contexts at positions 1, 2 and 6 taken from one
    run's reads are those runs of [0, p) leave, and continuing from them gives one run's
    logits."""
    model = build_model(arch, V, D, max_len=L).eval()
    tokens = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(6))
    x = model.embed(tokens)
    sites, points = model.context_sites(), [1, 2, 6]
    before = torch.tensor(points) - 1
    reads = {n: before.expand(3, -1) if n.endswith(".state") else None for n in sites}
    with torch.no_grad():
        with model.intervene(reads=reads) as record:
            whole = model.forward_from(0, x)
        taken = model.contexts_from(record, points)
        for p in points:
            _, left = model.resume_from(0, x[:, :p])
            for mine, theirs in zip(taken[p], left, strict=True):
                for a, b in zip(mine, theirs, strict=True):
                    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            tail, _ = model.resume_from(0, x[:, p:], taken[p])
            torch.testing.assert_close(tail, whole[:, p:], atol=2e-5, rtol=1e-4)


def test_which_models_take_their_contexts_from_one_run():
    """Mamba, H3 and Hyena say which sites hold their contexts; attention does not (its
    contexts come from a run in segments)."""
    assert {"mamba", "h3", "hyena"} <= set(WITH_CONTEXT_SITES)
    assert build_model("attention", V, D, max_len=L).context_sites() is None
