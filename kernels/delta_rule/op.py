"""`chunk_delta_rule`: the public delta-rule op, its custom-op registration and autograd.

The op is registered with torch.library so that `torch.compile(fullgraph=True)` treats it as one
opaque node with a registered backward. Which implementation runs is decided per call by
`kernels.backend` and, on the Triton backend, which kernel by the sequence length: the fused
recurrent kernel up to `RECURRENT_MAX_LEN` steps (short sequences, single-step decoding), the
chunked kernels above it. Both choices reach the custom op as strings.

The forward op also returns what the backward needs from the forward (the chunks' start
states, u rows and triangular inverses; the recurrent kernel keeps only the u rows), as extra
outputs that the autograd glue saves for the backward op.
"""

from __future__ import annotations

import math

import torch

from kernels.backend import resolve_backend
from kernels.delta_rule import torch_path
from kernels.delta_rule.reference import l2_normalize
from kernels.validation import allowed_dtypes, check_range, check_same_device, check_tensor

OP = "chunk_delta_rule"
MAX_HEAD_DIM = 256
# The Triton backend runs the fused recurrent kernel for T <= this, the chunked kernels above.
RECURRENT_MAX_LEN = 64


def kernel_for(backend: str, T: int) -> str:
    """The kernel that runs T steps: "recurrent" or "chunked" (the PyTorch path is chunked)."""
    return "recurrent" if backend == "triton" and T <= RECURRENT_MAX_LEN else "chunked"


def _impl(backend: str):
    if backend == "triton":
        from kernels.delta_rule import triton_kernels

        return triton_kernels
    return torch_path


def _state_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("mecheval::delta_rule_fwd", mutates_args=())
def _delta_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    backend: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    o, final, saved = _impl(backend).forward(
        q, k, v, beta, scale, initial_state, output_final_state, kernel
    )
    if final is None:
        final = q.new_empty(0, dtype=_state_dtype(q))
    return (o, final, *saved)


@_delta_fwd.register_fake
def _(q, k, v, beta, initial_state, scale, output_final_state, backend, kernel):
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = q.new_empty(B, T, H, V)
    if output_final_state:
        final = q.new_empty(B, H, K, V, dtype=_state_dtype(q))
    else:
        final = q.new_empty(0, dtype=_state_dtype(q))
    return (o, final, *_impl(backend).empty_saved(q, v, kernel))


@torch.library.custom_op("mecheval::delta_rule_bwd", mutates_args=())
def _delta_bwd(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    saved_a: torch.Tensor,
    saved_b: torch.Tensor,
    saved_c: torch.Tensor,
    scale: float,
    backend: str,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbeta, dinit = _impl(backend).backward(
        do, dfinal, q, k, v, beta, scale, initial_state, (saved_a, saved_b, saved_c), kernel
    )
    layouts = (q, k, v, beta)
    dq, dk, dv, dbeta = (_like(g, t) for g, t in zip((dq, dk, dv, dbeta), layouts, strict=True))
    # Custom ops return tensors only: an absent initial_state gets an empty placeholder.
    dinit = q.new_empty(0) if dinit is None else _like(dinit, initial_state)
    return dq, dk, dv, dbeta, dinit


def _like(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`grad` in t's dtype and in the strides of `torch.empty_like(t)`."""
    target = torch.empty_like(t)
    if grad.dtype == t.dtype and grad.stride() == target.stride():
        return grad
    return target.copy_(grad)


@_delta_bwd.register_fake
def _(do, dfinal, q, k, v, beta, initial_state, saved_a, saved_b, saved_c, scale, backend, kernel):
    dinit = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(beta),
        dinit,
    )


def _setup_context(ctx, inputs, output):
    q, k, v, beta, initial_state, scale, output_final_state, backend, kernel = inputs
    o, final, saved_a, saved_b, saved_c = output
    ctx.mark_non_differentiable(saved_a, saved_b, saved_c)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, initial_state, saved_a, saved_b, saved_c)
    ctx.scale, ctx.backend, ctx.kernel = scale, backend, kernel
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dfinal, *_saved_grads):
    q, k, v, beta, initial_state, saved_a, saved_b, saved_c = ctx.saved_tensors
    if do is None:  # only the final state reached the loss
        do = q.new_zeros(*q.shape[:3], v.shape[-1])
    if not ctx.output_final_state:
        dfinal = None
    dq, dk, dv, dbeta, dinit = _delta_bwd(
        do,
        dfinal,
        q,
        k,
        v,
        beta,
        initial_state,
        saved_a,
        saved_b,
        saved_c,
        ctx.scale,
        ctx.backend,
        ctx.kernel,
    )
    return dq, dk, dv, dbeta, None if initial_state is None else dinit, None, None, None, None


