"""forward_from with one position per row: the last block runs its MLP at those positions alone
when nobody looks at the sites after its mixer, and the logits equal the full forward's there;
the long-convolution filters' memo follows their parameters."""

from __future__ import annotations

import pytest
import torch

from mecheval.models import ARCHITECTURES, build_model

V, D, L = 40, 16, 11


def _model(arch):
    torch.manual_seed(0)
    return build_model(arch, V, D, max_len=L).eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_at_positions_equal_the_full_forward(arch):
    model = _model(arch)
    tokens = torch.randint(0, V, (5, L), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([0, 3, 10, 7, 7])
    rows = torch.arange(5)
    with torch.no_grad():
        full = model(tokens)[rows, positions]
        at = model(tokens, at=positions)
    torch.testing.assert_close(at, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", [None, torch.tensor([0, 3, 10, 7, 7])], ids=["all", "at"])
def test_head_hidden_is_the_heads_input(positions):
    """head="hidden" stops before the head: its product with the unembedding is the logits."""
    model = _model("mamba")
    tokens = torch.randint(0, V, (5, L), generator=torch.Generator().manual_seed(1))
    x = model.embed(tokens)
    with torch.no_grad():
        logits = model.forward_from(0, x, positions)
        hidden = model.forward_from(0, x, positions, head="hidden")
    assert hidden.shape == logits.shape[:-1] + (D,)
    torch.testing.assert_close(hidden @ model.unembedding.T, logits)
    with pytest.raises(ValueError, match="head must be True, False or 'hidden'"):
        model.forward_from(0, x, head="logits")


def test_sites_after_the_last_mixer_still_see_every_position():
    """The last MLP runs at the positions alone, unless a read or a hook looks at a site after
    the last mixer: that site then gets the whole (B, L, C) activation."""
    model = _model("attention")
    tokens = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([2, 5, 9])
    mlp_inputs = []
    model.layers[1].mlp.register_forward_hook(lambda m, i, out: mlp_inputs.append(i[0].shape))
    with torch.no_grad():
        model(tokens, at=positions)
        assert mlp_inputs.pop() == (3, 1, D)
        with model.intervene(reads={"layers.1.block_output": None}) as record:
            model(tokens, at=positions)
        assert mlp_inputs.pop() == (3, L, D)
        assert record["layers.1.block_output"].shape == (3, L, D)
        seen = []
        site = model.site("layers.1.mlp_output")
        handle = site.register_forward_hook(lambda m, i, out: seen.append(out.shape))
        model(tokens, at=positions)
        handle.remove()
        assert seen == [(3, L, D)] and mlp_inputs.pop() == (3, L, D)


@pytest.mark.parametrize("arch", ["hyena", "h3", "base_conv"])
def test_filter_memo_follows_the_parameters(arch):
    """Memoised taps are recomputed after a parameter changes in place (as an optimizer step
    does) and are not used when a gradient is recorded."""
    model = _model(arch)
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(tokens)
        for name, p in model.named_parameters():
            if "filter" in name or "shift_C" in name or name.endswith("conv.mlp.2.weight"):
                p.mul_(1.5)
        after = model(tokens)
    with torch.enable_grad():
        reference = model(tokens)  # no memo: computed from the parameters afresh
    torch.testing.assert_close(after, reference.detach(), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before, after)


def test_stop_runs_the_first_blocks_alone():
    """stop=k returns the residual stream leaving block k - 1, as the block_output site reads."""
    model = _model("deltanet")
    tokens = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(4))
    x = model.embed(tokens)
    with torch.no_grad():
        with model.intervene(reads={"layers.0.block_output": None}) as record:
            model.forward_from(0, x)
        first = model.forward_from(0, x, stop=1)
        both = model.forward_from(1, first, stop=2)
        with model.intervene(reads={"layers.1.block_output": None}) as second:
            model.forward_from(0, x)
    torch.testing.assert_close(first, record["layers.0.block_output"])
    torch.testing.assert_close(both, second["layers.1.block_output"])
    with pytest.raises(ValueError, match=r"stop must be in 1..2, got 0"):
        model.forward_from(0, x, stop=0)
