"""The Mamba3 layer: flash-linear-attention 0.6.0's `Mamba3` state dict loads strictly (same
names and shapes) and gives fla's layer's output, fla's layer running its own code path
(`cuda_kernels_forward`) on CPU with mamba-ssm's kernels, which it calls and which do not
install here, replaced by the per-step reference of Mamba-3's scan
(mecheval_kernels.mamba3.reference) and its Triton norms by fla's own `rms_norm_ref`;
mamba-ssm's parameter names, shapes and initialisation; the mixer contract with MIMO
(check_mixer; the zoo-wide test runs SISO)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mecheval.layers import Mamba3
from mecheval.layers.mamba3 import heavy_tail
from mecheval.testing import check_mixer
from mecheval_kernels.mamba3 import mamba3_ref


@pytest.fixture(scope="module")
def fla_mamba3():
    """fla's Mamba3 with mamba-ssm's kernels and its Triton norms replaced by references."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = pytest.importorskip("fla.layers.mamba3")
        norms = pytest.importorskip("fla.modules.norm.layernorm_gated")

    def siso(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, **_):
        out, _ = mamba3_ref(Q[:, :, None], K[:, :, None], V, ADT, DT, Trap, Q_bias[:, None],
                            K_bias[:, None], Angles, D, Z)  # fmt: skip
        return out[:, :, 0]

    def mimo(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
             **_):  # fmt: skip
        return mamba3_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, None, MIMO_V,
                          MIMO_Z, MIMO_Out, "halves")[0]  # fmt: skip

    def norm(self, x, z=None):
        return norms.rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps,
                                  group_size=self.group_size,
                                  norm_before_gate=self.norm_before_gate)  # fmt: skip

    stand_ins = [(layers, "mamba3_siso_combined", siso), (layers, "mamba3_mimo_combined", mimo),
                 (norms.RMSNormGated, "forward", norm)]  # fmt: skip
    real = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    for owner, name, fn in stand_ins:
        setattr(owner, name, fn)
    yield layers.Mamba3
    for owner, name, fn in real:
        setattr(owner, name, fn)


CONFIGS = [
    dict(),
    dict(is_mimo=True, mimo_rank=2),
    dict(is_outproj_norm=True),
    dict(is_mimo=True, mimo_rank=2, is_outproj_norm=True),
    dict(n_groups=2, rope_fraction=1.0, use_bias=True),
]


@pytest.mark.parametrize("options", CONFIGS, ids=["siso", "mimo", "norm", "mimo-norm", "groups"])
def test_loads_fla_state_dict_strictly_and_matches_flas_layer(fla_mamba3, options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_mamba3(hidden_size=16, state_size=8, head_dim=8, **options)
    ours = Mamba3(
        16, d_state=8, headdim=8, A_activation="softplus", ngroups=options.get("n_groups", 1),
        rope_fraction=options.get("rope_fraction", 0.5), is_mimo=options.get("is_mimo", False),
        mimo_rank=options.get("mimo_rank", 4),
        is_outproj_norm=options.get("is_outproj_norm", False), bias=options.get("use_bias", False),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(sd)
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in ours.state_dict().items()}
    ours.load_state_dict(sd, strict=True)
    x = torch.randn(2, 13, 16, generator=g)
    expected, _ = theirs.cuda_kernels_forward(x)
    assert (ours(x) - expected).norm() / expected.norm() < 1e-5


def mamba_ssm_state_dict_shapes(d_model, d_state, expand, headdim, ngroups, rank, outproj_norm):
    """The names and shapes mamba-ssm's `Mamba3` (modules/mamba3.py) has: in_proj in the order
    [z, x, B, C, dd_dt, dd_A, trap, angles], no biases."""
    d_inner = expand * d_model
    H = d_inner // headdim
    angles = int(d_state * 0.5) // 2 * 2 // 2
    shapes = {
        "in_proj.weight": (2 * d_inner + 2 * d_state * ngroups * rank + 3 * H + angles, d_model),
        "dt_bias": (H,), "B_bias": (H, rank, d_state), "C_bias": (H, rank, d_state),
        "B_norm.weight": (d_state,), "C_norm.weight": (d_state,), "D": (H,),
        "out_proj.weight": (d_model, d_inner),
    }  # fmt: skip
    if rank > 1:
        shapes.update({f"mimo_{n}": (H, rank, headdim) for n in "xzo"})
    if outproj_norm:
        shapes["norm.weight"] = (d_inner,)
    return shapes


@pytest.mark.parametrize("rank,outproj_norm", [(1, False), (4, True)])
def test_mamba_ssm_names_shapes_and_initialisation(rank, outproj_norm):
    layer = Mamba3(32, d_state=16, headdim=8, is_mimo=rank > 1, mimo_rank=rank,
                   is_outproj_norm=outproj_norm)  # fmt: skip
    shapes = mamba_ssm_state_dict_shapes(32, 16, 2, 8, 1, rank, outproj_norm)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == shapes
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert bool(((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all())
    for name in ("B_bias", "C_bias", "D", "B_norm.weight", "C_norm.weight"):
        assert torch.equal(layer.state_dict()[name], torch.ones(shapes[name])), name
    if rank > 1:
        torch.testing.assert_close(layer.mimo_x, torch.full(shapes["mimo_x"], 1 / rank))
        torch.testing.assert_close(layer.mimo_o, torch.full(shapes["mimo_o"], 1 / rank))


def test_heavy_tail_is_mamba_ssms():
    x = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0])
    torch.testing.assert_close(heavy_tail(x), torch.tensor([0.25, 1 / 1.5, 1.0, 1.5, 4.0]))


def test_mimo_passes_check_mixer():
    report = check_mixer("mamba3", options={"mimo_rank": 2})
    passed = {c.name.rsplit(" ", 1)[-1] for c in report.checks if c.passed}
    assert {"forward", "causal", "resumable", "reads_out_at", "grid", "sites"} <= passed


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(headdim=5), "multiple of headdim"),
        (dict(ngroups=3), "ngroups"),
        (dict(rope_fraction=0.25), "rope_fraction"),
        (dict(A_activation="exp"), "A_activation"),
        (dict(dropout=0.1), "dropout"),
    ],
)
def test_bad_arguments_are_refused_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        Mamba3(16, d_state=8, **{"headdim": 8, **options})


def test_state_size_counts_what_a_context_carries():
    layer = Mamba3(16, d_state=8, headdim=8)
    H = 4
    assert layer.state_size(10) == H * (8 * 8 + 2 + 8 + 8)
    assert math.isclose(layer.num_rope_angles, 2)
