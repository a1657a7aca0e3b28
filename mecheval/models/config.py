"""ModelConfig: the typed, validated description of one model.

Fields are plain (str / int / bool / None, and the options as a dict of them) so that
`dataclasses.asdict(config)` round-trips through YAML and `ModelConfig(**d)` rebuilds the same
model. `arch` is a registered name, an import path or a hybrid of them
(mecheval.models.registry); `options` are its mixers' options (each must apply to one of them),
the others keep the factories' defaults. A config is checked when it is made: the arch is
looked up and every layer's mixer is built on the meta device (no memory, no random numbers
drawn), so a bad option or a mixer whose declarations contradict its sites is refused before
any work, by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field

import torch

from mecheval.checks import check_int
from mecheval.models import zoo  # noqa: F401  (registers the zoo's architectures)
from mecheval.models.registry import Architecture, UserCodeError, architecture, registered

# The zoo's architectures, in registration order (the study's and those beyond it).
ARCHITECTURES: tuple[str, ...] = registered()

# The study builds every model with n_positions = 1024 and sizes long filters and H3's state
# from it, whatever the document length.
STUDY_L_MAX = 1024

INIT_SCHEMES = ("study", "pytorch")


@dataclass(frozen=True)
class ModelConfig:
    """One model: architecture, sizes and the mixers' options.

    Attributes:
        arch: a registered name (ARCHITECTURES and any `register_mixer` added), an import path
            `package.module:Name`, or parts joined by "+" (a hybrid: the parts by layer,
            repeating, e.g. "mamba+attention"; the parts must divide n_layers).
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
        position_embeddings: learned absolute position embeddings (None: the architecture's
            default, which is attention's only in the zoo).
        init: weight initialisation. "study": the study's (zoology's GPT-2 style: Linear and
            embeddings ~ N(0, 0.02), residual outputs scaled; mamba-ssm's scheme for the
            blocks of Mamba kind). "pytorch": every module's own PyTorch default (embeddings ~
            N(0, 1)); much faster to learn AR with few steps (attention, 4-pair AR: 100% by
            1,500 steps, where the study's init is still at chance after 4,000), which is what
            short CPU runs need.
        options: the mixers' options, e.g. {"d_conv": 2} (the zoo's: d_state, d_conv, expand,
            num_heads, head_dim, feature_dim, filter_order; mecheval.models.zoo); in a hybrid,
            a part's own under its name ({"mamba": {"d_conv": 2}}).
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int = 2
    _: KW_ONLY
    max_len: int
    l_max: int = STUDY_L_MAX
    position_embeddings: bool | None = None
    init: str = "study"
    options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.init not in INIT_SCHEMES:
            raise ValueError(f"unknown init {self.init!r}; expected one of {INIT_SCHEMES}")
        for name in ("vocab_size", "d_model", "n_layers", "max_len", "l_max"):
            check_int(name, getattr(self, name), 1)
        if self.position_embeddings is not None and not isinstance(self.position_embeddings, bool):
            raise ValueError(
                f"position_embeddings must be a bool or None, got {self.position_embeddings!r}"
            )
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping, got {self.options!r}")
        object.__setattr__(self, "options", dict(self.options))
        self.architecture.check_layers(self.n_layers)
        self.architecture.check_options(self.options)
        for i in range(self.n_layers):  # every layer's mixer: its options and declarations
            _check_buildable(self, i)

    @property
    def architecture(self) -> Architecture:
        return architecture(self.arch)

    def mixer(self, layer_idx: int):
        """A new mixer for layer `layer_idx` (on the current default device)."""
        arch = self.architecture
        options = arch.options_of(layer_idx, self.options)
        return arch.part(layer_idx).build(
            self.d_model, layer_idx, self.n_layers, self.l_max, options
        )

    def block_kind(self, layer_idx: int) -> str:
        """The block around layer `layer_idx`'s mixer: "transformer" or "mamba"."""
        return self.architecture.part(layer_idx).block

    @property
    def uses_position_embeddings(self) -> bool:
        if self.position_embeddings is not None:
            return self.position_embeddings
        return self.architecture.position_embeddings(self.n_layers)

    def resolved(self) -> dict[str, object]:
        """Every option that applies to the architecture, defaults filled in, and whether it
        has position embeddings."""
        options = {**self.architecture.option_defaults(), **self.options}
        return {"position_embeddings": self.uses_position_embeddings, **options}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _check_buildable(config: ModelConfig, layer_idx: int) -> None:
    """Build layer `layer_idx`'s mixer on the meta device; a mixer whose constructor needs real
    tensors is built on the CPU instead, with the random state put back after."""
    try:
        with torch.device("meta"):
            config.mixer(layer_idx)
        return
    except UserCodeError:
        pass  # perhaps the meta device alone: the CPU says
    except (ValueError, TypeError):
        raise
    except Exception:  # noqa: BLE001  (an operation the meta device does not have)
        pass
    with torch.random.fork_rng(devices=[]):
        config.mixer(layer_idx)
