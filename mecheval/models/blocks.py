"""Blocks: a sequence mixer wrapped with norms, residual adds and (in Transformer blocks) an MLP.

Every block's `forward` takes the residual stream (B, L, d_model) as its first positional
argument and returns the new residual stream, so forward hooks on blocks see the stream.

Block sites (`Site` submodules, named as the attributes below):
    block_input   the residual stream entering the block
    mixer_input   the normalised stream the mixer reads
    mixer_output  the mixer's output, before the residual add
    mlp_input     the normalised stream the MLP reads         (blocks with an MLP)
    mlp_output    the MLP's output, before the residual add   (blocks with an MLP)
    block_output  the residual stream leaving the block
plus the sites inside the mixer (conv_input, state, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from mecheval.layers import MLP, Mixer, MixerError, Site
from mecheval.layers.resume import Resume, pick
from mecheval.models.config import ModelConfig
from mecheval.models.registry import BLOCKS

# A block's own sites, in forward order: a mixer's sites may not take these names.
BLOCK_SITES = (
    "block_input",
    "mixer_input",
    "mixer_output",
    "mlp_input",
    "mlp_output",
    "block_output",
)


class Block(nn.Module):
    """What both blocks share: the sites around the mixer, and `forward`, which runs the
    residual stream through the block's input site, its norm, the mixer (with the residual
    add) and `after_mixer` to its output site.

    Args:
        mixer: the sequence mixer, (B, L, d_model) -> (B, L, d_model).
        norm_name: the attribute of the norm before the mixer.
        norm: that norm.
    """

    kind: str
    # The sites after the mixer, in forward order (see `after_mixer_idle`).
    sites_after_mixer: tuple[str, ...] = ("block_output",)

    def __init__(self, mixer: Mixer, norm_name: str, norm: nn.Module) -> None:
        super().__init__()
        _check_mixer(mixer)
        self.block_input = Site("block_input")
        self.add_module(norm_name, norm)
        self._norm_name = norm_name
        self.mixer_input = Site("mixer_input")
        self.mixer = mixer
        self.mixer_output = Site("mixer_output")

    def forward(
        self, residual: torch.Tensor, resume: Resume | None = None, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """residual: (B, L, d_model) -> (B, L, d_model); `resume`: the mixer's context
        (mecheval.layers.mixer), None for a whole sequence; `at`: (B,) one position per
        row, the only one whose output is needed (what follows the mixer then runs there alone
        and the block returns (B, 1, d_model); only while the sites after the mixer are idle,
        see `after_mixer_idle`)."""
        residual = self.block_input(residual)
        h = self.mixer_input(getattr(self, self._norm_name)(residual))
        return self.block_output(self.after_mixer(_mix(self, residual, h, resume, at)))

    def after_mixer(self, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after the mixer's add, through what follows (nothing here)."""
        return residual

    def after_mixer_idle(self) -> bool:
        """Whether no plan or hook looks at the sites after the mixer, nor at the output."""
        sites = (getattr(self, name) for name in self.sites_after_mixer)
        return not self._forward_hooks and _idle(*sites)


