"""The delta-rule family's drop-in arguments beyond the recurrence itself, as
flash-linear-attention 0.6.0 takes them: how each runs here, and those refused by name.

Run here, on the arguments before the recurrence (so gradients flow through them by autograd):

    use_qk_l2norm_in_kernel      q, k (and Comba's p) L2-normalised over K
    use_beta_sigmoid_in_kernel   beta <- sigmoid(beta), or 2 sigmoid(beta) with allow_neg_eigval
                                 (write strengths in (0, 2): negative eigenvalues)
    use_gate_in_kernel           g is the raw gate input: g <- -exp(A_log) softplus(g + dt_bias),
                                 or lower_bound * sigmoid(exp(A_log) (g + dt_bias)) with
                                 lower_bound (KDA; A_log None: lower_bound * sigmoid(g + dt_bias))
    state_v_first                initial and final states in the (V, K) layout
    GVA                          v (and g, beta, states) with HV heads, a multiple of q's H:
                                 q, k (and p) shared by HV / H value heads each
    chunk_size, disable_recompute, safe_gate   how fla's kernels run; checked as fla checks them,
                                 the result here does not depend on them

Refused by name at anything but their defaults: packed sequences (cu_seqlens, cu_seqlens_cpu,
chunk_indices), context parallelism (cp_context), fla's inference-only per-chunk states
(return_intermediate_states) and CUDA-graph mode (use_graph, max_num_seqs); `head_first`, which
fla 0.6 removed; and any keyword fla's op does not read.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels.delta_rule.reference import l2_normalize

PACKED = "mecheval's ops run equal-length sequences in the (batch, ...) layout"
# name -> (the only value that runs, why)
UNSUPPORTED = {
    "cu_seqlens": (None, PACKED),
    "cu_seqlens_cpu": (None, PACKED),
    "chunk_indices": (None, PACKED),
    "cp_context": (None, "context parallelism (a sequence split over devices) is not implemented"),
    "return_intermediate_states": (
        False,
        "fla's per-chunk inference states are not returned; mecheval_kernels.at_positions gives "
        "the states after any positions",
    ),
    "use_graph": (False, "fla's CUDA-graph mode is not implemented"),
    "max_num_seqs": (None, "it belongs to use_graph, which is not implemented"),
}


class Options(NamedTuple):
    """What a call asks beyond the recurrence (see the module docstring)."""

    l2norm: bool = False
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None
    state_v_first: bool = False


def refuse(public: str, arguments: dict) -> None:
    """Refuse, by name, the arguments that run only at their default here."""
    for name, (default, why) in UNSUPPORTED.items():
        value = arguments.get(name, default)
        if value is default or (not isinstance(value, torch.Tensor) and value == default):
            continue
        shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{public}: {name}={shown} is not supported (pass {default!r}): {why}")


def options(public: str, arguments: dict, kwargs: frozenset, chunk_sizes: tuple) -> Options:
    """The call's options from the public function's arguments by name (`kwargs` the names its
    **kwargs may hold, `chunk_sizes` the chunk sizes fla's op accepts); bad ones refused."""
    refuse(public, arguments)
    extra = dict(arguments.get("kwargs") or {})
    if "head_first" in extra:
        raise ValueError(
            f"{public}: head_first was removed in flash-linear-attention 0.6: inputs are "
            "(B, T, H, ...)"
        )
    unknown = sorted(set(extra) - kwargs)
    if unknown:
        raise TypeError(f"{public}() got an unexpected keyword argument {unknown[0]!r}")
    state_v_first = bool(arguments.get("state_v_first", False))
    if "transpose_state_layout" in extra:
        if state_v_first:
            raise ValueError(
                f"{public}: pass state_v_first or the deprecated transpose_state_layout, not both"
            )
        warnings.warn("transpose_state_layout is deprecated: pass state_v_first", stacklevel=4)
        state_v_first = bool(extra["transpose_state_layout"])
    chunk = extra.get("chunk_size", chunk_sizes[-1] if chunk_sizes else None)
    if chunk not in chunk_sizes and chunk is not None:
        raise ValueError(f"{public}: chunk_size must be one of {chunk_sizes}, got {chunk!r}")
    sigmoid = bool(arguments.get("use_beta_sigmoid_in_kernel", False))
    neg = bool(arguments.get("allow_neg_eigval", False))
    if neg and not sigmoid:
        raise ValueError(
            f"{public}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"
        )
    gate = bool(arguments.get("use_gate_in_kernel", extra.get("use_gate_in_kernel", False)))
    return Options(
        l2norm=bool(arguments.get("use_qk_l2norm_in_kernel", False)),
        beta_sigmoid=sigmoid,
        neg_eigval=neg,
        gate_in_kernel=gate,
        A_log=extra.get("A_log") if gate else None,
        dt_bias=extra.get("dt_bias") if gate else None,
        lower_bound=arguments.get("lower_bound") if gate else None,
        state_v_first=state_v_first,
    )


def check_gate_options(public: str, o: Options, g: torch.Tensor, per_key: bool, safe: bool):
    """The gate-in-kernel parameters: A_log (HV,), dt_bias (HV,) or (HV * K,) for a per-key
    gate, lower_bound (KDA) in [-5, 0) with safe_gate, as fla requires."""
    if not o.gate_in_kernel:
        return
    HV = g.shape[2]
    width = HV * g.shape[3] if per_key else HV
    if o.A_log is None and o.lower_bound is None:
        raise ValueError(f"{public}: use_gate_in_kernel=True needs A_log (a tensor of {HV})")
    for name, t, n in (("A_log", o.A_log, HV), ("dt_bias", o.dt_bias, width)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.numel() != n):
            raise ValueError(
                f"{public}: {name} must be a tensor of {n} elements, got "
                f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}"
            )
        if t is not None and t.device != g.device:
            raise ValueError(f"{public}: {name} must be on g's device {g.device}, got {t.device}")
    if safe and o.lower_bound is None:
        raise ValueError(f"{public}: safe_gate=True with use_gate_in_kernel=True needs lower_bound")
    if safe and not -5 <= o.lower_bound < 0:
        raise ValueError(f"{public}: lower_bound must be in [-5, 0), got {o.lower_bound}")


