"""The zoo: the study's architectures (docs/study.md, "Models") and those beyond it, registered
by name (mecheval.models.registry). Each factory's keyword parameters are the architecture's
options, with the study's defaults; the checks here are those a layer does not make itself.

base_conv alternates a short conv (even layers) and an implicit long conv (odd layers); based
alternates a BaseConv short conv (even) and Based linear attention (odd), as zoology configures
them for the study (so a 1-layer based model is a single BaseConv layer). The study's Based
ablation: base_conv_long has the implicit long conv in every layer, based_long alternates a
long-conv BaseConv (even) and Based linear attention (odd). The `_noconv` variants drop the
short convolutions (Mamba keeps the conv's SiLU).
"""

from __future__ import annotations

import functools

from mecheval.checks import check_int
from mecheval.layers import (
    H3,
    KDA,
    RWKV7,
    BaseConv,
    BasedLinearAttention,
    CausalSelfAttention,
    Comba,
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaProduct,
    Hyena,
    Mamba,
    Mamba2,
    Mamba3,
)
from mecheval.models.registry import register_mixer


def _divides(d_model: int, name: str, value: int) -> None:
    if d_model % value:
        raise ValueError(f"d_model {d_model} must be divisible by {name} {value}")


def attention(d_model: int, num_heads: int = 1) -> CausalSelfAttention:
    _divides(d_model, "num_heads", check_int("num_heads", num_heads, 1))
    return CausalSelfAttention(d_model, num_heads=num_heads)


def base_conv(
    d_model: int, layer_idx: int, l_max: int, d_conv: int = 3, filter_order: int = 16
) -> BaseConv:
    check_int("d_conv", d_conv, 1, 8)
    width = d_conv if layer_idx % 2 == 0 else -1
    return BaseConv(
        d_model, l_max, kernel_size=width, filter_order=check_int("filter_order", filter_order, 1)
    )


def base_conv_long(d_model: int, l_max: int, filter_order: int = 16) -> BaseConv:
    return BaseConv(
        d_model, l_max, kernel_size=-1, filter_order=check_int("filter_order", filter_order, 1)
    )


def based(
    d_model: int,
    layer_idx: int,
    l_max: int,
    d_conv: int = 3,
    feature_dim: int = 8,
    num_heads: int = 1,
) -> BaseConv | BasedLinearAttention:
    check_int("d_conv", d_conv, 1, 8)
    conv = functools.partial(BaseConv, d_model, l_max, kernel_size=d_conv)
    return _based(d_model, layer_idx, feature_dim, num_heads, conv)


def based_long(
    d_model: int,
    layer_idx: int,
    l_max: int,
    filter_order: int = 16,
    feature_dim: int = 8,
    num_heads: int = 1,
) -> BaseConv | BasedLinearAttention:
    conv = functools.partial(base_conv_long, d_model, l_max, filter_order)
    return _based(d_model, layer_idx, feature_dim, num_heads, conv)


def _based(d_model, layer_idx, feature_dim, num_heads, conv) -> BaseConv | BasedLinearAttention:
    """Layer `layer_idx` of a Based model: the BaseConv `conv()` builds in even layers, Based
    linear attention in odd ones."""
    _divides(d_model, "num_heads", check_int("num_heads", num_heads, 1))
    if layer_idx % 2 == 0:
        return conv()
    return BasedLinearAttention(
        d_model, feature_dim=check_int("feature_dim", feature_dim, 1), num_heads=num_heads
    )


def h3(d_model: int, l_max: int, d_state: int | None = None, head_dim: int = 2) -> H3:
    """d_state None: l_max (the study sets H3's state size to its sizing length)."""
    d_state = l_max if d_state is None else check_int("d_state", d_state, 1)
    _divides(d_model, "head_dim", check_int("head_dim", head_dim, 1))
    if d_state < 2:
        raise ValueError(f"h3 needs d_state >= 2, got {d_state}")
    return H3(d_model, d_state=d_state, head_dim=head_dim)


def hyena(d_model: int, l_max: int, d_conv: int = 3, filter_order: int = 64) -> Hyena:
    check_int("d_conv", d_conv, 1, 8)
    return Hyena(
        d_model,
        l_max,
        filter_order=check_int("filter_order", filter_order, 1),
        short_filter_order=d_conv,
    )


