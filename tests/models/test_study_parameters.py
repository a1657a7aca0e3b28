"""Every architecture has exactly the parameters of the study's model (docs/study.md,
"Models"): the same count, and one parameter of ours per parameter of the study's, of the same
size. The figures are the study's models (tinylang's zoology wrapper, its ar_32 configs: 2
layers, vocabulary 8196, n_positions 1024, bias=False, MLP state mixer except Mamba), counted
without token and position embeddings; layouts may differ (our conv weights and encodings
drop the study's leading singleton axes), names are ours. The Based ablation's models
(base_conv_long, based_long: the study's base_conv_long_only and based_long_only) are counted
from the same modules: zoology's BaseConv with kernel_size -1 (projection with bias and an
implicit long conv, z of l_max x 3 and a Linear(3, 16), ReLU, Linear(16, d) filter) in place of
the short-conv BaseConv."""

from __future__ import annotations

from collections import Counter

import pytest

from mecheval.models import build_model

STUDY_COUNTS = {
    64: {
        "attention": 99_712,
        "base_conv": 79_616,
        "base_conv_long": 83_584,
        "based": 80_448,
        "based_long": 84_416,
        "h3": 559_104,
        "hyena": 133_376,
        "mamba": 65_536,
    },
    256: {
        "attention": 1_578_496,
        "base_conv": 1_193_792,
        "base_conv_long": 1_200_256,
        "based": 1_255_680,
        "based_long": 1_262_144,
        "h3": 3_416_064,
        "hyena": 1_642_880,
        "mamba": 876_544,
    },
}

# The sizes of the study's parameters at d_model 64, one entry per parameter (both layers,
# final norm), in the order the study lists them.
_TRANSFORMER_BLOCK = [16384, 256, 16384, 64, 64, 64, 64, 64]  # fc1 w/b, fc2 w/b, norm1, norm2
_LN_F = [64, 64]
_LONG_BASE_CONV = [4096, 64, 3072, 48, 16, 1024, 64]  # projection w/b, z, filter MLP
STUDY_SIZES_D64 = {
    "attention": 2 * ([12288, 4096, 64] + _TRANSFORMER_BLOCK) + _LN_F,
    "base_conv": [4096, 64, 192, 64]  # layer 0: projection w/b, short conv w/b
    + _TRANSFORMER_BLOCK
    + _LONG_BASE_CONV  # layer 1
    + _TRANSFORMER_BLOCK
    + _LN_F,
    "base_conv_long": 2 * (_LONG_BASE_CONV + _TRANSFORMER_BLOCK) + _LN_F,
    "based": [4096, 64, 192, 64]  # layer 0: BaseConv
    + _TRANSFORMER_BLOCK
    + [512, 512, 4096, 4096]  # layer 1: proj_q, proj_k, proj_v, proj_o
    + _TRANSFORMER_BLOCK
    + _LN_F,
    "based_long": _LONG_BASE_CONV  # layer 0: long-conv BaseConv
    + _TRANSFORMER_BLOCK
    + [512, 512, 4096, 4096]  # layer 1: Based
    + _TRANSFORMER_BLOCK
    + _LN_F,
    "h3": 2
    * (
        [64, 32]  # shift D, diagonal D
        + [4096, 64] * 3  # q, k, v projections
        + [65536, 65536]  # shift SSM B, C
        + [32768, 32, 32768, 16384, 16384]  # diagonal SSM C, log_dt, B, inv_A_real, A_imag
        + [4096, 64]  # output_linear
        + _TRANSFORMER_BLOCK
    )
    + _LN_F,
    "hyena": 2
    * (
        [12288, 192, 4096, 64, 576, 192]  # in_proj w/b, out_proj w/b, short filter w/b
        + [64, 3072]  # the filter's skip D (unused, as the study's), z
        + [192, 64, 64, 4096, 64, 4096, 64, 4096]  # filter MLP, shared Sin frequencies
        + _TRANSFORMER_BLOCK
    )
    + _LN_F,
    "mamba": 2 * [2048, 128, 16384, 512, 128, 4608, 512, 128, 8192, 64] + _LN_F,
}


def _body_parameters(arch: str, d_model: int) -> list[int]:
    model = build_model(arch, 8195, d_model, 2, max_len=37)
    embeddings = {"embedding.weight", "position_embedding.weight"}
    return [p.numel() for n, p in model.named_parameters() if n not in embeddings]


@pytest.mark.parametrize("d_model", sorted(STUDY_COUNTS))
@pytest.mark.parametrize("arch", sorted(STUDY_COUNTS[64]))
def test_parameter_count_is_the_studys(arch, d_model):
    assert sum(_body_parameters(arch, d_model)) == STUDY_COUNTS[d_model][arch]


@pytest.mark.parametrize("arch", sorted(STUDY_SIZES_D64))
def test_each_parameter_has_a_study_counterpart(arch):
    assert Counter(_body_parameters(arch, 64)) == Counter(STUDY_SIZES_D64[arch])


def test_every_parameter_is_trained():
    """The study trains every parameter it has (its evaluation step switches requires_grad on
    for all of them), including the filters' positional encodings."""
    for arch in STUDY_COUNTS[64]:
        model = build_model(arch, 50, 16, max_len=8)
        assert all(p.requires_grad for p in model.parameters()), arch
