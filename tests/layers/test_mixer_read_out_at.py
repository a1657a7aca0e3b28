"""Mixers that read out at one position per row (`reads_out_at`, mecheval.layers.mixer): the
output at `at` equals the whole run's there, also resumed mid-sequence (and the context left
is the whole run's), also while a site after the sequence mixing is looked at; the last block
asks for it only while nobody looks at the mixer's output."""

from __future__ import annotations

import pytest
import torch

from mecheval.layers.resume import Resume, pick
from mecheval.models import ARCHITECTURES, build_model

V, D, L = 40, 16, 11
AT = torch.tensor([0, 3, 10, 7, 7])


def _mixers():
    for arch in ARCHITECTURES:
        torch.manual_seed(0)
        model = build_model(arch, V, D, max_len=L).eval()
        for i, block in enumerate(model.layers):
            if block.mixer.reads_out_at:
                yield f"{arch}.{i}", block.mixer


MIXERS = dict(_mixers())


def test_the_slow_mixers_read_out_at_positions():
    kinds = {type(m).__name__ for m in MIXERS.values()}
    assert {"Mamba", "Mamba2", "DeltaNet", "GatedDeltaNet", "H3", "Hyena"} <= kinds


@pytest.mark.parametrize("name", list(MIXERS))
def test_read_out_at_equals_the_whole_run_there(name):
    mixer = MIXERS[name]
    x = torch.randn(len(AT), L, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = mixer(x)
        at = mixer(x, at=AT)
        assert at.shape == (len(AT), 1, D)
        torch.testing.assert_close(at, pick(whole, AT), atol=2e-5, rtol=1e-4)
        # Resumed after 4 positions: the same outputs and the same context left.
        first, second, whole_resume = Resume(), Resume(), Resume()
        mixer(x, resume=whole_resume)
        mixer(x[:, :4], resume=first)
        second.context = first.context
        late = torch.tensor([0, 3, 6, 5, 2])
        resumed = mixer(x[:, 4:], resume=second, at=late)
        torch.testing.assert_close(resumed, pick(whole, late + 4), atol=2e-5, rtol=1e-4)
        for got, want in zip(second.context, whole_resume.context, strict=True):
            if want is not None:
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in MIXERS if n.startswith(("h3", "hyena"))])
def test_a_looked_at_readout_site_sees_every_position(name):
    mixer = MIXERS[name]
    x = torch.randn(len(AT), L, D, generator=torch.Generator().manual_seed(2))
    seen = []
    handle = mixer.long_conv_output.register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        with torch.no_grad():
            at = mixer(x, at=AT)
            whole = mixer(x)
    finally:
        handle.remove()
    assert seen[0].shape[1] == L
    torch.testing.assert_close(at, pick(whole, AT), atol=2e-5, rtol=1e-4)


def test_the_last_block_reads_out_at_the_query_unless_its_output_is_looked_at():
    torch.manual_seed(0)
    model = build_model("hyena", V, D, max_len=L).eval()
    calls = []
    mixer = model.layers[-1].mixer
    real = mixer.forward
    mixer.forward = lambda *a, **k: calls.append(k.get("at")) or real(*a, **k)
    tokens = torch.randint(0, V, (len(AT), L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        at = model(tokens, at=AT)
        with model.intervene(reads={"layers.1.mixer_output": None}):
            looked_at = model(tokens, at=AT)
        whole = model(tokens)[torch.arange(len(AT)), AT]
    assert calls[0] is not None and calls[1] is None and calls[2] is None
    torch.testing.assert_close(at, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(looked_at, whole, atol=1e-5, rtol=1e-5)