_delta_fwd.register_autograd(_backward, setup_context=_setup_context)


def _validate(q, k, v, beta, scale, initial_state, backend: str) -> None:
    dtypes = allowed_dtypes(backend)
    sizes: dict[str, int] = {}
    check_tensor(OP, "q", q, "B T H K", sizes, dtypes)
    if sizes["T"] < 1:
        raise ValueError(f"{OP}: q must have at least one position (T >= 1), got T = 0")
    if sizes["H"] < 1:
        raise ValueError(f"{OP}: q must have at least one head (H >= 1), got H = 0")
    check_range(OP, "head dimension K of q and k", sizes["K"], 1, MAX_HEAD_DIM)
    # q, k and v share one dtype (the kernels multiply them together in it).
    check_tensor(OP, "k", k, "B T H K", sizes, (q.dtype,))
    check_tensor(OP, "v", v, "B T H V", sizes, (q.dtype,))
    check_tensor(OP, "beta", beta, "B T H", sizes, dtypes)
    check_range(OP, "head dimension V of v", sizes["V"], 1, MAX_HEAD_DIM)
    if initial_state is not None:
        check_tensor(OP, "initial_state", initial_state, "B H K V", sizes, dtypes)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{OP}: scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{OP}: scale must be finite, got {scale}")


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule (DeltaNet), drop-in for `fla.ops.delta_rule.chunk_delta_rule`.

    Per batch row and head, with a (K, V) state S:
    u_t = beta_t (v_t - S_{t-1}^T k_t); S_t = S_{t-1} + k_t u_t^T; o_t = S_t^T (scale q_t).

    Args:
        q: (B, T, H, K) float32/float16/bfloat16 (float64 on the PyTorch path); any strides.
        k: (B, T, H, K), q's dtype.
        v: (B, T, H, V), q's dtype.
        beta: (B, T, H), the write strengths (in [0, 2] for a stable memory).
        scale: the query scale; None means K ** -0.5.
        initial_state: optional (B, H, K, V), the state before the first step (float32
            recommended; any of the float dtypes is accepted and its gradient has its dtype).
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (per token and head) inside the
            op, gradients included.
        backend: "auto", "triton" or "torch"; None uses the process default (kernels.backend).

    Returns:
        o (B, T, H, V) in q's dtype, and the final state (B, H, K, V) in float32 (float64 for
        float64 inputs) or None.
    """
    check_tensor(OP, "q", q, "B T H K", {})
    tensors = dict(q=q, k=k, v=v, beta=beta, initial_state=initial_state)
    device = check_same_device(
        OP, **{n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    )
    chosen = resolve_backend(OP, backend, device)
    _validate(q, k, v, beta, scale, initial_state, chosen)
    T, K = q.shape[1], q.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        compute = _state_dtype(q)
        q = l2_normalize(q.to(compute)).to(q.dtype)
        k = l2_normalize(k.to(compute)).to(k.dtype)
    kernel = kernel_for(chosen, T)
    o, final, *_ = _delta_fwd(
        q, k, v, beta, initial_state, scale, bool(output_final_state), chosen, kernel
    )
    return o, (final if output_final_state else None)