def gate(g: torch.Tensor, o: Options) -> torch.Tensor:
    """The log decays from the raw gate input g (B, T, HV) or (B, T, HV, K), in float32
    (float64 for float64 input)."""
    shape, dtype = g.shape[2:], _at_least_float32(g)
    x = g.to(dtype)
    if o.dt_bias is not None:
        x = x + o.dt_bias.to(dtype).view(shape)
    a = None if o.A_log is None else o.A_log.to(dtype).exp().view(-1, *([1] * (len(shape) - 1)))
    if o.lower_bound is not None:
        return o.lower_bound * torch.sigmoid(x if a is None else a * x)
    return -a * F.softplus(x)


def write_strength(beta: torch.Tensor, o: Options) -> torch.Tensor:
    """beta, or (2) sigmoid(beta) computed in float32 (float64) and returned in beta's dtype."""
    if not o.beta_sigmoid:
        return beta
    scaled = torch.sigmoid(beta.to(_at_least_float32(beta))) * (2.0 if o.neg_eigval else 1.0)
    return scaled.to(beta.dtype)


def _at_least_float32(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def normalised(t: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor | None:
    return None if t is None else l2_normalize(t.to(compute)).to(t.dtype)


def shared_heads(t: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """GVA: q, k or p (B, T, H, K) repeated for the HV = H * groups value heads."""
    return t if t is None or groups == 1 else t.repeat_interleave(groups, dim=2)


def state_in(state: torch.Tensor | None, o: Options) -> torch.Tensor | None:
    """An initial state in (or a patch's values to) the (K, V) layout the op runs in."""
    return state.transpose(-1, -2) if state is not None and o.state_v_first else state


state_out = state_in  # the same transposition, back to the caller's layout