def mamba(
    d_model: int, layer_idx: int, d_state: int = 16, d_conv: int = 4, expand: int = 2
) -> Mamba:
    """d_conv in 1..4: the study's ablation covers 1..4 (and mamba-ssm's CUDA conv stops
    there)."""
    return _mamba(Mamba, d_model, layer_idx, d_state, check_int("d_conv", d_conv, 1, 4), expand)


def mamba_noconv(d_model: int, layer_idx: int, d_state: int = 16, expand: int = 2) -> Mamba:
    return _mamba(Mamba, d_model, layer_idx, d_state, None, expand)


def mamba2(
    d_model: int,
    layer_idx: int,
    d_state: int = 64,
    d_conv: int = 4,
    expand: int = 2,
    head_dim: int = 16,
) -> Mamba2:
    """Mamba-2 at the study's widths (docs/deviations.md: d_state 64, head_dim 16)."""
    d_conv = check_int("d_conv", d_conv, 1, 8)
    return _mamba(Mamba2, d_model, layer_idx, d_state, d_conv, expand, head_dim)


def mamba2_noconv(
    d_model: int, layer_idx: int, d_state: int = 64, expand: int = 2, head_dim: int = 16
) -> Mamba2:
    return _mamba(Mamba2, d_model, layer_idx, d_state, None, expand, head_dim)


def _mamba(layer, d_model, layer_idx, d_state, d_conv, expand, head_dim=None) -> Mamba | Mamba2:
    """Mamba, or Mamba-2 with heads of head_dim channels; d_conv None: without the conv."""
    heads = {}
    if layer is Mamba2:
        d_inner = check_int("expand", expand, 1) * d_model
        if d_inner % check_int("head_dim", head_dim, 1):
            raise ValueError(
                f"expand * d_model = {d_inner} must be divisible by head_dim {head_dim}"
            )
        heads = {"headdim": head_dim}
    return layer(
        d_model,
        d_state=check_int("d_state", d_state, 1),
        d_conv=d_conv or 4,
        expand=check_int("expand", expand, 1),
        layer_idx=layer_idx,
        use_conv=d_conv is not None,
        **heads,
    )


def mamba3(
    d_model: int,
    layer_idx: int,
    d_state: int = 64,
    expand: int = 2,
    head_dim: int = 16,
    mimo_rank: int = 1,
) -> Mamba3:
    """Mamba-3 (mamba-ssm's layer: heavy-tailed A, rotary half of the state) at Mamba-2's study
    widths (d_state 64, head_dim 16); mimo_rank 1 is SISO, above it MIMO with that rank."""
    d_inner = check_int("expand", expand, 1) * d_model
    if d_inner % check_int("head_dim", head_dim, 1):
        raise ValueError(f"expand * d_model = {d_inner} must be divisible by head_dim {head_dim}")
    rank = check_int("mimo_rank", mimo_rank, 1)
    return Mamba3(
        d_model,
        d_state=check_int("d_state", d_state, 2),
        expand=expand,
        headdim=head_dim,
        is_mimo=rank > 1,
        mimo_rank=rank,
        layer_idx=layer_idx,
    )


def deltanet(d_model: int, layer_idx: int, d_conv: int = 4, num_heads: int = 1) -> DeltaNet:
    return _delta_rule(DeltaNet, d_model, layer_idx, check_int("d_conv", d_conv, 1, 8), num_heads)


def deltanet_noconv(d_model: int, layer_idx: int, num_heads: int = 1) -> DeltaNet:
    return _delta_rule(DeltaNet, d_model, layer_idx, None, num_heads)


def gated_deltanet(
    d_model: int, layer_idx: int, d_conv: int = 4, num_heads: int = 1
) -> GatedDeltaNet:
    return _delta_rule(
        GatedDeltaNet, d_model, layer_idx, check_int("d_conv", d_conv, 1, 8), num_heads
    )


def gated_deltanet_noconv(d_model: int, layer_idx: int, num_heads: int = 1) -> GatedDeltaNet:
    return _delta_rule(GatedDeltaNet, d_model, layer_idx, None, num_heads)


