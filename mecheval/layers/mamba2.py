"""Mamba-2 (Dao & Gu 2024): the SSD mixer, with mamba-ssm's `Mamba2` parameter names and shapes.

Same constructor, parameter names, shapes and initialisation as `mamba_ssm.modules.mamba2.Mamba2`
(its tensor-parallel `process_group` and a `d_ssm` narrower than d_inner are refused by name), so
its state dict loads with `strict=True`:

    z, xBC, dt = split(u W_in)                 d_inner, d_inner + 2 G N, H   ([z, x, B, C, dt])
    xBC = silu(conv1d(xBC))                    short causal depthwise conv, width d_conv
    x, B, C = split(xBC)                       x (B, L, H, P); B, C (B, L, G, N)
    dt = clamp(softplus(dt + dt_bias), *dt_limit)   (B, L, H), one step size per head
    h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T       A_h = -exp(A_log_h), h_t (P, N) per head
    y_t = h_t C_t + D_h x_t
    y = RMSNorm_groups(y * silu(z)) * norm.weight        (gated RMSNorm, per group of channels)
    out = y W_out

The conv runs through `mecheval_kernels.causal_conv1d_fn`, the scan through
`mecheval_kernels.mamba2_scan` at positions (whichever backend the process default picks;
mecheval_kernels.at_positions); what the model and the grid may use is declared by `RecurrentMixer`
(mecheval.layers.recurrent). No incremental decoding (`inference_params`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.mamba import MambaBase
from mecheval.layers.resume import pick
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class RMSNormGated(nn.Module):
    """mamba-ssm's gated RMSNorm (`mamba_ssm.ops.triton.layernorm_gated.RMSNorm`, no bias):
    norm(x * silu(z)) * weight, or norm(x) * weight * silu(z) with norm_before_gate, each
    group of `group_size` channels normalised on its own, in float32.

    Args:
        hidden_size: channels.
        eps: added to the mean square.
        group_size: channels per group (None: one group).
        norm_before_gate: gate after the norm instead of before it.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.group_size = hidden_size if group_size is None else group_size
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x, z: (..., hidden_size) -> (..., hidden_size) in x's dtype."""
        dtype, x = x.dtype, x.float()
        gate = None if z is None else F.silu(z.float())
        if gate is not None and not self.norm_before_gate:
            x = x * gate
        grouped = x.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)
        out = grouped.flatten(-2) * self.weight.float()
        if gate is not None and self.norm_before_gate:
            out = out * gate
        return out.to(dtype)


