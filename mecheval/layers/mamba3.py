"""Mamba-3 (Lahoti et al. 2026), following mamba-ssm's `Mamba3` (modules/mamba3.py): same
parameter names, shapes and initialisation, so its state dict loads with `strict=True`; with
`A_activation="softplus"` and `bias`, flash-linear-attention's `Mamba3` (layers/mamba3.py) loads
and computes as well (fla takes A = -softplus(.), mamba-ssm a heavier tail).

    z, x, B, C, dd_dt, dd_A, trap, angles = split(u W_in)     no short conv
    A = min(-act(dd_A), -A_floor) ; dt = softplus(dd_dt + dt_bias)       per head and step
    B, C = rmsnorm(B), rmsnorm(C)                                        per rank and group
    y = Mamba-3's scan (mecheval_kernels.mamba3): rotary keys and queries (C + C_bias,
        B + B_bias turned by the cumulative angles), the trapezoidal update of the (P, N) state,
        y = h q + D x, gated by silu(z) (or a gated RMSNorm with is_outproj_norm), MIMO ranks
        summed with mimo_o
    out = y W_out

The scan runs through `mecheval_kernels.mamba3_siso_combined` or `mecheval_kernels.mamba3_mimo`
at positions (mecheval_kernels.at_positions); its state site is the SSM state h. What a run
carries to the next: the angles, the last (rotated) keys and values, and h. Not supported from
mamba-ssm: incremental decoding (`inference_params`), packed sequences.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.mamba2 import RMSNormGated
from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, pick, resumed_from
from mecheval.layers.sites import StateSite
from mecheval.layers.ssm_init import dt_bias, no_weight_decay
from mecheval_kernels.mamba3.reference import rotate


def heavy_tail(x: torch.Tensor) -> torch.Tensor:
    """mamba-ssm's activation of A: 1 + x for x >= 0, 1 / (1 - x) below (positive, smooth)."""
    return x.clamp_min(0) + torch.reciprocal(1 - x.clamp_max(0))


A_ACTIVATIONS = {"heavy_tail": heavy_tail, "softplus": F.softplus}


