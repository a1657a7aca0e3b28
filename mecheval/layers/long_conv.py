"""Long causal convolutions (filters as long as the sequence) and their implicit filters.

Long convolutions run in PyTorch (no kernel: at the study's lengths they are small next to the
projections), as a Toeplitz matmul for short sequences and through the FFT for long ones.

An implicit filter is a small MLP of a positional encoding z(t) of each position t, giving one
filter tap per channel. The study (through zoology) uses two kinds, both laid out for its
sizing length l_max (1024, whatever the document length, so t advances by 1 / (l_max - 1)):
    ImplicitFilter          Hyena's: MLP with sine activations, exponential decay window
    ImplicitLongConvolution BaseConv's long conv: Linear(3, 16), ReLU, Linear(16, C); no window
In both, z is a trained parameter, as it is in the study's training (see docs/deviations.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Up to this length the convolution runs as a (C, L, L) Toeplitz matmul: exactly causal (an
# output never reads a later input, not even through rounding) and faster than the FFT at the
# study's lengths. Longer sequences go through the FFT, whose rounding leaks ~1e-7 of the
# largest input into every output.
DIRECT_MAX_LEN = 128


def long_causal_conv(u: torch.Tensor, k: torch.Tensor, last: int | None = None) -> torch.Tensor:
    """Causal convolution along time, per channel.

    y[b, t, c] = sum_{s = 0..t} k[s, c] * u[b, t - s, c].

    Args:
        u: (B, L, C).
        k: (K, C) filter, K >= 1; taps beyond L are ignored, missing taps count as zero.
        last: compute only the last `last` outputs (None: all L); a resumed segment needs
            only its own positions.

    Returns:
        y (B, last or L, C) in u's dtype (computed in float32, or float64 for float64 inputs).
    """
    batch, L, channels = u.shape
    dtype = u.dtype
    first = 0 if last is None else L - last
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    k = k[:L].to(compute)
    if k.shape[0] < L:
        k = torch.cat([k, k.new_zeros(L - k.shape[0], k.shape[1])])
    u = u.to(compute)
    if L <= DIRECT_MAX_LEN:
        pos = torch.arange(L, device=u.device)
        lag = pos[None, :] - pos[:, None]  # [s, t] -> t - s
        # toeplitz[c, s, t] = k[t - s, c] for s <= t, else 0; contiguous operands keep bmm on
        # its batched path.
        lag = lag[:, first:]  # only the outputs asked for
        toeplitz = k.t()[:, lag.clamp(min=0)].masked_fill(lag < 0, 0.0)  # (C, L, L - first)
        # (B, L, C) <-> (C, B, L) as transposes of a matrix with C columns: on CPU several
        # times faster than copying the 3-d permutation (which was most of a grid's H3 time).
        u_t = u.reshape(batch * L, channels).t().contiguous().view(channels, batch, L)
        y = torch.bmm(u_t, toeplitz)  # (C, B, L - first)
        y = y.view(channels, batch * (L - first)).t().contiguous()
        return y.view(batch, L - first, channels).to(dtype)
    n = 2 * L  # >= L + K - 1: no circular wrap-around into the first L outputs
    u_f = torch.fft.rfft(u, n=n, dim=1)
    k_f = torch.fft.rfft(k, n=n, dim=0)
    return torch.fft.irfft(u_f * k_f, n=n, dim=1)[:, first:L].to(dtype)


def long_causal_conv_at(u: torch.Tensor, k: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """long_causal_conv(u, k)[b, at[b]] for each row b alone, (B, 1, C) in u's dtype: one
    product of the row's inputs with the taps reversed from its position, O(L C) per row."""
    batch, L, channels = u.shape
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    k = k[:L].to(compute)
    if k.shape[0] < L:
        k = torch.cat([k, k.new_zeros(L - k.shape[0], k.shape[1])])
    at = at.to(u.device)
    if bool((at == at[0]).all()):  # one position for every row (a grid's query): shared taps
        at = at[:1]
    lag = at[:, None] - torch.arange(L, device=u.device)  # (B or 1, L): t - s
    reversed_taps = k[lag.clamp(min=0)].masked_fill_((lag < 0)[..., None], 0.0)
    return torch.linalg.vecdot(reversed_taps, u.to(compute), dim=1)[:, None].to(u.dtype)


def cached_taps(module: nn.Module, name: str, length: int, compute) -> torch.Tensor:
    """compute(length), the taps of a filter given by `module`'s parameters, memoised while
    no gradient is recorded: an interchange grid runs the same filter hundreds of times. The
    memo holds the parameters it was computed from and their version counters, so an optimizer
    step, a load_state_dict or a replaced parameter computes the taps again."""
    params = list(module.parameters())
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return compute(length)
    versions = tuple(p._version for p in params)
    memo = module.__dict__.setdefault("_taps_memo", {})
    hit = memo.get(name)
    if hit is not None:
        held, held_versions, held_length, taps = hit
        same = len(held) == len(params) and all(a is b for a, b in zip(held, params, strict=True))
        if same and held_versions == versions and held_length == length:
            return taps
    taps = compute(length)
    memo[name] = (params, versions, length, taps)
    return taps


def resumed_long_conv(
    u: torch.Tensor, before: torch.Tensor | None, filter_fn, at: torch.Tensor | None = None
) -> tuple:
    """A long convolution of inputs that follow `before` (B, P, C; None: the sequence starts
    at u): (the outputs at u's positions (B, L, C), or at positions `at` (B,) of u alone
    (B, 1, C); every input so far (B, P + L, C), the context for the next segment).
    `filter_fn(length)` gives the filter's taps. The convolution runs over the whole
    sequence so far, so its outputs are one run's."""
    full = u if before is None else torch.cat([before.to(u.dtype), u], dim=1)
    taps = filter_fn(full.shape[1])
    if at is not None:
        return long_causal_conv_at(full, taps, at + (full.shape[1] - u.shape[1])), full
    return long_causal_conv(full, taps, last=u.shape[1]), full