class TransformerBlock(Block):
    """Pre-LayerNorm block: x + mixer(LN(x)), then + MLP(LN(.)) with hidden 4 d and GELU.
    LayerNorms and MLP have biases, as zoology's TransformerBlock.

    Args:
        d_model: residual width.
        mixer: the sequence mixer, (B, L, d_model) -> (B, L, d_model).
    """

    kind = "transformer"
    sites_after_mixer = ("mlp_input", "mlp_output", "block_output")

    def __init__(self, d_model: int, mixer: Mixer) -> None:
        super().__init__(mixer, "norm1", nn.LayerNorm(d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp_input = Site("mlp_input")
        self.mlp = MLP(d_model, hidden_mult=4)
        self.mlp_output = Site("mlp_output")
        self.block_output = Site("block_output")

    def after_mixer(self, residual: torch.Tensor) -> torch.Tensor:
        """+ MLP(LN(residual))."""
        return residual + self.mlp_output(self.mlp(self.mlp_input(self.norm2(residual))))


class MambaBlock(Block):
    """Mamba block: x + mixer(RMSNorm(x)), no MLP.

    Args:
        d_model: residual width.
        mixer: the sequence mixer (Mamba, Mamba-2, or any mixer registered with block "mamba").
        norm_eps: RMSNorm epsilon.
    """

    kind = "mamba"

    def __init__(self, d_model: int, mixer: Mixer, norm_eps: float = 1e-5) -> None:
        super().__init__(mixer, "norm", nn.RMSNorm(d_model, eps=norm_eps))
        self.block_output = Site("block_output")


class PreNormBlock(Block):
    """Pre-norm block of given parts: x + mixer(norm1(x)), then + mlp(norm2(.)): the blocks of
    pretrained models (GPT-2's: LayerNorms and a GELU MLP; Llama's and flash-linear-attention's:
    RMSNorms and a gated MLP). The zoo's Transformer block is this with its own parts.

    Args:
        mixer: the sequence mixer, (B, L, d_model) -> (B, L, d_model).
        norm1: the norm before the mixer.
        norm2: the norm before the MLP.
        mlp: the feed-forward block, (B, L, d_model) -> (B, L, d_model), acting on each
            position alone.
    """

    kind = "pre_norm"
    sites_after_mixer = ("mlp_input", "mlp_output", "block_output")

    def __init__(self, mixer: Mixer, norm1: nn.Module, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__(mixer, "norm1", norm1)
        self.norm2 = norm2
        self.mlp_input = Site("mlp_input")
        self.mlp = mlp
        self.mlp_output = Site("mlp_output")
        self.block_output = Site("block_output")

    def after_mixer(self, residual: torch.Tensor) -> torch.Tensor:
        """+ MLP(norm2(residual))."""
        return residual + self.mlp_output(self.mlp(self.mlp_input(self.norm2(residual))))


# The class of each block kind the registry names (mecheval.models.registry.BLOCKS).
BLOCK_CLASSES = dict(zip(BLOCKS, (TransformerBlock, MambaBlock), strict=True))


def _check_mixer(mixer: object) -> None:
    if not isinstance(mixer, Mixer):
        raise TypeError(
            f"a block's mixer must be a mecheval.layers.Mixer, got {type(mixer).__name__} "
            "(derive from Mixer: a forward(x) is enough)"
        )
    clash = sorted(set(mixer.sites()) & set(BLOCK_SITES))
    if clash:
        raise MixerError(f"{type(mixer).__name__} has sites named as its block's: {clash}")


def _mix(block, residual, h, resume: Resume | None, at: torch.Tensor | None) -> torch.Tensor:
    """residual + the mixer's output on h, at `at` alone (see the blocks' forward); a mixer
    that reads out at positions (mecheval.layers.mixer) is asked for those alone, while
    nobody looks at its output."""
    mixer: Mixer = block.mixer
    kwargs = {"resume": resume} if mixer.resumable else {}
    if resume is not None and not mixer.resumable:
        raise ValueError(f"{type(mixer).__name__} is not resumable")
    reads_out = mixer.reads_out_at and not mixer._forward_hooks and block.mixer_output.idle
    if at is not None and reads_out:
        return pick(residual, at) + block.mixer_output(mixer(h, at=at, **kwargs))
    return pick(residual + block.mixer_output(mixer(h, **kwargs)), at)


def _idle(*sites: Site) -> bool:
    """No intervention plan and no hooks on these sites: nobody looks at their activations."""
    return all(s.idle for s in sites)


def build_block(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Block `layer_idx` of the model `config` describes, its mixer built by the registry."""
    block = BLOCK_CLASSES[config.block_kind(layer_idx)]
    return block(config.d_model, config.mixer(layer_idx))