class Mamba3(Mixer):
    """Mamba-3 mixer.

    Sites: `in_proj_output` (B, L, d_in_proj), u W_in, every projection of one position (z, x,
    B, C, dd_dt, dd_A, trap, angles, in that order; no conv follows it), through which alone
    the input reaches other positions; from it `x` (B, L, d_inner) the values, `B` and `C`
    (B, L, mimo_rank ngroups d_state) the keys and queries after their norms (before their
    biases and rotation), `z` (B, L, d_inner) the gate; `state` (B, nheads, headdim, d_state)
    float32, the SSM state h after a position.

    Args:
        d_model: channels in and out.
        d_state: state size N per head and channel.
        expand: d_inner = expand * d_model.
        headdim: channels P per head; nheads = d_inner / headdim.
        ngroups: groups of B and C, each shared by nheads / ngroups heads.
        rope_fraction: 0.5 or 1.0, the fraction of the state's channels turned.
        dt_min, dt_max, dt_init_floor: range of the initial softplus(dt_bias) (log-uniform).
        A_floor: A <= -A_floor.
        is_outproj_norm: a gated RMSNorm (per head) instead of the plain silu(z) gate.
        is_mimo, mimo_rank: MIMO with mimo_rank ranks (else SISO, rank 1).
        fuse_pregate_headwise_norm: mamba-ssm's kernel choice (the same computation).
        chunk_size: the peers' chunk length; no effect.
        dropout: 0 only (mamba-ssm absorbs it).
        layer_idx, n_layer: the layer's place (kept for reference).
        A_activation (ours): "heavy_tail" (mamba-ssm) or "softplus" (fla).
        bias (ours): biases on in_proj and out_proj (fla's use_bias).
        device, dtype: factory arguments.
    """

    resumable = True
    reads_out_at = True
    local_sites = ("in_proj_output", "x", "B", "C", "z")
    reach_site = "in_proj_output"  # the mixer's input is read by in_proj alone
    readout_sites = {"C": 1, "z": 1}  # queries and gate act at their own position
    # Contexts come from a base run in segments: reading in_proj_output and the states in one
    # pass measured slower (the named grid 4.8 -> 5.5 CPU s, benchmarks/grid_speedups.py).
    context_sites = None

    def __init__(
        self,
        d_model: int,
        d_state: int = 128,
        expand: int = 2,
        headdim: int = 64,
        ngroups: int = 1,
        rope_fraction: float = 0.5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        A_floor: float = 1e-4,
        is_outproj_norm: bool = False,
        is_mimo: bool = False,
        mimo_rank: int = 4,
        fuse_pregate_headwise_norm: bool = True,
        chunk_size: int = 64,
        dropout: float = 0.0,
        layer_idx: int | None = None,
        n_layer: int | None = None,
        A_activation: str = "heavy_tail",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self._check(d_model, expand, headdim, ngroups, rope_fraction, A_activation, dropout)
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.d_inner = expand * d_model
        self.nheads, self.ngroups = self.d_inner // headdim, ngroups
        self.is_mimo, self.mimo_rank = is_mimo, mimo_rank if is_mimo else 1
        self.is_outproj_norm, self.A_floor, self.A_activation = (
            is_outproj_norm,
            A_floor,
            A_activation,
        )
        self.rope_fraction, self.chunk_size, self.layer_idx = rope_fraction, chunk_size, layer_idx
        self.fuse_pregate_headwise_norm = fuse_pregate_headwise_norm
        self.rotary_dim_divisor = int(2 / rope_fraction)
        self.num_rope_angles = (int(d_state * rope_fraction) // 2 * 2) // 2
        if self.num_rope_angles < 1:
            raise ValueError(f"Mamba3: d_state * rope_fraction = {d_state * rope_fraction} turns "
                             "no channel pair")  # fmt: skip
        self._add_parameters(dt_min, dt_max, dt_init_floor, bias, factory)
        self.add_sites(*self.local_sites)
        self.state = StateSite("state")

    @staticmethod
    def _check(d_model, expand, headdim, ngroups, rope_fraction, A_activation, dropout) -> None:
        d_inner = expand * d_model
        if headdim < 1 or d_inner % headdim:
            raise ValueError(f"Mamba3: d_inner = {d_inner} must be a multiple of headdim {headdim}")
        if ngroups < 1 or (d_inner // headdim) % ngroups:
            raise ValueError(f"Mamba3: nheads = {d_inner // headdim} must be a multiple of "
                             f"ngroups {ngroups}")  # fmt: skip
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction must be 0.5 or 1.0, got {rope_fraction}")
        if A_activation not in A_ACTIVATIONS:
            raise ValueError(f"Mamba3: A_activation must be one of {tuple(A_ACTIVATIONS)}, got "
                             f"{A_activation!r}")  # fmt: skip
        if dropout:
            raise ValueError(f"Mamba3: dropout must be 0 (mamba-ssm ignores it), got {dropout}")

    def _add_parameters(self, dt_min, dt_max, dt_init_floor, bias: bool, factory: dict) -> None:
        """mamba-ssm's parameters and initialisation: in_proj in the order [z, x, B, C, dd_dt,
        dd_A, trap, angles]; softplus(dt_bias) log-uniform in [dt_min, dt_max]; B_bias, C_bias
        and D ones; MIMO's x and output projections 1 / rank, its z projection ones."""
        H, R, N = self.nheads, self.mimo_rank, self.d_state
        self.bc_size = N * self.ngroups * R
        sizes = [self.d_inner, self.d_inner, self.bc_size, self.bc_size, H, H, H]
        self.split_sizes = [*sizes, self.num_rope_angles]
        self.in_proj = nn.Linear(self.d_model, sum(self.split_sizes), bias=bias, **factory)
        device = factory["device"]
        self.dt_bias = no_weight_decay(dt_bias(H, dt_min, dt_max, dt_init_floor, device=device))
        self.B_bias = nn.Parameter(torch.ones(H, R, N, device=device))
        self.C_bias = nn.Parameter(torch.ones(H, R, N, device=device))
        self.B_norm = RMSNormGated(N, eps=1e-5, **factory)
        self.C_norm = RMSNormGated(N, eps=1e-5, **factory)
        if self.is_mimo:
            shape = (H, R, self.headdim)
            self.mimo_x = nn.Parameter(torch.full(shape, 1 / R, device=device))
            self.mimo_z = nn.Parameter(torch.ones(shape, device=device))
            self.mimo_o = nn.Parameter(torch.full(shape, 1 / R, device=device))
        self.D = no_weight_decay(torch.ones(H, device=device))
        if self.is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, group_size=self.headdim,
                                     norm_before_gate=True, **factory)  # fmt: skip
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=bias, **factory)

    @property
    def _scan(self):
        return (
            mecheval_kernels.mamba3_mimo if self.is_mimo else mecheval_kernels.mamba3_siso_combined
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        resume: Resume | None = None,
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: (B, L, d_model) -> (B, L, d_model), or (B, 1, d_model) at positions
        `at` (B,). A context is (theta (B, H, A), the last rotated keys (B, R, H, N), the last
        values x (B, H, P), the state h (B, H, P, N))."""
        batch, length, _ = hidden_states.shape
        context = resumed_from(resume, 4)
        arguments, z = self._arguments(hidden_states, None if context[0] is None else context)
        scan_at = functools.partial(mecheval_kernels.at_positions, self._scan, **arguments)
        keep = resume is not None and resume.leave
        result = self.state.scan(scan_at, batch, length, at=at, return_final_state=keep)
        if keep:
            leave_context(resume, *self._carried(arguments, context[0]), result.final_state)
        y = result.out.flatten(-2)
        if self.is_outproj_norm and not self.is_mimo:
            y = self.norm(y, pick(z.flatten(-2), at))
        return self.out_proj(y.to(hidden_states.dtype))

    def _arguments(
        self, hidden_states: torch.Tensor, context: tuple | None
    ) -> tuple[dict, torch.Tensor]:
        """(the scan's arguments by name, z (B, L, H, P))."""
        projected = self.in_proj_output(self.in_proj(hidden_states))
        z, x, B, C, dd_dt, dd_A, trap, angles = projected.split(self.split_sizes, dim=-1)
        x, B, C, z = self.x(x), self.B(B), self.C(C), self.z(z)
        H, R, G, N, P = self.nheads, self.mimo_rank, self.ngroups, self.d_state, self.headdim
        x, z = x.unflatten(-1, (H, P)), z.unflatten(-1, (H, P))
        B, C = self.B_norm(B.unflatten(-1, (R, G, N))), self.C_norm(C.unflatten(-1, (R, G, N)))
        A = -A_ACTIVATIONS[self.A_activation](dd_A.float()).clamp_min(self.A_floor)
        dt = F.softplus(dd_dt + self.dt_bias).float()
        angles = angles.float().unsqueeze(-2).expand(-1, -1, H, -1)
        arguments = dict(V=x, ADT=(A * dt).mT, DT=dt.mT, Trap=trap.mT, Angles=angles, D=self.D)
        if not self.is_mimo:
            states = (
                None if context is None else (context[0], context[3], context[1][:, 0], context[2])
            )
            arguments.update(Q=C[:, :, 0], K=B[:, :, 0], Q_bias=self.C_bias[:, 0],
                             K_bias=self.B_bias[:, 0], Z=None if self.is_outproj_norm else z,
                             Input_States=states)  # fmt: skip
            return arguments, z
        states = None if context is None else (context[0], context[3], context[1], context[2])
        norm = self.norm.weight if self.is_outproj_norm else None
        arguments.update(Q=C, K=B, Q_bias=self.C_bias, K_bias=self.B_bias, MIMO_V=self.mimo_x,
                         MIMO_Z=self.mimo_z, MIMO_Out=self.mimo_o, Z=z, chunk_size=self.chunk_size,
                         rotary_dim_divisor=self.rotary_dim_divisor, dtype=x.dtype,
                         fuse_pregate_headwise_rms_norm=self.is_outproj_norm,
                         outproj_norm_weight=norm, Input_States=states)  # fmt: skip
        return arguments, z

    def _carried(self, arguments: dict, theta: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """(the angles, the last rotated keys (B, R, H, N), the last values (B, H, P)) after the
        last position of a call on `arguments`, continuing from angles `theta` (or zero)."""
        keys = arguments["K"][:, -1]
        keys = keys if self.is_mimo else keys[:, None]
        angles = arguments["Angles"][:, :, 0]  # one rate for every head
        return self._after(arguments["DT"].mT, angles, keys, arguments["V"][:, -1], theta)

    def _after(self, dt, angles, keys, values, theta) -> tuple[torch.Tensor, ...]:
        """The angles, keys and values a context carries, as the scan forms them
        (mecheval_kernels.mamba3.prepare): theta = (theta + the sum of pi tanh(angles) dt) mod
        2 pi (B, H, A), the last keys (B, R, G, N) plus their bias turned by it, the last values
        (B, H, P). dt (B, L', H); angles (B, L', A)."""
        steps = math.pi * torch.tanh(angles.double())[:, :, None] * dt.double()[..., None]
        total = steps.sum(1) if theta is None else steps.sum(1) + theta.double()
        theta = torch.remainder(total, 2 * math.pi).float()
        bias = self.B_bias if self.is_mimo else self.B_bias[:, :1]
        heads = keys.float().repeat_interleave(self.nheads // self.ngroups, dim=-2)
        keys = heads + bias.float().transpose(0, 1)
        pairs = "halves" if self.is_mimo else "pairwise"
        return theta, rotate(keys, theta[:, None], pairs), values

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: h, the angles, the last keys and values."""
        H, N, P = self.nheads, self.d_state, self.headdim
        return H * (P * N + self.num_rope_angles + self.mimo_rank * N + P)
