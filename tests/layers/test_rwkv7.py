"""The RWKV7 layer: flash-linear-attention 0.6.0's `RWKV7Attention` state dict loads strictly
(same names and shapes) and gives fla's layer's output, fla's layer running on CPU with its own
PyTorch references in place of its Triton kernels (`dplr_recurrence`, the naive DPLR
recurrence, for `chunk_rwkv7`); fla's initialisation; the mixer contract (check_mixer) with
every weight random (the zoo's RWKV-7 initialisation zeroes the output projection, which makes
a check at initialisation say little)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mecheval.layers import RWKV7
from mecheval.testing import check_mixer


@pytest.fixture(scope="module")
def fla_rwkv7():
    """fla's RWKV7Attention with its kernels replaced by fla's own references."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = pytest.importorskip("fla.layers.rwkv7")
        from fla.modules.token_shift import token_shift_ref
        from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
        from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
        from fla.ops.rwkv7.fused_k_update import k_update_ref
        from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

    def naive(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, **_):
        first = lambda t: t.transpose(1, 2)  # noqa: E731
        # dplr_recurrence scales q by K ** -0.5 itself.
        q = first(r) * (scale * r.shape[-1] ** 0.5)
        o, s = dplr_recurrence(q, first(k), first(v), first(a), first(b), first(w),
                               initial_state, output_final_state)  # fmt: skip
        return first(o), s

    def shift(x, cu_seqlens=None, output_cache=False, cache=None):
        return token_shift_ref(x), x[:, -1]

    stand_ins = dict(
        chunk_rwkv7=naive,
        fused_mul_recurrent_rwkv7=None,
        fused_addcmul_rwkv7=torch_addcmul_rwkv7,
        fused_k_rwkv7=k_update_ref,
        gate_output_correction=gate_output_correction_ref,
        token_shift=shift,
    )
    real = {name: getattr(layers, name) for name in stand_ins}
    for name, fn in stand_ins.items():
        setattr(layers, name, fn)
    yield layers.RWKV7Attention
    for name, fn in real.items():
        setattr(layers, name, fn)


def _pair(fla_rwkv7, seed=0, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_rwkv7(**options)
    ours = RWKV7(**options)
    g = torch.Generator().manual_seed(seed)
    sd = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(sd)
    ours.load_state_dict(sd, strict=True)
    return theirs, ours


@pytest.mark.parametrize(
    "options",
    [
        dict(hidden_size=32, head_dim=16, layer_idx=0, num_hidden_layers=2),
        dict(hidden_size=32, head_dim=16, layer_idx=2, num_hidden_layers=4),  # value residual
        dict(
            hidden_size=24,
            num_heads=2,
            head_dim=None,
            layer_idx=0,
            value_dim=16,
            num_hidden_layers=2,
        ),
        # fla's initialisation needs a norm weight: no layer_idx, so a value residual (fla's rule)
        dict(hidden_size=32, head_dim=8, elementwise_affine=False),
    ],
    ids=["layer0", "value-residual", "value-dim", "no-affine"],
)
def test_loads_fla_state_dict_strictly_and_matches_flas_layer(fla_rwkv7, options):
    theirs, ours = _pair(fla_rwkv7, **options)
    names = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert names == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    x = torch.randn(2, 23, options["hidden_size"], generator=torch.Generator().manual_seed(1))
    v_first = torch.randn(2, 23, theirs.value_dim) if ours.value_residual else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = theirs(x, v_first=v_first)[0]
    got = ours(x, v_first=v_first)
    assert (got - expected).norm() / expected.norm() < 1e-5


def test_initialisation_is_flas(fla_rwkv7):
    """Every parameter fla's RWKV-7 initialisation sets without randomness (the token-shift
    mixes, k_k, k_a, r_k, the LoRA biases and first matrices, the norm, the zero output
    projection) equals fla's; the orthogonal ones have fla's norms."""
    options = dict(hidden_size=64, head_dim=16, layer_idx=1, num_hidden_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_rwkv7(**options)
    ours = RWKV7(**options)
    random = ("r_proj", "k_proj", "v_proj", "lora.2.weight")
    for name, p in theirs.state_dict().items():
        q = ours.state_dict()[name]
        if any(r in name for r in random):
            torch.testing.assert_close(q.norm(), p.norm(), rtol=1e-4, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)


def test_value_residual_needs_the_first_layers_values():
    layer = RWKV7(hidden_size=16, head_dim=8, layer_idx=1)
    assert layer.value_residual and hasattr(layer, "v_lora")
    with pytest.raises(ValueError, match="v_first"):
        layer(torch.randn(1, 3, 16))
    plain = RWKV7(hidden_size=16, head_dim=8, layer_idx=1, value_residual=False)
    assert not hasattr(plain, "v_lora")
    assert plain(torch.randn(1, 3, 16)).shape == (1, 3, 16)


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(hidden_size=30, head_dim=8), "multiple of head_dim"),
        (dict(hidden_size=16, head_dim=None, num_heads=None), "head_dim or num_heads"),
        (dict(hidden_size=16, head_dim=8, value_dim=9), "value_dim"),
        (dict(hidden_size=16, mode="parallel"), "mode"),
    ],
)
def test_bad_arguments_are_refused_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        RWKV7(**options)


def _random_rwkv7(d_model: int, layer_idx: int, n_layers: int) -> RWKV7:
    """The zoo's RWKV-7 with every weight drawn at random (input-dependent decays, gates and
    learning rates, a nonzero output projection)."""
    layer = RWKV7(hidden_size=d_model, head_dim=8, layer_idx=layer_idx, num_hidden_layers=n_layers,
                  value_residual=False)  # fmt: skip
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def test_passes_check_mixer_with_random_weights():
    report = check_mixer(_random_rwkv7)
    passed = {c.name.rsplit(" ", 1)[-1] for c in report.checks if c.passed}
    assert {"forward", "causal", "resumable", "reads_out_at", "grid"} <= passed
    assert {"local_sites", "window_sites", "reach_site", "readout_sites", "sites"} <= passed
