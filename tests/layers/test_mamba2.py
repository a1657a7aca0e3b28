"""The Mamba2 layer: a state dict with mamba-ssm's `Mamba2` names and shapes loads strictly and
gives the published equations (tests/layers/references.py), with and without its conv, with
groups and a per-channel D; mamba-ssm's initialisation; the gated RMSNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mecheval.layers import Mamba2
from mecheval.layers.mamba2 import RMSNormGated
from mecheval.layers.resume import Resume
from tests.layers.references import mamba2_reference

ATOL, RTOL = 2e-5, 1e-4


def mamba_ssm_mamba2_state_dict(
    d_model, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=1, D_has_hdim=False, seed=0
):
    """The keys and shapes mamba-ssm's `Mamba2` (modules/mamba2.py, no bias, rmsnorm) has, with
    values drawn here: in_proj (2 Di + 2 G N + H, d) in the order [z, x, B, C, dt], conv1d
    (Di + 2 G N, 1, W) + bias, dt_bias (H,), A_log (H,), D (H,) or (Di,), norm.weight (Di,),
    out_proj (d, Di)."""
    g = torch.Generator().manual_seed(seed)
    Di = expand * d_model
    H, conv_dim = Di // headdim, Di + 2 * ngroups * d_state

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    return {
        "dt_bias": rand(H) - 2.0,
        "A_log": torch.log(torch.rand(H, generator=g) * 15 + 1),
        "D": 1 + rand(Di if D_has_hdim else H),
        "in_proj.weight": rand(2 * Di + 2 * ngroups * d_state + H, d_model),
        "conv1d.weight": rand(conv_dim, 1, d_conv),
        "conv1d.bias": rand(conv_dim),
        "norm.weight": 1 + rand(Di),
        "out_proj.weight": rand(d_model, Di),
    }


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(ngroups=2, d_conv=2),
        dict(D_has_hdim=True, headdim=4),
        dict(use_conv=False),
    ],
    ids=str,
)
def test_mamba2_loads_mamba_ssm_state_dict_and_matches_equations(options):
    use_conv = options.pop("use_conv", True)
    sd = mamba_ssm_mamba2_state_dict(16, **options)
    if not use_conv:
        del sd["conv1d.weight"], sd["conv1d.bias"]
    torch.manual_seed(0)
    layer = Mamba2(16, **{"d_state": 8, "headdim": 8, "use_conv": use_conv, **options})
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        k: tuple(v.shape) for k, v in sd.items()
    }
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 9, 16)
    expected, _ = mamba2_reference(
        sd, u, headdim=options.get("headdim", 8), ngroups=options.get("ngroups", 1),
        use_conv=use_conv,
    )  # fmt: skip
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_mamba2_clamps_step_sizes_to_dt_limit():
    sd = mamba_ssm_mamba2_state_dict(16)
    layer = Mamba2(16, d_state=8, headdim=8, dt_limit=(0.02, 0.05))
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 9, 16)
    expected, _ = mamba2_reference(sd, u, headdim=8, dt_limit=(0.02, 0.05))
    unclamped, _ = mamba2_reference(sd, u, headdim=8)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(expected, unclamped, atol=1e-3)


@pytest.mark.parametrize(
    "option, message",
    [(dict(process_group=object()), "process_group"), (dict(d_ssm=16), "d_ssm = 16")],
)
def test_mamba2_refuses_tensor_parallel_and_narrow_ssm_by_name(option, message):
    with pytest.raises(ValueError, match=message):
        Mamba2(16, d_state=8, headdim=8, **option)


def test_mamba2_initialisation_is_mamba_ssms():
    torch.manual_seed(0)
    layer = Mamba2(64)
    H, Di = 8, 128  # the defaults at d_model 64: headdim 16, d_state 64
    assert (layer.nheads, layer.headdim, layer.d_state, layer.ngroups) == (H, 16, 64, 1)
    assert layer.in_proj.weight.shape == (2 * Di + 2 * 64 + H, 64)
    assert layer.conv1d.weight.shape == (Di + 2 * 64, 1, 4)
    A = torch.exp(layer.A_log.detach())
    assert A.min() >= 1 and A.max() <= 16
    dt = F.softplus(layer.dt_bias.detach())
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    torch.testing.assert_close(layer.D.detach(), torch.ones(H))
    torch.testing.assert_close(layer.norm.weight.detach(), torch.ones(Di))
    assert layer.in_proj.bias is None and layer.out_proj.bias is None


def test_mamba2_without_rmsnorm_gates_in_the_scan():
    """rmsnorm=False: no norm parameter; y = (scan + D x) * silu(z), the scan's own gate."""
    sd = mamba_ssm_mamba2_state_dict(16)
    del sd["norm.weight"]
    layer = Mamba2(16, d_state=8, headdim=8, rmsnorm=False)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 6, 16)
    expected, _ = mamba2_reference(sd, u, headdim=8, rmsnorm=False)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_gated_rmsnorm_groups_and_order():
    torch.manual_seed(0)
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    norm = RMSNormGated(8, group_size=4, norm_before_gate=False)
    norm.weight.data = torch.randn(8)
    g = (x * F.silu(z)).view(3, 2, 4)
    expected = (g / g.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).view(3, 8) * norm.weight
    torch.testing.assert_close(norm(x, z), expected)
    before = RMSNormGated(8, norm_before_gate=True)
    plain = x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(before(x, z), plain * F.silu(z))


@pytest.mark.parametrize("use_conv", [True, False])
def test_mamba2_segments_equal_one_run(use_conv):
    torch.manual_seed(0)
    layer = Mamba2(16, d_state=8, headdim=8, ngroups=2, use_conv=use_conv).eval()
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        whole = layer(x)
        resume = Resume()
        pieces = [layer(x[:, a:b], resume=resume) for a, b in ((0, 1), (1, 6), (6, 13))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=2e-5, rtol=1e-4)
    *windows, ssm_state = resume.context  # (the conv's window, if any, then the state)
    assert ssm_state.shape == (2, 4, 8, 8)
    assert [w.shape for w in windows] == ([(2, 16 * 2 + 2 * 2 * 8, 3)] if use_conv else [])
