"""Blocks: a sequence mixer wrapped with norms, residual adds and (except Mamba and Mamba-2) an MLP.

Every block's `forward` takes the residual stream (B, L, d_model) as its first positional
argument and returns the new residual stream, so forward hooks on blocks see the stream.

Block sites (`Site` submodules, named as the attributes below):
    block_input   the residual stream entering the block
    mixer_input   the normalised stream the mixer reads
    mixer_output  the mixer's output, before the residual add
    mlp_input     the normalised stream the MLP reads         (Transformer blocks only)
    mlp_output    the MLP's output, before the residual add   (Transformer blocks only)
    block_output  the residual stream leaving the block
plus the sites inside the mixer (conv_input, state, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from mecheval.layers import (
    H3,
    MLP,
    BaseConv,
    BasedLinearAttention,
    CausalSelfAttention,
    DeltaNet,
    GatedDeltaNet,
    Hyena,
    Mamba,
    Mamba2,
    Site,
)
from mecheval.layers.resume import Resume, pick
from mecheval.models.config import ModelConfig

# Architectures built of Mamba blocks (a mixer, no MLP), initialised with mamba-ssm's scheme.
MAMBA_BLOCK_ARCHS = ("mamba", "mamba_noconv", "mamba2", "mamba2_noconv")


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + mixer(LN(x)), then + MLP(LN(.)) with hidden 4 d and GELU.
    LayerNorms and MLP have biases, as zoology's TransformerBlock.

    Args:
        d_model: residual width.
        mixer: the sequence mixer, (B, L, d_model) -> (B, L, d_model).
    """

    def __init__(self, d_model: int, mixer: nn.Module) -> None:
        super().__init__()
        self.block_input = Site("block_input")
        self.norm1 = nn.LayerNorm(d_model)
        self.mixer_input = Site("mixer_input")
        self.mixer = mixer
        self.mixer_output = Site("mixer_output")
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp_input = Site("mlp_input")
        self.mlp = MLP(d_model, hidden_mult=4)
        self.mlp_output = Site("mlp_output")
        self.block_output = Site("block_output")

    def forward(
        self,
        residual: torch.Tensor,
        resume: Resume | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual: (B, L, d_model) -> (B, L, d_model); `resume`: the mixer's context
        (mecheval.layers.resume), None for a whole sequence; `keep`: (B,) one position per
        row, the only one whose output is needed (the MLP then runs there alone and the block
        returns (B, 1, d_model); only while the sites after the mixer are idle, see
        `after_mixer_idle`)."""
        residual = self.block_input(residual)
        h = self.mixer_input(self.norm1(residual))
        residual = _mix(self, residual, h, resume, keep)
        h = self.mlp_output(self.mlp(self.mlp_input(self.norm2(residual))))
        return self.block_output(residual + h)

    def after_mixer_idle(self) -> bool:
        """Whether no plan or hook looks at the sites after the mixer, nor at the output."""
        return not self._forward_hooks and _idle(self.mlp_input, self.mlp_output, self.block_output)


class MambaBlock(nn.Module):
    """Mamba block: x + Mamba(RMSNorm(x)), no MLP.

    Args:
        d_model: residual width.
        mixer: the Mamba layer.
        norm_eps: RMSNorm epsilon.
    """

    def __init__(self, d_model: int, mixer: nn.Module, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.block_input = Site("block_input")
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.mixer_input = Site("mixer_input")
        self.mixer = mixer
        self.mixer_output = Site("mixer_output")
        self.block_output = Site("block_output")

    def forward(
        self,
        residual: torch.Tensor,
        resume: Resume | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual: (B, L, d_model) -> (B, L, d_model); `resume`, `keep` as in
        TransformerBlock."""
        residual = self.block_input(residual)
        h = self.mixer_input(self.norm(residual))
        return self.block_output(_mix(self, residual, h, resume, keep))

    def after_mixer_idle(self) -> bool:
        """Whether no plan or hook looks at the block's output."""
        return not self._forward_hooks and _idle(self.block_output)


def _mix(block, residual, h, resume: Resume | None, keep: torch.Tensor | None) -> torch.Tensor:
    """residual + the mixer's output on h, at `keep` alone (see the blocks' forward); a mixer
    that reads out at positions (mecheval.layers.resume) is asked for those alone, while
    nobody looks at its output."""
    mixer = block.mixer
    reads_out = getattr(mixer, "reads_out_at", False) and not mixer._forward_hooks
    if keep is not None and reads_out and block.mixer_output.idle:
        return pick(residual, keep) + block.mixer_output(mixer(h, resume=resume, at=keep))
    return pick(residual + block.mixer_output(mixer(h, resume=resume)), keep)


def _idle(*sites: Site) -> bool:
    """No intervention plan and no hooks on these sites: nobody looks at their activations."""
    return all(s.idle for s in sites)


def build_mixer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The sequence mixer of layer `layer_idx` for `config` (docs/study.md, "Models").

    base_conv alternates a short conv (even layers) and an implicit long conv (odd layers);
    based alternates a BaseConv short conv (even) and Based linear attention (odd), as zoology
    configures them for the study (so a 1-layer based model is a single BaseConv layer). The
    study's Based ablation: base_conv_long has the implicit long conv in every layer, based_long
    alternates a long-conv BaseConv (even) and Based linear attention (odd).
    """
    arch, d, o = config.arch, config.d_model, config.option
    if arch == "attention":
        return CausalSelfAttention(d, num_heads=o("num_heads"))
    if arch == "base_conv":
        width = o("d_conv") if layer_idx % 2 == 0 else -1
        return BaseConv(d, config.l_max, kernel_size=width, filter_order=o("filter_order"))
    if arch == "base_conv_long":
        return BaseConv(d, config.l_max, kernel_size=-1, filter_order=o("filter_order"))
    if arch in ("based", "based_long"):
        if layer_idx % 2 == 0:
            if arch == "based_long":
                return BaseConv(d, config.l_max, kernel_size=-1, filter_order=o("filter_order"))
            return BaseConv(d, config.l_max, kernel_size=o("d_conv"))
        return BasedLinearAttention(d, feature_dim=o("feature_dim"), num_heads=o("num_heads"))
    if arch == "h3":
        return H3(d, d_state=o("d_state"), head_dim=o("head_dim"))
    if arch == "hyena":
        return Hyena(
            d, config.l_max, filter_order=o("filter_order"), short_filter_order=o("d_conv")
        )
    if arch in ("mamba", "mamba_noconv"):
        return Mamba(
            d,
            d_state=o("d_state"),
            d_conv=o("d_conv") or 4,
            expand=o("expand"),
            layer_idx=layer_idx,
            use_conv=arch == "mamba",
        )
    if arch in ("mamba2", "mamba2_noconv"):
        return Mamba2(
            d,
            d_state=o("d_state"),
            d_conv=o("d_conv") or 4,
            expand=o("expand"),
            headdim=o("head_dim"),
            layer_idx=layer_idx,
            use_conv=arch == "mamba2",
        )
    if arch in ("deltanet", "deltanet_noconv"):
        return DeltaNet(
            d_model=d,
            num_heads=o("num_heads"),
            use_short_conv=arch == "deltanet",
            conv_size=o("d_conv") or 4,
            layer_idx=layer_idx,
        )
    if arch in ("gated_deltanet", "gated_deltanet_noconv"):
        # One value per key dimension (expand_v 1, not fla's 2): DeltaNet's state size.
        heads = o("num_heads")
        if d % heads:
            raise ValueError(f"gated_deltanet: d_model {d} must be divisible by num_heads {heads}")
        return GatedDeltaNet(
            d_model=d,
            head_dim=d // heads,
            num_heads=heads,
            expand_v=1.0,
            use_short_conv=arch == "gated_deltanet",
            conv_size=o("d_conv") or 4,
            layer_idx=layer_idx,
        )
    raise ValueError(f"unknown arch {arch!r}")  # unreachable: ModelConfig validates arch


def build_block(config: ModelConfig, layer_idx: int) -> nn.Module:
    mixer = build_mixer(config, layer_idx)
    if config.arch in MAMBA_BLOCK_ARCHS:
        return MambaBlock(config.d_model, mixer)
    return TransformerBlock(config.d_model, mixer)