def _delta_rule(layer, d_model, layer_idx, d_conv, num_heads) -> DeltaNet | GatedDeltaNet:
    """DeltaNet or Gated DeltaNet, d_conv None: without short convs. Gated DeltaNet with one
    value per key dimension (expand_v 1, not fla's 2): DeltaNet's state size."""
    _divides(d_model, "num_heads", check_int("num_heads", num_heads, 1))
    sizes = {"head_dim": d_model // num_heads, "expand_v": 1.0} if layer is GatedDeltaNet else {}
    return layer(
        d_model=d_model,
        num_heads=num_heads,
        use_short_conv=d_conv is not None,
        conv_size=d_conv or 4,
        layer_idx=layer_idx,
        **sizes,
    )


def rwkv7(d_model: int, layer_idx: int, n_layers: int, num_heads: int = 1) -> RWKV7:
    """RWKV-7 time mixing with fla's LoRA ranks and RWKV-7's depth-dependent initialisation,
    every layer without the value residual (a tensor across layers; mecheval.layers.rwkv7),
    in the standard block (its MLP, not RWKV-7's channel mixing)."""
    _divides(d_model, "num_heads", check_int("num_heads", num_heads, 1))
    return RWKV7(
        hidden_size=d_model,
        head_dim=None,
        num_heads=num_heads,
        layer_idx=layer_idx,
        num_hidden_layers=n_layers,
        value_residual=False,
    )


register_mixer("attention", attention, position_embeddings=True)
register_mixer("base_conv", base_conv)
register_mixer("base_conv_long", base_conv_long)
register_mixer("based", based)
register_mixer("based_long", based_long)
register_mixer("h3", h3)
register_mixer("hyena", hyena)
register_mixer("mamba", mamba, block="mamba")
register_mixer("mamba_noconv", mamba_noconv, block="mamba")
register_mixer("mamba2", mamba2, block="mamba")
register_mixer("mamba2_noconv", mamba2_noconv, block="mamba")
register_mixer("mamba3", mamba3, block="mamba")
register_mixer("deltanet", deltanet)
register_mixer("deltanet_noconv", deltanet_noconv)
register_mixer("gated_deltanet", gated_deltanet)
register_mixer("gated_deltanet_noconv", gated_deltanet_noconv)


# The delta-rule family beyond the study (issue 55): KDA, Gated DeltaProduct, Comba, each with one
# value per key dimension (expand_v 1) and head_dim d_model / num_heads, as gated_deltanet.


def kda(d_model: int, layer_idx: int, d_conv: int = 4, num_heads: int = 1) -> KDA:
    return _frontier(KDA, d_model, layer_idx, d_conv, num_heads)


def gated_deltaproduct(
    d_model: int,
    layer_idx: int,
    d_conv: int = 4,
    num_heads: int = 1,
    num_householder: int = 2,
    allow_neg_eigval: bool = True,
) -> GatedDeltaProduct:
    if not isinstance(allow_neg_eigval, bool):
        raise ValueError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval!r}")
    return _frontier(
        GatedDeltaProduct, d_model, layer_idx, d_conv, num_heads,
        num_householder=check_int("num_householder", num_householder, 1, 8),
        allow_neg_eigval=allow_neg_eigval,
    )  # fmt: skip


def comba(
    d_model: int, layer_idx: int, d_conv: int = 4, num_heads: int = 1, correction_factor=1.0
) -> Comba:
    if isinstance(correction_factor, bool) or not isinstance(correction_factor, (int, float)):
        raise ValueError(f"correction_factor must be a number, got {correction_factor!r}")
    return _frontier(
        Comba, d_model, layer_idx, d_conv, num_heads, correction_factor=float(correction_factor)
    )


def _frontier(layer, d_model, layer_idx, d_conv, num_heads, **options):
    _divides(d_model, "num_heads", check_int("num_heads", num_heads, 1))
    return layer(
        d_model=d_model,
        num_heads=num_heads,
        head_dim=d_model // num_heads,
        expand_v=1.0,
        conv_size=check_int("d_conv", d_conv, 1, 8),
        layer_idx=layer_idx,
        **options,
    )


register_mixer("kda", kda)
register_mixer("gated_deltaproduct", gated_deltaproduct)
register_mixer("comba", comba)
register_mixer("rwkv7", rwkv7)
