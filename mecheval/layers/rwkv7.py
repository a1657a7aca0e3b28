"""RWKV-7 "Goose" time mixing (Peng et al. 2025), following flash-linear-attention's
`RWKV7Attention`: same constructor, parameter names, shapes and initialisation, so its state dict
loads with `strict=True`.

    d_t = x_{t-1} - x_t                                  token shift (x_{-1} = 0)
    x*_t = x_t + d_t mu_*         for * in r, w, k, v, a, g   (mu_* the x_* parameters)
    r, k, v = x^r W_r, x^k W_k, x^v W_v
    w = -exp(-1/2) sigmoid(lora_w(x^w))                  log decay per key channel, in (-0.61, 0)
    v = lerp(v, v_first, sigmoid(lora_v(x^v)))            value residual (not layer 0; below)
    a = sigmoid(lora_a(x^a)) ; g = lora_g(x^g)           in-context learning rate, output gate
    kk = normalize(k * k_k) per head ; k = k (1 + (a - 1) k_a)
    S_t = diag(exp(w_t)) S_{t-1} - kk_t (kk_t * a_t)^T S_{t-1} + k_t v_t^T    S (K, V) per head
    o_t = S_t^T r_t
    out = ((GroupNorm_heads(o) + sum(r * k * r_k) v) * g) W_o

(lora_* are x -> act(x A) B (+ bias): tanh for w, none for a and v, sigmoid for g.) The state
update runs through `mecheval_kernels.chunk_rwkv7` at positions (a = -kk, b = kk * a).

The value residual mixes in the first layer's values, v_first, a tensor that crosses layers:
a mecheval mixer maps its own input to its output, so the zoo builds every layer without it
(`value_residual=False`, as fla builds layer 0); a layer built with it takes v_first as a
keyword of forward (as fla's does) and refuses to run without. Not supported from fla: `mode`
(the kernel backend decides), padding masks, caches.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.resume import Resume, leave_context, pick, resumed_from
from mecheval.layers.sites import StateSite

DECAY_SCALE = math.exp(-0.5)  # w = -exp(-1/2) sigmoid(.): a decay factor in (0.545, 1) a step
ACTIVATIONS = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, None: nn.Identity}
PROJECTIONS = ("r", "w", "k", "v", "a", "g")


class LoRA(nn.Module):
    """fla's RWKV LoRA: x -> act(x A) B (+ bias), parameters `lora.0.weight` (rank, in),
    `lora.2.weight` (out, rank), `lora.2.bias`; A starts at zero, B orthogonal (gain 0.1 times
    sqrt(rank / out) when rank > out), the bias at zero."""

    def __init__(self, size_in: int, size_out: int, rank: int, activation, bias: bool = True):
        super().__init__()
        self.lora = nn.Sequential(
            nn.Linear(size_in, rank, bias=False),
            ACTIVATIONS[activation](),
            nn.Linear(rank, size_out, bias=bias),
        )
        nn.init.zeros_(self.lora[0].weight)
        gain = math.sqrt(rank / size_out) if rank > size_out else 1.0
        nn.init.orthogonal_(self.lora[2].weight, gain=0.1 * gain)
        if bias:
            nn.init.zeros_(self.lora[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x)


def _rank(given: int | None, hidden: int, per_root: float, factor: float) -> int:
    """fla's default LoRA rank: per_root sqrt(hidden) factor, to a multiple of 32, at least 32."""
    if given is not None:
        return given
    return max(32, int(round(per_root * hidden**0.5 * factor / 32) * 32))


