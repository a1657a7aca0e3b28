"""Sequence mixers and other layers, reusable outside mecheval.

Every mixer derives from `Mixer` (mecheval.layers.mixer: the contract with the models and the
interchange grid); it maps (B, L, d_model) to (B, L, d_model) and runs its short convolutions
and scans through `mecheval_kernels` (the process default backend). Activations the
interventions patch are marked with `Site` / `StateSite` submodules (mecheval.layers.sites).

    Mixer                   the base class: forward and the optional declarations
    RecurrentMixer          short convolutions, then a scan with a state site (Mamba's kind)

    ShortConvolution        fla-style short causal depthwise conv (an nn.Conv1d)
    Mamba                   mamba-ssm's Mamba layer (selective SSM)
    Mamba2                  mamba-ssm's Mamba2 layer (SSD: scalar decay per head)
    Mamba3                  mamba-ssm's Mamba3 layer (trapezoidal, rotary, SISO or MIMO)
    DeltaNet                fla's DeltaNet layer (delta rule)
    GatedDeltaNet           fla's GatedDeltaNet layer (gated delta rule)
    KDA                     fla's KimiDeltaAttention layer (a decay per key channel)
    GatedDeltaProduct       fla's GatedDeltaProduct layer (n delta-rule steps a token)
    Comba                   fla's Comba layer (a recall key read before the decay)
    RWKV7                   fla's RWKV7Attention layer (RWKV-7 time mixing: DPLR delta rule)
    CausalSelfAttention     softmax attention
    GroupedQueryAttention   softmax attention with grouped key/value heads and rotary
                            embeddings (pretrained Transformers': GPT-2's, Llama's)
    BaseConv                gated short or implicit long convolution (zoology)
    BasedLinearAttention    Based's Taylor-feature linear attention (zoology)
    H3                      H3 with shift and diagonal SSMs (zoology)
    Hyena                   Hyena operator of order 2 (zoology)
    MLP                     Linear-GELU-Linear feed-forward
    GatedMLP                down(act(gate(x)) * up(x)) feed-forward (Llama's, fla's)
"""

from mecheval.layers.attention import CausalSelfAttention
from mecheval.layers.base_conv import BaseConv
from mecheval.layers.based import BasedLinearAttention
from mecheval.layers.comba import Comba
from mecheval.layers.delta_net import DeltaNet
from mecheval.layers.gated_delta_net import GatedDeltaNet
from mecheval.layers.gated_deltaproduct import GatedDeltaProduct
from mecheval.layers.grouped_attention import GroupedQueryAttention, Rotary
from mecheval.layers.h3 import H3
from mecheval.layers.hyena import Hyena
from mecheval.layers.kda import KDA
from mecheval.layers.long_conv import ImplicitFilter, ImplicitLongConvolution, long_causal_conv
from mecheval.layers.mamba import Mamba
from mecheval.layers.mamba2 import Mamba2
from mecheval.layers.mamba3 import Mamba3
from mecheval.layers.mixer import Mixer, MixerError
from mecheval.layers.mlp import MLP, GatedMLP
from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.rwkv7 import RWKV7
from mecheval.layers.short_conv import ShortConvolution
from mecheval.layers.sites import Site, SitePlan, StateSite

__all__ = [
    "MLP",
    "RWKV7",
    "H3",
    "BaseConv",
    "BasedLinearAttention",
    "CausalSelfAttention",
    "Comba",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedMLP",
    "GroupedQueryAttention",
    "GatedDeltaProduct",
    "Hyena",
    "ImplicitFilter",
    "ImplicitLongConvolution",
    "KDA",
    "Mamba",
    "Mamba2",
    "Mamba3",
    "Mixer",
    "MixerError",
    "RecurrentMixer",
    "Rotary",
    "ShortConvolution",
    "Site",
    "SitePlan",
    "StateSite",
    "long_causal_conv",
]