def positional_encoding(l_max: int, emb_dim: int = 3) -> torch.Tensor:
    """Hyena's positional encoding z(t), (l_max, emb_dim) float32.

    z(t) = [t / (l_max - 1), cos(f_j w_t), -sin(f_j w_t)], w_t = 2 pi t / l_max, with bands
    f_j = linspace(1e-4, bands - 1, bands), bands = (emb_dim - 1) // 2.
    """
    if emb_dim < 3 or emb_dim % 2 == 0:
        raise ValueError(f"emb_dim must be odd and >= 3, got {emb_dim}")
    t = torch.linspace(0, 1, l_max)[:, None]
    bands = (emb_dim - 1) // 2
    w = 2 * math.pi * torch.arange(l_max, dtype=torch.float32)[:, None] / l_max
    f = torch.linspace(1e-4, bands - 1, bands)[None, :]
    return torch.cat([t, torch.cos(f * w), -torch.sin(f * w)], dim=-1)


class Sin(nn.Module):
    """sin(freq * x) with a learned frequency per feature (Hyena's filter activation).

    Args:
        dim: features.
        frequency: initial frequency.
    """

    def __init__(self, dim: int, frequency: float = 1.0) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.full((1, dim), float(frequency)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.freq * x)


class ImplicitFilter(nn.Module):
    """Hyena's long filter h (L, C), given implicitly by an MLP of position, with decay.

    h(t) = MLP(z(t)) * exp(-|delta_c| t / (l_max - 1)), with z from `positional_encoding` (a
    trained parameter) and decay rates delta_c spread linearly between log(target) /
    slow_decay_pct and log(target) / fast_decay_pct over the channels (a fixed buffer). The MLP
    is Linear(emb_dim, order), Sin, `num_inner_mlps` x (Linear(order, order), Sin),
    Linear(order, C, no bias); one Sin module (one set of frequencies) is shared by all its
    activations, as in Hyena.

    Args:
        channels: C.
        l_max: the sizing length; the encoding is laid out for it and L <= l_max.
        order: MLP width.
        emb_dim: size of z (odd, >= 3).
        num_inner_mlps: hidden Linear+Sin layers after the first.
        frequency: initial Sin frequency.
        fast_decay_pct, slow_decay_pct, target: decay window (Hyena's defaults).
    """

    def __init__(
        self,
        channels: int,
        l_max: int,
        order: int = 64,
        emb_dim: int = 3,
        num_inner_mlps: int = 2,
        frequency: float = 1.0,
        fast_decay_pct: float = 0.3,
        slow_decay_pct: float = 1.5,
        target: float = 1e-2,
    ) -> None:
        super().__init__()
        self.channels, self.l_max, self.order = channels, l_max, order
        self.z = nn.Parameter(positional_encoding(l_max, emb_dim))
        self.register_buffer("t", torch.linspace(0, 1, l_max)[:, None], persistent=False)
        max_decay = math.log(target) / fast_decay_pct
        min_decay = math.log(target) / slow_decay_pct
        self.register_buffer(
            "deltas", torch.linspace(min_decay, max_decay, channels)[None, :], persistent=False
        )
        act = Sin(order, frequency)
        layers: list[nn.Module] = [nn.Linear(emb_dim, order), act]
        for _ in range(num_inner_mlps):
            layers += [nn.Linear(order, order), act]
        layers.append(nn.Linear(order, channels, bias=False))
        self.implicit_filter = nn.Sequential(*layers)

    def forward(self, length: int) -> torch.Tensor:
        """The filter's first `length` taps, (length, C), length <= l_max."""
        _check_length(length, self.l_max)
        return cached_taps(self, "taps", length, self._taps)

    def _taps(self, length: int) -> torch.Tensor:
        h = self.implicit_filter(self.z[:length])
        return h * torch.exp(-self.t[:length] * self.deltas.abs())


class ImplicitLongConvolution(nn.Module):
    """Causal long convolution with an implicit filter, plus the identity: y = h * u + u.

    zoology's `ImplicitLongConvolution` (the long conv of BaseConv): h(t) = MLP(z(t)) with
    MLP = Linear(emb_dim, order), ReLU, Linear(order, C), z from `positional_encoding` (a
    trained parameter), no decay window.

    Args:
        d_model: channels C.
        l_max: the sizing length; the encoding is laid out for it and L <= l_max.
        order: filter MLP width.
        emb_dim: size of z (odd, >= 3).
    """

    def __init__(self, d_model: int, l_max: int, order: int = 16, emb_dim: int = 3) -> None:
        super().__init__()
        self.l_max = l_max
        self.z = nn.Parameter(positional_encoding(l_max, emb_dim))
        self.mlp = nn.Sequential(nn.Linear(emb_dim, order), nn.ReLU(), nn.Linear(order, d_model))

    def filter(self, length: int) -> torch.Tensor:
        """The filter's first `length` taps, (length, C)."""
        _check_length(length, self.l_max)
        return cached_taps(self, "taps", length, lambda n: self.mlp(self.z[:n]))

    def forward(self, u: torch.Tensor, before: torch.Tensor | None = None) -> tuple:
        """u: (B, L, C), after the inputs `before` (B, P, C) or None -> (y (B, L, C), every
        input so far (B, P + L, C), the context to resume from)."""
        y, inputs = resumed_long_conv(u, before, self.filter)
        return y + u, inputs


def _check_length(length: int, l_max: int) -> None:
    if length > l_max:
        raise ValueError(f"sequence length {length} exceeds the filter's l_max={l_max}")
