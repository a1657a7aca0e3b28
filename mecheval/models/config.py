"""ModelConfig: the typed, validated description of one model of the study.

Fields are plain (str / int / bool / None) so that `dataclasses.asdict(config)` round-trips
through YAML and `ModelConfig(**d)` rebuilds the same model. Options left None take the
architecture's default (docs/study.md, "Models"); options that do not apply to the architecture
must stay None, and setting one is an error that names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass

ARCHITECTURES: tuple[str, ...] = (
    "attention",
    "base_conv",
    "base_conv_long",
    "based",
    "based_long",
    "h3",
    "hyena",
    "mamba",
    "mamba_noconv",
    "mamba2",
    "mamba2_noconv",
    "deltanet",
    "deltanet_noconv",
    "gated_deltanet",
    "gated_deltanet_noconv",
)

# base_conv_long and based_long are the study's Based ablation (its base_conv_long_only and
# based_long_only): BaseConv with the implicit long conv in every layer, and Based whose BaseConv
# layers use the implicit long conv instead of the short one.
#
# Architecture -> {option: default}. An option absent here does not apply to the architecture.
# d_state None for h3 means "l_max" (the study sets H3's state size to its sizing length).
_DEFAULTS: dict[str, dict[str, object]] = {
    "attention": {"position_embeddings": True, "num_heads": 1},
    "base_conv": {"position_embeddings": False, "d_conv": 3, "filter_order": 16},
    "base_conv_long": {"position_embeddings": False, "filter_order": 16},
    "based": {"position_embeddings": False, "d_conv": 3, "feature_dim": 8, "num_heads": 1},
    "based_long": {
        "position_embeddings": False,
        "filter_order": 16,
        "feature_dim": 8,
        "num_heads": 1,
    },
    "h3": {"position_embeddings": False, "d_state": None, "head_dim": 2},
    "hyena": {"position_embeddings": False, "d_conv": 3, "filter_order": 64},
    "mamba": {"position_embeddings": False, "d_state": 16, "d_conv": 4, "expand": 2},
    "mamba_noconv": {"position_embeddings": False, "d_state": 16, "expand": 2},
    "mamba2": {
        "position_embeddings": False,
        "d_state": 64,
        "d_conv": 4,
        "expand": 2,
        "head_dim": 16,
    },
    "mamba2_noconv": {"position_embeddings": False, "d_state": 64, "expand": 2, "head_dim": 16},
    "deltanet": {"position_embeddings": False, "d_conv": 4, "num_heads": 1},
    "deltanet_noconv": {"position_embeddings": False, "num_heads": 1},
    "gated_deltanet": {"position_embeddings": False, "d_conv": 4, "num_heads": 1},
    "gated_deltanet_noconv": {"position_embeddings": False, "num_heads": 1},
}

# Valid short-conv widths per architecture: the study's Mamba ablation covers 1..4 (and
# mamba-ssm's CUDA conv stops there); elsewhere the kernel's range 1..8.
_D_CONV_RANGE = {"mamba": (1, 4)}
_DEFAULT_D_CONV_RANGE = (1, 8)

# The study builds every model with n_positions = 1024 and sizes long filters and H3's state
# from it, whatever the document length.
STUDY_L_MAX = 1024

INIT_SCHEMES = ("study", "pytorch")

OPTIONS = (
    "position_embeddings",
    "d_state",
    "d_conv",
    "expand",
    "num_heads",
    "head_dim",
    "feature_dim",
    "filter_order",
)


@dataclass(frozen=True)
class ModelConfig:
    """One model: architecture, sizes and architecture options.

    Attributes:
        arch: one of ARCHITECTURES.
        vocab_size: tokens; the embedding is tied to the output head.
        d_model: width of the residual stream.
        n_layers: blocks.
        max_len: longest sequence the model accepts; the position embeddings have max_len rows.
        l_max: the sizing length (the study's n_positions, 1024): Hyena's and BaseConv's
            implicit filters are laid out for it (their positional encoding advances by
            1 / (l_max - 1) per token) and H3's state size defaults to it, whatever the
            document length. An implicit filter refuses a sequence longer than l_max when it
            runs (a task's longest possible document may exceed it, as the study's ATR
            bound of 1,029 tokens does; its documents never come close).
        position_embeddings: learned absolute position embeddings (default: attention only).
        d_state: SSM state size: mamba (16), mamba2 (64), h3 (l_max).
        d_conv: short conv width: mamba (4; 1..4), mamba2 (4), deltanet and gated_deltanet (4),
            base_conv / based layer-0 short conv (3), hyena short filter (3).
        expand: mamba's and mamba2's d_inner / d_model (2).
        num_heads: attention, based, deltanet, gated_deltanet (1).
        head_dim: h3 (2), mamba2's channels per head (16; must divide expand * d_model).
        feature_dim: based's feature dimension before the Taylor map (8).
        filter_order: width of the implicit long filter's MLP: hyena (64), the long convs of
            base_conv, base_conv_long and based_long (16).
        init: weight initialisation. "study": the study's (zoology's GPT-2 style: Linear and
            embeddings ~ N(0, 0.02), residual outputs scaled; mamba-ssm's scheme for Mamba).
            "pytorch": every module's own PyTorch default (embeddings ~ N(0, 1)); much faster
            to learn AR with few steps (attention, 4-pair AR: 100% by 1,500 steps, where the
            study's init is still at chance after 4,000), which is what short CPU runs need.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int = 2
    _: KW_ONLY
    max_len: int
    l_max: int = STUDY_L_MAX
    position_embeddings: bool | None = None
    d_state: int | None = None
    d_conv: int | None = None
    expand: int | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    feature_dim: int | None = None
    filter_order: int | None = None
    init: str = "study"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {ARCHITECTURES}")
        if self.init not in INIT_SCHEMES:
            raise ValueError(f"unknown init {self.init!r}; expected one of {INIT_SCHEMES}")
        for name in ("vocab_size", "d_model", "n_layers", "max_len", "l_max"):
            _check_int(name, getattr(self, name), minimum=1)
        defaults = _DEFAULTS[self.arch]
        not_applicable = [
            name for name in OPTIONS if getattr(self, name) is not None and name not in defaults
        ]
        if not_applicable:
            raise ValueError(
                f"option(s) {', '.join(not_applicable)} do not apply to arch {self.arch!r} "
                f"(its options: {', '.join(defaults)})"
            )
        if self.position_embeddings is not None and not isinstance(self.position_embeddings, bool):
            raise ValueError(
                f"position_embeddings must be a bool or None, got {self.position_embeddings!r}"
            )
        for name in ("d_state", "expand", "num_heads", "head_dim", "feature_dim", "filter_order"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.d_conv is not None:
            lo, hi = _D_CONV_RANGE.get(self.arch, _DEFAULT_D_CONV_RANGE)
            _check_int("d_conv", self.d_conv, minimum=lo, maximum=hi)
        heads = self.option("num_heads")
        if heads is not None and self.d_model % heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by num_heads {heads}")
        if self.arch == "h3":
            head_dim = self.option("head_dim")
            if self.d_model % head_dim:
                raise ValueError(f"d_model {self.d_model} must be divisible by head_dim {head_dim}")
            if self.option("d_state") < 2:
                raise ValueError(f"h3 needs d_state >= 2, got {self.option('d_state')}")
        if self.arch in ("mamba2", "mamba2_noconv"):
            d_inner, head_dim = self.option("expand") * self.d_model, self.option("head_dim")
            if d_inner % head_dim:
                raise ValueError(
                    f"expand * d_model = {d_inner} must be divisible by head_dim {head_dim}"
                )

    def option(self, name: str) -> object:
        """The option's value: as set, else the architecture's default (None if n/a)."""
        value = getattr(self, name)
        if value is not None:
            return value
        if self.arch == "h3" and name == "d_state":
            return self.l_max
        return _DEFAULTS[self.arch].get(name)

    def resolved(self) -> dict[str, object]:
        """Every option that applies to the architecture, with defaults filled in."""
        return {name: self.option(name) for name in _DEFAULTS[self.arch]}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
