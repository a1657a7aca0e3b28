"""The delta-rule family's ops: `chunk_delta_rule` here, `chunk_gated_delta_rule`
(mecheval_kernels.gated_delta_rule), `chunk_kda` (mecheval_kernels.kda, a decay per key channel)
and `chunk_comba` (mecheval_kernels.comba, a recall key p read before the decay), and what they
share (their arguments, validation, the drop-in options of delta_rule/dropin.py, the custom ops'
fake and vmap rule, the call; the scaffold is mecheval_kernels._op).

Every op of the family takes one `DeltaArgs` (g None for the delta rule, (B, T, H) for the gated
delta rule and Comba, (B, T, H, K) for KDA; p Comba's alone) and runs the same implementations
(this package's torch_path and launch), each under its own custom ops
(`mecheval_kernels::<name>_fwd`, `_bwd`). The forward also returns what the backward needs from
it (the chunks' start states, u rows and triangular inverses; the recurrent kernel keeps only the
u rows), as outputs that the autograd glue keeps for the backward. Second derivatives come from
autograd through the per-step reference (`_twice`).

On the Triton backend the sequence length picks the delta rule's kernel: the fused recurrent
kernel up to `RECURRENT_MAX_LEN` steps (short sequences, single-step decoding), the chunked
kernels above it. The other ops run the chunked kernels at every length.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype
from mecheval_kernels.delta_rule import dropin
from mecheval_kernels.delta_rule.reference import gated_delta_rule_ref
from mecheval_kernels.stacking import fold_into, is_batched, unfold_from
from mecheval_kernels.validation import check_batch, check_range, check_tensor

MAX_HEAD_DIM = 256
# The Triton backend runs the delta rule's fused recurrent kernel for T <= this, the chunked
# kernels above.
RECURRENT_MAX_LEN = 64


def kernel_for(backend: str, T: int, gated: bool = False) -> str:
    """The kernel that runs T steps: "recurrent" or "chunked" (the PyTorch path is chunked; the
    recurrent kernel is the delta rule's alone: no gate, no recall key)."""
    recurrent = backend == "triton" and not gated and T <= RECURRENT_MAX_LEN
    return "recurrent" if recurrent else "chunked"


class DeltaArgs(NamedTuple):
    """The custom ops' inputs. `p`: Comba's recall key (B, T, H, K), read before the decay, or
    None (recall with k); `g`: the log decays, (B, T, H) one per head, (B, T, H, K) one per key
    channel (KDA), or None for the delta rule; `kernel`: "recurrent" or "chunked"
    (see `kernel_for`). q, k and p already have v's heads (GVA expanded)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    p: torch.Tensor | None
    g: torch.Tensor | None
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    output_final_state: bool
    kernel: str


def _validate(op: str, gate: str, dtypes, q, k, v, p, g, beta, scale, initial_state) -> None:
    """Check the inputs' shapes and dtypes, and g's values (finite and <= 0; read on eager
    calls, a device sync) when there is a g; `op` is the public function's name, `gate` g's
    layout ("B T HV" or "B T HV K"). v, g, beta and the state have HV heads, a multiple of the
    H heads of q, k and p (GVA)."""
    sizes: dict[str, int] = {}
    check_tensor(op, "q", q, "B T H K", sizes, dtypes)
    check_batch(op, "q", sizes["B"])
    if sizes["T"] < 1:
        raise ValueError(f"{op}: q must have at least one position (T >= 1), got T = 0")
    if sizes["H"] < 1:
        raise ValueError(f"{op}: q must have at least one head (H >= 1), got H = 0")
    check_range(op, "head dimension K of q and k", sizes["K"], 1, MAX_HEAD_DIM)
    # q, k, p and v share one dtype (the kernels multiply them together in it).
    check_tensor(op, "k", k, "B T H K", sizes, (q.dtype,))
    check_tensor(op, "p", p, "B T H K", sizes, (q.dtype,), optional=True)
    check_tensor(op, "v", v, "B T HV V", sizes, (q.dtype,))
    if sizes["HV"] % sizes["H"]:
        raise ValueError(
            f"{op}: v's heads HV = {sizes['HV']} must be a multiple of q's heads H = "
            f"{sizes['H']} (GVA)"
        )
    check_tensor(op, "g", g, gate, sizes, dtypes, optional=True)
    check_tensor(op, "beta", beta, "B T HV", sizes, dtypes)
    check_range(op, "head dimension V of v", sizes["V"], 1, MAX_HEAD_DIM)
    check_tensor(op, "initial_state", initial_state, "B HV K V", sizes, dtypes, optional=True)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{op}: scale must be finite, got {scale}")


def check_decays(op: str, g: torch.Tensor) -> None:
    """g (the log decays) finite and <= 0, on eager calls."""
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
    # Every op's implementations are this package's modules.
    saved = OP.implementation(backend).empty_saved(a)
    return (a.q.new_empty(B, T, H, a.v.shape[-1]), final, *saved)


def _fold(a: DeltaArgs, dims: DeltaArgs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the heads."""
    heads = ("q", "k", "v", "p", "g", "beta")
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 2) for f in heads},
        initial_state=fold_into(a.initial_state, dims.initial_state, m, 1),
    )
    return folded, lambda i, t: unfold_from(t, m, 2 - i) if i < 2 else (t, None)


