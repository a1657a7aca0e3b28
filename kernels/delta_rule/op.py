"""The delta-rule family's ops: `chunk_delta_rule` here, `chunk_gated_delta_rule` in
mecheval_kernels.gated_delta_rule, and what both share (their arguments, validation, the custom ops'
fake and vmap rule, the call; the scaffold is mecheval_kernels._op).

The delta rule is the gated delta rule with no gate: both ops take one `DeltaArgs`, whose `g` is
None for the delta rule, and run the same implementations (this package's torch_path and launch),
each under its own custom ops (`mecheval_kernels::delta_rule_fwd`,
`mecheval_kernels::gated_delta_rule_fwd` and their `_bwd`). The forward also returns what the
backward needs from it (the chunks' start states, u rows and triangular inverses; the recurrent
kernel keeps only the u rows), as outputs that the autograd glue keeps for the backward.

On the Triton backend the sequence length picks the delta rule's kernel: the fused recurrent
kernel up to `RECURRENT_MAX_LEN` steps (short sequences, single-step decoding), the chunked
kernels above it. The gated delta rule runs the chunked kernels at every length.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype
from mecheval_kernels.delta_rule.reference import l2_normalize
from mecheval_kernels.stacking import fold_into, is_batched, unfold_from
from mecheval_kernels.validation import check_batch, check_range, check_tensor, refuse_unsupported

MAX_HEAD_DIM = 256
# The Triton backend runs the delta rule's fused recurrent kernel for T <= this, the chunked
# kernels above.
RECURRENT_MAX_LEN = 64


def kernel_for(backend: str, T: int, gated: bool = False) -> str:
    """The kernel that runs T steps: "recurrent" or "chunked" (the PyTorch path is chunked; the
    recurrent kernel has no gate)."""
    recurrent = backend == "triton" and not gated and T <= RECURRENT_MAX_LEN
    return "recurrent" if recurrent else "chunked"


class DeltaArgs(NamedTuple):
    """The custom ops' inputs. `g`: the log decays (B, T, H), or None for the delta rule;
    `kernel`: "recurrent" or "chunked" (see `kernel_for`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    output_final_state: bool
    kernel: str


def _validate(op: str, dtypes, q, k, v, g, beta, scale, initial_state) -> None:
    """Check the inputs' shapes and dtypes, and g's values (finite and <= 0; read on eager
    calls, a device sync) when there is a g; `op` is the public function's name."""
    sizes: dict[str, int] = {}
    check_tensor(op, "q", q, "B T H K", sizes, dtypes)
    check_batch(op, "q", sizes["B"])
    if sizes["T"] < 1:
        raise ValueError(f"{op}: q must have at least one position (T >= 1), got T = 0")
    if sizes["H"] < 1:
        raise ValueError(f"{op}: q must have at least one head (H >= 1), got H = 0")
    check_range(op, "head dimension K of q and k", sizes["K"], 1, MAX_HEAD_DIM)
    # q, k and v share one dtype (the kernels multiply them together in it).
    check_tensor(op, "k", k, "B T H K", sizes, (q.dtype,))
    check_tensor(op, "v", v, "B T H V", sizes, (q.dtype,))
    check_tensor(op, "g", g, "B T H", sizes, dtypes, optional=True)
    check_tensor(op, "beta", beta, "B T H", sizes, dtypes)
    check_range(op, "head dimension V of v", sizes["V"], 1, MAX_HEAD_DIM)
    check_tensor(op, "initial_state", initial_state, "B H K V", sizes, dtypes, optional=True)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{op}: scale must be finite, got {scale}")
    if g is not None:
        _check_decays(op, g)


def _check_decays(op: str, g: torch.Tensor) -> None:
    # A NaN or infinite log decay poisons every later state (exp(-inf) * inf), and a positive
    # one grows the memory without bound (exp of the chunk's summed decays overflows): refuse
    # both by name. A data-dependent test, so eager calls only (torch.compile and vmap trace
    # through here).
    traced = torch.compiler.is_compiling() or is_batched(g) or g.device.type == "meta"
    if not traced and g.numel() and not bool((torch.isfinite(g) & (g <= 0)).all()):
        if not bool(torch.isfinite(g).all()):
            raise ValueError(f"{op}: g (the log decays) must be finite, got inf or NaN values")
        raise ValueError(
            f"{op}: g (the log decays) must be <= 0, got positive values (largest "
            f"{float(g.max()):.4g}); a model's g = -exp(A_log) * softplus(.) is"
        )


def _fake(a: DeltaArgs, backend: str) -> tuple:
    B, T, H, K = a.q.shape
    final = None
    if a.output_final_state:
        final = a.q.new_empty(B, H, K, a.v.shape[-1], dtype=compute_dtype(a.q))
    # Both ops' implementations are this package's modules.
    saved = OP.implementation(backend).empty_saved(a.q, a.v, a.kernel)
    return (a.q.new_empty(B, T, H, a.v.shape[-1]), final, *saved)


def _fold(a: DeltaArgs, dims: DeltaArgs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the heads."""
    heads = ("q", "k", "v", "g", "beta")
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 2) for f in heads},
        initial_state=fold_into(a.initial_state, dims.initial_state, m, 1),
    )
    return folded, lambda i, t: unfold_from(t, m, 2 - i) if i < 2 else (t, None)


def family_op(public: str, name: str) -> Op:
    """An op of the family: `public` is its function's name (errors start with it), `name`
    its custom ops' (mecheval_kernels::<name>_fwd, _bwd)."""
    validate = functools.partial(_validate, public)
    return Op(__package__, public, DeltaArgs, "B T H K", validate, _fake, 5, 3, _fold, name=name)


OP = family_op("chunk_delta_rule", "delta_rule")


def checked(
    op: Op, backend, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm
) -> tuple[DeltaArgs, str]:
    """(the validated arguments as DeltaArgs, q and k normalised if asked, the backend that
    runs them); g None for the delta rule."""
    chosen = op.check(
        backend, q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state
    )
    T, K = q.shape[1], q.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    if l2norm:
        compute = compute_dtype(q)
        q = l2_normalize(q.to(compute)).to(q.dtype)
        k = l2_normalize(k.to(compute)).to(k.dtype)
    kernel = kernel_for(chosen, T, gated=g is not None)
    final = bool(output_final_state)
    return DeltaArgs(q, k, v, g, beta, initial_state, scale, final, kernel), chosen


def run(
    op: Op,
    backend: str | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    l2norm: bool,
    cu_seqlens: torch.Tensor | None,
    head_first: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drop-in call of `op` on its public function's arguments (g None for the delta rule):
    (o, the final state or None)."""
    refuse_unsupported(op.public, cu_seqlens=(cu_seqlens, None), head_first=(head_first, False))
    a, chosen = checked(
        op, backend, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm
    )
    if chosen == "torch" and op.runs_plain(a):  # no backward: no saved buffers
        return op.implementation("torch").forward_inference(a)
    o, final, *_ = op(a, chosen)
    return o, (final if output_final_state else None)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
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
        cu_seqlens, head_first: fla's packed sequences and head-first layout; only None and
            False are supported (anything else is refused by name).
        backend: "auto", "triton" or "torch"; None uses the process default
            (mecheval_kernels.backend).

    Returns:
        (o (B, T, H, V) in q's dtype, the final state (B, H, K, V) in float32 (float64 for
        float64 inputs) or None). States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_delta_rule, ...)`.
    """
    return run(OP, backend, q, k, v, None, beta, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, cu_seqlens, head_first)  # fmt: skip