class RWKV7(RecurrentMixer):
    """RWKV-7 time-mixing mixer.

    Sites: `shift_input` (B, L, hidden_size), the input as the token shift reads it (every
    projection reads it at its position and the one before); `r`, `w`, `k`, `v`, `a`, `g` (B, L,
    .), the projections (w the decay's logits lora_w(x^w), so that any patch is a decay; a
    after its sigmoid; k before the key update; v after the value residual); `state` (B, H,
    head_dim, head_v_dim) float32.

    Args:
        mode: fla's kernel choice ("chunk" or "fused_recurrent"); no effect here.
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        head_dim, num_heads: a head's key size, or the number of heads (one is needed).
        decay_low_rank_dim, gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim: LoRA ranks (None:
            fla's defaults from hidden_size).
        elementwise_affine: the output GroupNorm has a weight and a bias.
        norm_eps: the GroupNorm's epsilon per channel (times head_dim).
        layer_idx, num_hidden_layers: the layer's place (both given: RWKV-7's depth-dependent
            initialisation, as fla's).
        fuse_norm: fla's fused GroupNorm (the same computation); accepted.
        value_dim: the values' total size (None: hidden_size).
        value_residual: mix the first layer's values in (fla: every layer but layer 0); None
            follows fla's rule.
        d_model: alias of hidden_size.
    """

    local_sites = ("shift_input",)
    window_sites = {name: 2 for name in PROJECTIONS}
    readout_sites = {"r": 1, "g": 1}
    reach_site = "shift_input"
    # Contexts come from a base run in segments, as the delta rules' do.
    context_sites = None

    def __init__(
        self,
        mode: str = "chunk",
        hidden_size: int = 1024,
        head_dim: int | None = 64,
        num_heads: int | None = None,
        decay_low_rank_dim: int | None = None,
        gate_low_rank_dim: int | None = None,
        a_low_rank_dim: int | None = None,
        v_low_rank_dim: int | None = None,
        elementwise_affine: bool = True,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        fuse_norm: bool = False,
        value_dim: int | None = None,
        num_hidden_layers: int | None = None,
        value_residual: bool | None = None,
        d_model: int | None = None,
    ) -> None:
        super().__init__()
        hidden_size = hidden_size if d_model is None else d_model
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"RWKV7: mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        self._sizes(hidden_size, head_dim, num_heads, value_dim)
        self.layer_idx, self.num_hidden_layers, self.mode = layer_idx, num_hidden_layers, mode
        self.value_residual = layer_idx != 0 if value_residual is None else value_residual
        self.fuse_norm, self.norm_eps = fuse_norm, norm_eps
        self._add_parameters(
            hidden_size, decay_low_rank_dim, gate_low_rank_dim, a_low_rank_dim, v_low_rank_dim
        )
        self.g_norm = nn.GroupNorm(
            self.num_heads, self.value_dim, eps=self.head_dim * norm_eps, affine=elementwise_affine
        )
        self.add_sites("shift_input", *PROJECTIONS)
        self.state = StateSite("state")
        if layer_idx is not None and num_hidden_layers is not None:
            self._initialise(layer_idx, num_hidden_layers)

    def _sizes(self, hidden_size, head_dim, num_heads, value_dim) -> None:
        if head_dim is None and num_heads is None:
            raise ValueError("RWKV7: give head_dim or num_heads")
        if head_dim is not None:
            if head_dim < 1 or hidden_size % head_dim:
                raise ValueError(f"RWKV7: hidden_size {hidden_size} must be a multiple of head_dim "
                                 f"{head_dim}")  # fmt: skip
            num_heads = hidden_size // head_dim
        elif num_heads < 1 or hidden_size % num_heads:
            raise ValueError(f"RWKV7: hidden_size {hidden_size} must be a multiple of num_heads "
                             f"{num_heads}")  # fmt: skip
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim, self.key_dim = hidden_size // num_heads, hidden_size
        self.value_dim = hidden_size if value_dim is None else value_dim
        if self.value_dim % num_heads:
            raise ValueError(f"RWKV7: value_dim {self.value_dim} must be a multiple of num_heads "
                             f"{num_heads}")  # fmt: skip
        self.head_v_dim = self.value_dim // num_heads

    def _add_parameters(self, hidden, decay_rank, gate_rank, a_rank, v_rank) -> None:
        factor = self.head_dim / 64  # fla's ranks grow with heads wider than 64
        for name in PROJECTIONS:
            self.register_parameter(f"x_{name}", nn.Parameter(torch.zeros(1, 1, hidden)))
        self.k_k = nn.Parameter(torch.zeros(self.key_dim))
        self.k_a = nn.Parameter(torch.zeros(self.key_dim))
        self.r_k = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.r_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)
        ranks = dict(
            w=_rank(decay_rank, hidden, 2.5, factor),
            g=_rank(gate_rank, hidden, 5, 1.0),
            a=_rank(a_rank, hidden, 2.5, factor),
            v=_rank(v_rank, hidden, 1.7, factor),
        )
        self.w_lora = LoRA(hidden, self.key_dim, ranks["w"], "tanh")
        if self.value_residual:
            self.v_lora = LoRA(hidden, self.value_dim, ranks["v"], None)
        self.a_lora = LoRA(hidden, self.key_dim, ranks["a"], None)
        self.g_lora = LoRA(hidden, self.value_dim, ranks["g"], "sigmoid", bias=False)
        self.decay_low_rank_dim, self.gate_low_rank_dim = ranks["w"], ranks["g"]
        self.a_low_rank_dim, self.v_low_rank_dim = ranks["a"], ranks["v"]

    @torch.no_grad()
    def _initialise(self, layer: int, layers: int) -> None:
        """RWKV-7's initialisation as fla's layer applies it: token-shift mixes that fall with
        the channel index and with depth, per-channel decays from -6 to 0 (before the
        sigmoid), a zigzag over each head, orthogonal projections, a zero output projection."""
        n = torch.arange(self.hidden_size, dtype=torch.float32)
        deep = layer / max(layers - 1, 1)  # 0 .. 1
        shallow = 1.0 - layer / layers  # 1 .. ~0
        linear = n / (self.hidden_size - 1) - 0.5
        half = (self.head_dim - 1) / 2
        zigzag = ((n % self.head_dim) - half) / half
        zigzag = zigzag * zigzag.abs()
        decay = -6 + 6 * (n / (self.hidden_size - 1)) ** (1 + deep**0.3)
        ramp = (n / self.hidden_size)[None, None]
        for name, power in dict(r=0.2, w=0.9, k=0.7, v=0.7, a=0.9, g=0.2).items():
            getattr(self, f"x_{name}").copy_(1.0 - ramp ** (power * shallow))
        self.k_a.fill_(1.02)
        self.r_k.fill_(-0.04)
        self.k_k.copy_(0.71 - 0.1 * linear)
        self.w_lora.lora[2].bias.copy_(decay + 0.5 + 2.5 * zigzag)
        self.a_lora.lora[2].bias.copy_(-0.19 + 0.3 * zigzag + 0.4 * linear)
        if self.value_residual:
            self.v_lora.lora[2].bias.copy_(0.73 - 0.4 * linear)
        if self.g_norm.weight is not None:
            self.g_norm.weight.fill_(((layer + 1) / layers) ** 0.7)
        for proj, gain in ((self.r_proj, 1.0), (self.k_proj, 0.1), (self.v_proj, 1.0)):
            nn.init.orthogonal_(proj.weight, gain=gain)
        nn.init.zeros_(self.o_proj.weight)

    def context_in(self, resume: Resume | None) -> tuple[tuple, torch.Tensor | None]:
        """((the token shift's last input (B, hidden_size, 1),), the state), None entries for a
        sequence that starts here."""
        window, state = resumed_from(resume, 2)
        return (window,), state

    @staticmethod
    def leave(resume: Resume | None, windows: tuple, state: torch.Tensor | None) -> None:
        leave_context(resume, *windows, state)

    def forward(self, hidden_states, resume=None, at=None, v_first=None) -> torch.Tensor:
        """hidden_states: (B, L, hidden_size) -> (B, L, hidden_size), or (B, 1, hidden_size) at
        positions `at` (B,). v_first (B, L, value_dim): the first layer's values, for a layer
        with the value residual."""
        if self.value_residual and v_first is None:
            raise ValueError(
                f"RWKV7 (layer {self.layer_idx}) mixes in the first layer's values: pass "
                "v_first=, or build it with value_residual=False (as mecheval's models do)"
            )
        self._v_first = v_first
        try:
            return super().forward(hidden_states, resume, at)
        finally:
            self._v_first = None

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: the projections from the token-shifted input, RWKV-7's state
        update; the output reads r, k, v and g (aside)."""
        x = self.shift_input(hidden_states)
        (window,) = windows
        before = x.new_zeros(x.shape[0], 1, x.shape[2]) if window is None else window.mT
        delta = torch.cat([before.to(x.dtype), x[:, :-1]], dim=1) - x
        mixed = {n: x + delta * getattr(self, f"x_{n}") for n in PROJECTIONS}
        r, k, v = self.r_proj(mixed["r"]), self.k_proj(mixed["k"]), self.v_proj(mixed["v"])
        if self.value_residual:
            v = torch.lerp(v, self._v_first, self.v_lora(mixed["v"]).sigmoid())
        a = self.a_lora(mixed["a"]).sigmoid()
        logits = (self.w_lora(mixed["w"]), self.g_lora(mixed["g"]))
        values = (r, logits[0], k, v, a, logits[1])
        r, w, k, v, a, g = (getattr(self, n)(t) for n, t in zip(PROJECTIONS, values, strict=True))
        w = -DECAY_SCALE * w.float().sigmoid()  # from the site's logits: any patch is a decay
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1))  # noqa: E731
        kk = F.normalize(heads(k * self.k_k), dim=-1)
        k = heads(k * (1 + (a - 1) * self.k_a))
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_rwkv7,
            heads(r),
            heads(w),
            k,
            heads(v),
            -kk,
            kk * heads(a),
            scale=1.0,
            initial_state=state,
        )
        keep = resume is not None and resume.leave
        after = x[:, -1:].mT.contiguous() if keep else None
        return scan_at, (after,), (heads(r), k, heads(v), g)

    def output(self, o: torch.Tensor, aside, at: torch.Tensor | None) -> torch.Tensor:
        """o: (B, L or 1, H, head_v_dim)."""
        r, k, v, g = (pick(t.flatten(-2) if t.dim() == 4 else t, at) for t in aside)
        heads = lambda t: t.unflatten(-1, (self.num_heads, -1))  # noqa: E731
        batch, length = o.shape[:2]
        normed = self.g_norm(o.flatten(-2).flatten(0, 1)).view(batch, length, -1)
        bonus = (heads(r) * heads(k) * self.r_k).sum(-1, keepdim=True) * heads(v)
        return self.o_proj((normed + bonus.flatten(-2)) * g)

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the state plus the token shift's last input."""
        return self.num_heads * self.head_dim * self.head_v_dim + self.hidden_size