class Variant(NamedTuple):
    """An op of the family: its Op (custom ops `mecheval_kernels::<name>_fwd`, `_bwd`; its
    validation knows g's layout), the names its peer reads from **kwargs and the chunk sizes the
    peer accepts (checked, without effect here)."""

    op: Op
    kwargs: frozenset = frozenset({"chunk_size"})
    chunk_sizes: tuple = (16, 32, 64)


def family_op(public: str, name: str, gate: str | None = None) -> Op:
    """An op of the family: `public` is its function's name (errors start with it), `name`
    its custom ops' (mecheval_kernels::<name>_fwd, _bwd), `gate` g's layout."""
    validate = functools.partial(_validate, public, gate or "B T HV")
    return Op(
        __package__, public, DeltaArgs, "B T H K", validate, _fake, 5, 3, _fold, name=name,
        twice=_twice,
    )  # fmt: skip


def _twice(a: DeltaArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op's differentiable outputs recomputed by the per-step reference (for second
    derivatives: autograd records it)."""
    o, final = gated_delta_rule_ref(
        a.q, a.k, a.v, a.g, a.beta, a.scale, a.initial_state, a.output_final_state, p=a.p
    )
    return o, final


OP = family_op("chunk_delta_rule", "delta_rule")
DELTA_RULE = Variant(OP)


class Call(NamedTuple):
    """A validated call: the op's arguments, the backend that runs them, its options."""

    args: DeltaArgs
    backend: str
    options: dropin.Options


def prepare(variant: Variant, arguments: dict, final: bool) -> Call:
    """A drop-in call's arguments, by name as the public function takes them (g, p absent for
    the ops without them), validated and turned into the op's: q, k (and p) normalised and
    expanded to v's heads, beta and g as the options ask, the initial state in (K, V) layout.
    `final`: whether the final state is wanted."""
    op = variant.op
    o = dropin.options(op.public, arguments, variant.kwargs, variant.chunk_sizes)
    q, k, v, beta = (arguments[n] for n in ("q", "k", "v", "beta"))
    p, g, state = arguments.get("p"), arguments.get("g"), arguments["initial_state"]
    state = dropin.state_in(state, o)
    scale = arguments["scale"]
    chosen = op.check(
        arguments["backend"], q=q, k=k, v=v, p=p, g=g, beta=beta, scale=scale, initial_state=state
    )
    if g is not None:
        per_key = g.dim() == 4
        dropin.check_gate_options(op.public, o, g, per_key, bool(arguments.get("safe_gate")))
        g = dropin.gate(g, o) if o.gate_in_kernel else g
        check_decays(op.public, g)
    beta = dropin.write_strength(beta, o)
    T, K = q.shape[1], q.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    if o.l2norm:
        q, k, p = (dropin.normalised(t, compute_dtype(q)) for t in (q, k, p))
    groups = v.shape[2] // q.shape[2]
    q, k, p = (dropin.shared_heads(t, groups) for t in (q, k, p))
    kernel = kernel_for(chosen, T, gated=g is not None or p is not None)
    args = DeltaArgs(q, k, v, p, g, beta, state, scale, bool(final), kernel)
    return Call(args, chosen, o)


def run(variant: Variant, arguments: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drop-in call of `variant`'s op on its public function's arguments by name: (o, the
    final state or None)."""
    final = bool(arguments["output_final_state"])
    call = prepare(variant, arguments, final)
    op, a = variant.op, call.args
    if call.backend == "torch" and op.runs_plain(a):  # no backward: no saved buffers
        o, state = op.implementation("torch").forward_inference(a)
    else:
        o, state, *_ = op(a, call.backend)
    return o, (dropin.state_out(state, call.options) if final else None)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    backend: str | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule (DeltaNet), drop-in for flash-linear-attention 0.6.0's
    `fla.ops.delta_rule.chunk_delta_rule`.

    Per batch row and head, with a (K, V) state S:
    u_t = beta_t (v_t - S_{t-1}^T k_t); S_t = S_{t-1} + k_t u_t^T; o_t = S_t^T (scale q_t).

    Args:
        q: (B, T, H, K) float32/float16/bfloat16 (float64 on the PyTorch path); any strides.
        k: (B, T, H, K), q's dtype.
        v: (B, T, HV, V), q's dtype; HV a multiple of H (GVA: q, k shared by HV / H heads).
        beta: (B, T, HV), the write strengths (in [0, 2] for a stable memory).
        scale: the query scale; None means K ** -0.5.
        initial_state: optional (B, HV, K, V), the state before the first step (float32
            recommended; any of the float dtypes is accepted and its gradient has its dtype).
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (per token and head) inside the
            op, gradients included.
        cu_seqlens, cu_seqlens_cpu: fla's packed sequences; only None is supported (refused
            by name).
        backend: "auto", "triton" or "torch"; None uses the process default
            (mecheval_kernels.backend).
        **kwargs: chunk_size (16, 32 or 64, as fla checks it; the result does not depend on
            it). Any other keyword, head_first (removed in fla 0.6) included, is refused.

    Returns:
        (o (B, T, HV, V) in q's dtype, the final state (B, HV, K, V) in float32 (float64 for
        float64 inputs) or None). States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_delta_rule, ...)`.
    """
    return run(DELTA_RULE, locals())  # the arguments by name, as at_positions binds them