class Mamba2(MambaBase):
    """Mamba-2 mixer.

    Sites: `conv_input` / `conv_output` (B, L, d_inner + 2 ngroups d_state), xBC before the
    conv and after conv + SiLU (absent with use_conv=False); `state` (B, nheads, headdim,
    d_state) float32, the SSM state after a position.

    Defaults are mamba-ssm's except d_state and headdim, scaled to the study's widths
    (d_model 64..256): mamba-ssm's d_state 128 and headdim 64 target d_model >= 768, where a
    model has 24+ heads; at d_model 64 headdim 64 would leave two heads (two decay rates), so
    headdim 16 (8 heads at d_model 64) and d_state 64 (the middle of the Mamba-2 paper's MQAR
    state sizes; a state of d_inner x 64 per layer, 4x Mamba's d_inner x 16).

    Args:
        d_model: channels in and out.
        d_state: state size N per head and channel.
        d_conv: short conv width (1..8).
        conv_init: if given, conv weights ~ U(-conv_init, conv_init) (else PyTorch's default).
        expand: d_inner = expand * d_model.
        headdim: channels P per head; nheads = d_inner / headdim.
        ngroups: groups of B and C, each shared by nheads / ngroups heads.
        A_init_range: A = -exp(A_log) starts at minus a uniform draw from this range.
        D_has_hdim: a skip D per channel (d_inner,) instead of per head (nheads,).
        rmsnorm: gated RMSNorm after the scan (else the scan gates with silu(z), no norm).
        norm_before_gate: the norm's order (mamba-ssm's default False: norm(y * silu(z))).
        dt_min, dt_max: range of the initial step sizes softplus(dt_bias) (log-uniform).
        dt_init_floor: lower clamp of the initial step sizes.
        bias: whether in_proj and out_proj have biases.
        conv_bias: whether the conv has a bias.
        d_ssm: None (the SSM over all of d_inner), or d_inner itself.
        dt_limit: (low, high) clamp of the step sizes after the softplus.
        chunk_size, use_mem_eff_path, sequence_parallel: accepted for compatibility with
            mamba-ssm; the scan picks its own chunks and kernels are picked by the
            `mecheval_kernels` backend, so no effect.
        process_group: None only (no tensor parallelism).
        layer_idx, use_conv, device, dtype: as `Mamba` takes them (use_conv False: no conv,
            only its SiLU, as mecheval's mamba_noconv does for Mamba).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        headdim: int = 16,
        d_ssm: int | None = None,
        ngroups: int = 1,
        A_init_range: tuple[float, float] = (1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 256,
        use_mem_eff_path: bool = True,
        layer_idx: int | None = None,
        process_group: object | None = None,
        sequence_parallel: bool = True,
        use_conv: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_model, d_state, d_conv, expand, layer_idx, use_conv)
        if process_group is not None:
            raise ValueError("Mamba2: process_group (tensor parallelism) is not supported")
        if d_ssm is not None and d_ssm != self.d_inner:
            raise ValueError(
                f"Mamba2: d_ssm = {d_ssm} below d_inner = {self.d_inner} (a gated MLP beside the "
                "SSM) is not supported; leave it None"
            )
        factory = {"device": device, "dtype": dtype}
        if self.d_inner % headdim:
            raise ValueError(f"d_inner = {self.d_inner} must be divisible by headdim {headdim}")
        self.headdim, self.nheads, self.ngroups = headdim, self.d_inner // headdim, ngroups
        if self.nheads % ngroups:
            raise ValueError(f"nheads = {self.nheads} must be divisible by ngroups {ngroups}")
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.chunk_size, self.use_mem_eff_path = chunk_size, use_mem_eff_path
        self.dt_limit, self.sequence_parallel = tuple(dt_limit), sequence_parallel

        # in_proj's order: [z, x, B, C, dt]; the conv reads xBC.
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self._add_input(self.d_inner + conv_dim + self.nheads, conv_dim, bias, conv_bias, **factory)
        if use_conv and conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self._add_ssm(A_init_range, dt_min, dt_max, dt_init_floor, **factory)
        if rmsnorm:
            self.norm = RMSNormGated(
                self.d_inner,
                eps=1e-5,
                group_size=self.d_inner // ngroups,
                norm_before_gate=norm_before_gate,
                **factory,
            )
        self._add_output(bias, **factory)

    def _add_ssm(self, A_init_range, dt_min, dt_max, dt_init_floor, device, dtype) -> None:
        """dt_bias, A_log and D, as mamba-ssm initialises them: softplus(dt_bias) log-uniform
        in [dt_min, dt_max], A = -exp(A_log) minus a uniform draw from A_init_range, D ones."""
        self.dt_bias = no_weight_decay(
            dt_bias(self.nheads, dt_min, dt_max, dt_init_floor, device=device, dtype=dtype)
        )
        if not (0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"A_init_range must be 0 < low <= high, got {A_init_range}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = no_weight_decay(torch.log(A).to(dtype=dtype))
        self.D = no_weight_decay(
            torch.ones(self.d_inner if self.D_has_hdim else self.nheads, device=device)
        )

    # Contexts come from a base run in segments: a pass that also reads the states at every
    # resume point measured slower (the named grid 1.9 -> 2.4 CPU s, benchmarks/grid_speedups.py
    # setup, one thread).
    context_sites = None

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: the SSD scan of x; z gates it inside (no norm) or in the norm
        (aside)."""
        z, xBC, dt = self.in_proj(hidden_states).split(
            [self.d_inner, self.conv_dim, self.nheads], dim=-1
        )
        (xBC,), windows = self.short_convs((xBC,), windows, resume)
        G, N, H, P = self.ngroups, self.d_state, self.nheads, self.headdim
        x, B, C = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        D = self.D.float().view(H, P) if self.D_has_hdim else self.D.float()
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.mamba2_scan,
            x.unflatten(-1, (H, P)),
            dt,
            -torch.exp(self.A_log.float()),
            B.unflatten(-1, (G, N)),
            C.unflatten(-1, (G, N)),
            D=D,
            z=None if self.rmsnorm else z.unflatten(-1, (H, P)),
            dt_bias=self.dt_bias.float(),
            dt_softplus=True,
            dt_limit=self.dt_limit,
            initial_states=state,
        )
        return scan_at, windows, z

    def output(self, out: torch.Tensor, z: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
        y = out.flatten(-2)  # (B, L or 1, d_inner)
        if self.rmsnorm:
            y = self.norm(y, pick(z, at))
        return self.out_proj(y)
