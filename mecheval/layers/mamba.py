"""Mamba (Gu & Dao 2023): the selective SSM mixer, drop-in for mamba-ssm's `Mamba` layer.

Same constructor arguments, parameter names, shapes and initialisation as
`mamba_ssm.modules.mamba_simple.Mamba`, so its state dict loads with `strict=True` and gives the
same output:

    x, z = split(u W_in)                                  (B, L, d_inner) each
    x = silu(conv1d(x))                                   short causal depthwise conv, width d_conv
    dt, B, C = split(x W_x)                               dt_rank, d_state, d_state
    delta = softplus(dt W_dt + b_dt)                      (B, L, d_inner)
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t        A = -exp(A_log), h_t (d_inner, d_state)
    y_t = (h_t C_t + D x_t) * silu(z_t)
    out = y W_out

The conv runs through `mecheval_kernels.causal_conv1d_fn`, the scan through
`mecheval_kernels.selective_scan_fn` at positions (whichever backend the process default picks;
mecheval_kernels.at_positions); what the model and the grid may use is declared by `RecurrentMixer`
(mecheval.layers.recurrent). No incremental decoding (`inference_params`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.sites import StateSite
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class MambaBase(RecurrentMixer):
    """What Mamba and Mamba-2 share: their sizes (d_inner = expand * d_model), the input
    projection `in_proj`, the optional short conv (width d_conv, SiLU) over `conv_dim` of its
    channels, the output projection `out_proj`, the state site, and the floats they carry
    between tokens. A subclass's constructor calls `_add_input` before its SSM parameters and
    `_add_output` after them, in mamba-ssm's order (which draws mamba-ssm's initial weights).
    """

    def __init__(
        self, d_model: int, d_state: int, d_conv: int, expand: int, layer_idx, use_conv: bool
    ) -> None:
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.layer_idx, self.use_conv, self.activation = layer_idx, use_conv, "silu"

    def _add_input(self, width: int, conv_dim: int, bias: bool, conv_bias: bool, **factory):
        """`in_proj` (d_model -> width) and, with use_conv, the conv over conv_dim of its
        channels (Mamba's x, Mamba-2's xBC; `factory`: device and dtype)."""
        self.conv_dim = conv_dim
        self.in_proj = nn.Linear(self.d_model, width, bias=bias, **factory)
        if self.use_conv:
            channels = {"conv": (conv_dim, "silu")}
            self.add_convs("d_conv", self.d_conv, conv_bias, channels, **factory)

    def _add_output(self, bias: bool, **factory) -> None:
        """`out_proj` (d_inner -> d_model) and the state site."""
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=bias, **factory)
        self.state = StateSite("state")

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the SSM state d_inner * d_state plus the conv's last
        d_conv - 1 inputs of its conv_dim channels. (zoology counts only Mamba's SSM state.)"""
        window = self.d_conv - 1 if self.use_conv else 0
        return self.d_inner * self.d_state + self.conv_dim * window


class Mamba(MambaBase):
    """Mamba mixer.

    Sites: `conv_input` / `conv_output` (B, L, d_inner), x before the conv and after conv +
    SiLU (absent with use_conv=False); `state` (B, d_inner, d_state) float32, the SSM state
    after a position.

    Args:
        d_model: channels in and out.
        d_state: SSM state size N per channel.
        d_conv: short conv width (1..8; mamba-ssm's CUDA conv stops at 4).
        expand: d_inner = expand * d_model.
        dt_rank: rank of the delta projection; "auto" = ceil(d_model / 16).
        dt_min, dt_max: range of the initial step sizes softplus(b_dt) (log-uniform).
        dt_init: "random" (uniform +-dt_rank^-0.5 * dt_scale) or "constant" weights of dt_proj.
        dt_scale: scale of that initialisation.
        dt_init_floor: lower clamp of the initial step sizes.
        conv_bias: whether the conv has a bias.
        bias: whether in_proj and out_proj have biases.
        use_fast_path: accepted for compatibility with mamba-ssm; kernels are picked by the
            `mecheval_kernels` backend instead, so it has no effect.
        layer_idx: index of the layer in its model (kept for reference).
        use_conv: (ours) False drops the conv entirely (no conv1d parameters), keeping only its
            SiLU, the study's "Mamba without conv".
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,
        layer_idx: int | None = None,
        use_conv: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_model, d_state, d_conv, expand, layer_idx, use_conv)
        factory = {"device": device, "dtype": dtype}
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path
        self._add_input(2 * self.d_inner, self.d_inner, bias, conv_bias, **factory)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)

        # Initialise dt_proj so that delta starts with the variance mamba-ssm gives it, and its
        # bias so that softplus(bias) is log-uniform in [dt_min, dt_max].
        dt_init_std = self.dt_rank**-0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, dt_init_std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        else:
            raise ValueError(f"dt_init must be 'random' or 'constant', got {dt_init!r}")
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt_bias(self.d_inner, dt_min, dt_max, dt_init_floor, **factory))
        self.dt_proj.bias._no_reinit = True  # model-level inits leave it alone

        # S4D-real initialisation: A = -(1, 2, ..., N) for every channel; kept in float32.
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = no_weight_decay(torch.log(A))
        self.D = no_weight_decay(torch.ones(self.d_inner, device=device))
        self._add_output(bias, **factory)

    @property
    def reach_site(self) -> str | None:
        """See mecheval.layers.mixer: the input reaches other positions through x alone (z
        gates its own position)."""
        return "conv_input" if self.use_conv else None

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: the selective scan of x, gated by z inside it."""
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, L, d_inner) each
        (x,), windows = self.short_convs((x,), windows, resume)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.linear(dt, self.dt_proj.weight)  # bias added (then softplus) in the scan
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.selective_scan_fn,
            x.transpose(1, 2),  # (B, D, L)
            delta.transpose(1, 2),
            -torch.exp(self.A_log.float()),
            B.transpose(1, 2),  # (B, N, L)
            C.transpose(1, 2),
            self.D.float(),
            z.transpose(1, 2),
            self.dt_proj.bias.float(),
            delta_softplus=True,
            initial_state=state,
        )
        return scan_at, windows, None

    def output(self, out: torch.Tensor, aside: None, at: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(out.transpose(1, 2))
