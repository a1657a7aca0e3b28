"""H3, "Hungry Hungry Hippos" (Fu et al. 2023), as zoology builds it.

    q, k, v = u W_q + b_q, u W_k + b_k, u W_v + b_v
    k = shift_ssm(k)                   shift SSM: A = shift, trained B (initially e_1) and C, so
                                       its kernel is K_l = sum_n B[n] C[n + l] (C itself at init):
                                       k'_t = sum_{l < N} K_l k_{t-l} + D_shift k_t
    kv = k (x) v per head              head_dim x head_dim outer product per head and position
    y = diag_ssm(kv)                   S4D-Lin kernel per head, bilinear discretisation, skip D
    o_t = sum_i q_t[i] y_t[i, :]       contract with q per head
    out = o W_out + b_out

The study sets the state size N to its sizing length, 1024 (zoology's note: this makes H3
equivalent to Hyena-like long convolutions), head_dim 2. The diagonal SSM has N // 2 complex
modes, as S4D: the real kernel is 2 Re(sum_n C_n dB_n dA_n^l).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
from torch import nn

from mecheval.layers.long_conv import cached_taps, resumed_long_conv
from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, pick, resumed_from
from mecheval.layers.ssm_init import log_uniform_log


class H3(Mixer):
    """H3 mixer.

    Sites: `conv_input` / `conv_output` (B, L, d_model), k before and after the shift SSM;
    `long_conv_input` / `long_conv_output` (B, L, H * head_dim^2 = d_model * head_dim), the
    per-head products k v^T before and after the diagonal SSM (flattened as (head, i, j)).

    Args:
        d_model: channels in and out.
        d_state: state size N of both SSMs (shift: N taps; diagonal: N // 2 complex modes).
        head_dim: head size; heads H = d_model // head_dim.
        dt_min, dt_max: range of the diagonal SSM's initial step sizes (log-uniform).
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        head_dim: int = 1,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
    ) -> None:
        super().__init__()
        if d_model % head_dim:
            raise ValueError(f"d_model {d_model} must be divisible by head_dim {head_dim}")
        if d_state < 2:
            raise ValueError(f"d_state must be >= 2 (N // 2 complex modes), got {d_state}")
        self.d_model, self.d_state, self.head_dim = d_model, d_state, head_dim
        self.num_heads = H = d_model // head_dim
        modes = d_state // 2
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        # Shift SSM: B starts as e_1 (so the kernel starts as C); C is initialised like a
        # depthwise Conv1d of width N.
        bound = 1 / math.sqrt(d_state)
        self.shift_B = nn.Parameter(torch.zeros(d_model, d_state))
        with torch.no_grad():
            self.shift_B[:, 0] = 1.0
        self.shift_C = nn.Parameter(torch.empty(d_model, d_state).uniform_(-bound, bound))
        self.shift_D = nn.Parameter(torch.randn(d_model))
        # Diagonal SSM (S4D-Lin): A_n = -exp(inv_A_real) + i A_imag, A_n = -1/2 + i pi n.
        self.log_dt = nn.Parameter(log_uniform_log(H, dt_min, dt_max))
        self.inv_A_real = nn.Parameter(torch.full((H, modes), math.log(0.5)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(modes, dtype=torch.float32).repeat(H, 1))
        self.B = nn.Parameter(torch.view_as_real(torch.ones(H, modes, dtype=torch.cfloat)).clone())
        self.C = nn.Parameter(torch.view_as_real(torch.randn(H, modes, dtype=torch.cfloat)))
        self.D = nn.Parameter(torch.randn(H))
        self.output_linear = nn.Linear(d_model, d_model)
        self.add_sites("conv_input", "conv_output", "long_conv_input", "long_conv_output")

    # Declarations (mecheval.layers.mixer). Context: every past input of the shift SSM
    # (B, P, d_model) and of the diagonal SSM (B, P, H head_dim^2), both run as long
    # convolutions.
    resumable = True
    reads_out_at = True
    local_sites = ("conv_input",)  # k_proj of one position
    conv_sites = ("conv_output",)  # the shift SSM: a short conv of k
    readout_sites = MappingProxyType({"long_conv_output": 1})  # read out by q at its position
    context_sites = ("conv_input", "long_conv_input")

    def context_from(self, values: dict, point: int, index: int) -> tuple:
        """See mecheval.layers.mixer: both SSMs' inputs before `point`."""
        return values["conv_input"][:, :point], values["long_conv_input"][:, :point]

    def shift_kernel(self, length: int) -> torch.Tensor:
        """The shift SSM's convolution kernel, (min(length, N), d_model) float32:
        K_l = sum_n B[n] C[n + l] (C zero beyond N), a cross-correlation taken by FFT."""
        n = 2 * self.d_state
        B_f = torch.fft.rfft(self.shift_B.float(), n=n)
        C_f = torch.fft.rfft(self.shift_C.float(), n=n)
        k = torch.fft.irfft(B_f.conj() * C_f, n=n)[:, : min(self.d_state, length)]
        return k.transpose(0, 1)

    def diagonal_kernel(self, length: int) -> torch.Tensor:
        """The diagonal SSM's convolution kernel, (length, H) float32.

        Bilinear discretisation: dA = (1 + dt A / 2) / (1 - dt A / 2), dB = dt B / (1 - dt A / 2);
        K[l] = 2 Re(sum_n C_n dB_n dA_n^l). The (H, modes, length) powers are taken in real
        arithmetic, dA^l = |dA|^l (cos l arg dA + i sin l arg dA): complex autograd over them
        costs thousands of small operations per step.
        """
        dt = torch.exp(self.log_dt.float())[:, None]  # (H, 1)
        A = torch.complex(-torch.exp(self.inv_A_real.float()), self.A_imag.float())
        dtA = dt * A
        dA = (1 + dtA / 2) / (1 - dtA / 2)
        dB = torch.view_as_complex(self.B.float()) * dt / (1 - dtA / 2)
        CB = torch.view_as_complex(self.C.float()) * dB  # (H, modes)
        steps = torch.arange(length, device=dt.device, dtype=torch.float32)
        log_dA = torch.log(dA)
        decay = torch.exp(log_dA.real[..., None] * steps)  # |dA|^l, (H, modes, length)
        angle = log_dA.imag[..., None] * steps
        terms = CB.real[..., None] * torch.cos(angle) - CB.imag[..., None] * torch.sin(angle)
        K = 2 * (terms * decay).sum(1)  # (H, length)
        return K.transpose(0, 1)

    def _diagonal_taps(self, length: int) -> torch.Tensor:
        """The diagonal kernel per (head, i, j) channel, (length, H head_dim^2)."""
        return self.diagonal_kernel(length).repeat_interleave(self.head_dim**2, dim=1)

    def forward(
        self, u: torch.Tensor, resume: Resume | None = None, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """u: (B, L, d_model) -> (B, L, d_model), or (B, 1, d_model) at positions `at` (B,)."""
        B, L, d = u.shape
        H, P = self.num_heads, self.head_dim
        k_before, kv_before = resumed_from(resume, 2)
        q, k, v = self.q_proj(u), self.k_proj(u), self.v_proj(u)
        k = self.conv_input(k)
        shifted, k_inputs = resumed_long_conv(
            k, k_before, lambda n: cached_taps(self, "shift", n, self.shift_kernel)
        )
        k = self.conv_output(shifted + k * self.shift_D)
        kv = k.view(B, L, H, P, 1) * v.view(B, L, H, 1, P)  # (B, L, H, i, j)
        kv = self.long_conv_input(kv.reshape(B, L, H * P * P))
        read = at if self.long_conv_output.idle else None  # else every position, then picked
        y, kv_inputs = resumed_long_conv(
            kv, kv_before, lambda n: cached_taps(self, "diagonal", n, self._diagonal_taps), read
        )
        leave_context(resume, k_inputs, kv_inputs)
        kv, q = pick(kv, read), pick(q, read)
        L = y.shape[1]
        y = y + kv * self.D.repeat_interleave(P * P)
        y = self.long_conv_output(y).view(B, L, H, P, P)
        # o[..., j] = sum_i q_i y[..., i, j], as P multiply-adds: a reduction over the short
        # axis i costs several times more (H3's head_dim is 2).
        q = q.view(B, L, H, P)
        o = q[..., 0, None] * y[..., 0, :]  # (B, L, H, j)
        for i in range(1, P):
            o = o + q[..., i, None] * y[..., i, :]
        out = self.output_linear(o.reshape(B, L, d))
        return out if read is not None else pick(out, at)

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the shift SSM's N taps per channel and the diagonal
        SSM's N // 2 complex modes per (head, i, j). (zoology counts only d_model * N.)"""
        modes = self.d_state // 2
        return self.d_model * self.d_state + self.num_heads * self.head_dim**2 * 2 * modes
