"""`chunk_dplr_delta_rule`, the generalised delta rule with a diagonal-plus-low-rank transition
(drop-in for flash-linear-attention 0.6.0's
`fla.ops.generalized_delta_rule.chunk_dplr_delta_rule`), and what it shares with RWKV-7's
`chunk_rwkv7` (mecheval_kernels.rwkv7): the arguments (`DplrArgs`), validation, the custom ops'
fake and vmap rule, the call (the scaffold is mecheval_kernels._op).

Both public ops run the implementations of this package (torch_path, launch), each under its own
custom ops (`mecheval_kernels::dplr_delta_rule_fwd`, `mecheval_kernels::rwkv7_fwd` and their
`_bwd`). The forward also returns what the Triton backward needs (the state at the start of
every chunk of `CHECKPOINT` steps), as an output the autograd glue keeps for the backward.

fla's arguments that only pick its kernels (`safe_gate`, `chunk_size`, `disable_recompute`)
are accepted and change nothing; `lower_bound` is checked (gk >= lower_bound); packed and
context-parallel sequences (`cu_seqlens`, `cu_seqlens_cpu`, `cp_context`) and any other keyword
(`head_first`, which fla 0.6 removed) are refused by name.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype
from mecheval_kernels.stacking import fold_into, is_batched, unfold_from
from mecheval_kernels.validation import check_range, check_tensor, refuse_unsupported

MAX_HEAD_DIM = 256


class DplrArgs(NamedTuple):
    """The custom ops' inputs (fla's names): q, k, a, b, gk (B, T, H, K), v (B, T, H, V),
    initial_state (B, H, K, V) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    gk: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    output_final_state: bool


def _validate(op: str, names: dict, dtypes, **arguments) -> None:
    """Shapes and dtypes of the arguments, by the public op's names: `names` maps fla's dplr
    names to them where they differ (RWKV-7 calls q r and gk w)."""
    sizes: dict[str, int] = {}
    n = lambda x: names.get(x, x)  # noqa: E731
    q, k, v, a, b, gk = (arguments[n(x)] for x in ("q", "k", "v", "a", "b", "gk"))
    scale, initial_state = arguments["scale"], arguments["initial_state"]
    check_tensor(op, n("q"), q, "B T H K", sizes, dtypes)
    if sizes["T"] < 1 or sizes["H"] < 1:
        raise ValueError(f"{op}: {n('q')} must have T >= 1 positions and H >= 1 heads")
    check_range(op, f"head dimension K of {n('q')} and k", sizes["K"], 1, MAX_HEAD_DIM)
    # q, k, a, b and v share one dtype (the kernels multiply them together in it).
    for name, t, dims in (("k", k, "B T H K"), ("a", a, "B T H K"), ("b", b, "B T H K")):
        check_tensor(op, name, t, dims, sizes, (q.dtype,))
    check_tensor(op, "v", v, "B T H V", sizes, (q.dtype,))
    check_range(op, "head dimension V of v", sizes["V"], 1, MAX_HEAD_DIM)
    check_tensor(op, n("gk"), gk, "B T H K", sizes, dtypes)
    check_tensor(op, "initial_state", initial_state, "B H K V", sizes, dtypes, optional=True)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"{op}: scale must be finite, got {scale}")


def check_decays(op: str, name: str, gk: torch.Tensor, lower_bound: float | None) -> None:
    """gk finite, <= 0 and, with `lower_bound`, >= it; a data-dependent test, so eager calls
    only (torch.compile and vmap trace through here)."""
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"{op}: lower_bound must be a float or None, got {lower_bound!r}")
        if not lower_bound < 0:
            raise ValueError(f"{op}: lower_bound must be negative (a log decay), got {lower_bound}")
    traced = torch.compiler.is_compiling() or is_batched(gk) or gk.device.type == "meta"
    if traced or not gk.numel():
        return
    low = -math.inf if lower_bound is None else lower_bound
    if bool((torch.isfinite(gk) & (gk <= 0) & (gk >= low)).all()):
        return
    if not bool(torch.isfinite(gk).all()):
        raise ValueError(f"{op}: {name} (the log decays) must be finite, got inf or NaN values")
    if bool((gk > 0).any()):
        raise ValueError(
            f"{op}: {name} (the log decays) must be <= 0, got positive values (largest "
            f"{float(gk.max()):.4g})"
        )
    raise ValueError(
        f"{op}: {name} must be >= lower_bound = {lower_bound}, got {float(gk.min()):.4g}"
    )


def _fake(a: DplrArgs, backend: str) -> tuple:
    B, T, H, K = a.q.shape
    V = a.v.shape[-1]
    final = a.q.new_empty(B, H, K, V, dtype=compute_dtype(a.q)) if a.output_final_state else None
    saved = DPLR.implementation(backend).empty_saved(a.q, a.v)
    return a.q.new_empty(B, T, H, V), final, saved


def _fold(a: DplrArgs, dims: DplrArgs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the heads."""
    heads = ("q", "k", "v", "a", "b", "gk")
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 2) for f in heads},
        initial_state=fold_into(a.initial_state, dims.initial_state, m, 1),
    )
    return folded, lambda i, t: unfold_from(t, m, 2 - i) if i < 2 else (t, None)


def family_op(public: str, name: str, names: dict | None = None) -> Op:
    """An op on DplrArgs: `public` its function's name (errors start with it), `name` its custom
    ops' (mecheval_kernels::<name>_fwd, _bwd), `names` its argument names where they are not
    fla's dplr names."""
    validate = functools.partial(_validate, public, names or {})
    return Op(__package__, public, DplrArgs, "B T H K", validate, _fake, 3, 1, _fold, name=name)


DPLR = family_op("chunk_dplr_delta_rule", "dplr_delta_rule")


def checked(
    op: Op, backend, q, k, v, a, b, gk, scale, initial_state, output_final_state, lower_bound,
    names: dict | None = None,
) -> tuple[DplrArgs, str]:  # fmt: skip
    """(the validated arguments as DplrArgs, the backend that runs them); `names`: the public
    op's names of fla's dplr arguments where they differ."""
    names = names or {}
    tensors = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    chosen = op.check(
        backend, **{names.get(x, x): t for x, t in tensors.items()}, scale=scale,
        initial_state=initial_state,
    )  # fmt: skip
    check_decays(op.public, names.get("gk", "gk"), gk, lower_bound)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return DplrArgs(q, k, v, a, b, gk, initial_state, scale, bool(output_final_state)), chosen


def refuse_packed(op: str, cu_seqlens, cu_seqlens_cpu, cp_context, kwargs: dict) -> None:
    """fla's packed and context-parallel sequences, and any keyword fla's **kwargs would take
    (head_first, removed in fla 0.6), are refused by name."""
    refuse_unsupported(
        op,
        cu_seqlens=(cu_seqlens, None),
        cu_seqlens_cpu=(cu_seqlens_cpu, None),
        cp_context=(cp_context, None),
    )
    for name in kwargs:
        why = "fla 0.6 removed it: inputs are (B, T, H, ...)" if name == "head_first" else ""
        raise TypeError(f"{op}: unexpected keyword argument {name!r} {why}".rstrip())


def check_hints(op: str, safe_gate, chunk_size, disable_recompute) -> None:
    """fla's kernel hints: accepted (no effect here) when of the right type."""
    for name, value in (("safe_gate", safe_gate), ("disable_recompute", disable_recompute)):
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{op}: chunk_size must be None or a positive int, got {chunk_size!r}")


def run(op: Op, args: tuple[DplrArgs, str], output_final_state: bool):
    """(o, the final state or None) of a validated call: checked(...)'s result."""
    a, chosen = args
    if chosen == "torch" and op.runs_plain(a):  # no backward: nothing kept for it
        return op.implementation("torch").forward_inference(a)
    o, final, _ = op(a, chosen)
    return o, (final if output_final_state else None)


def chunk_dplr_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: object | None = None,
    lower_bound: float | None = None,
    *,
    backend: str | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generalised delta rule with a diagonal-plus-low-rank transition, drop-in for
    `fla.ops.generalized_delta_rule.chunk_dplr_delta_rule` (fla 0.6.0).

    Per batch row and head, with a (K, V) state S:
    u_t = S_{t-1}^T a_t; S_t = diag(exp(gk_t)) S_{t-1} + b_t u_t^T + k_t v_t^T;
    o_t = S_t^T (scale q_t).

    Args:
        q, k, a, b: (B, T, H, K) float32/float16/bfloat16 (float64 on the PyTorch path), one
            dtype; any strides.
        v: (B, T, H, V), q's dtype.
        gk: (B, T, H, K) the log decays per key channel: finite and <= 0 (checked on eager
            calls; fla does not check).
        scale: the query scale; None means K ** -0.5.
        initial_state: optional (B, H, K, V), the state before the first step.
        output_final_state: also return the state after the last step.
        cu_seqlens, cu_seqlens_cpu, cp_context: packed / context-parallel sequences; only None
            (refused by name otherwise).
        safe_gate, chunk_size, disable_recompute: fla's kernel hints; accepted, no effect.
        lower_bound: optional negative float; gk >= lower_bound is checked (fla assumes it).
        backend: "auto", "triton" or "torch"; None uses the process default.
        **kwargs: fla's catch-all; any keyword here (head_first included) is refused by name.

    Returns:
        (o (B, T, H, V) in q's dtype, the final state (B, H, K, V) in float32 (float64 for
        float64 inputs) or None). States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_dplr_delta_rule, ...)`.
    """
    public = DPLR.public
    refuse_packed(public, cu_seqlens, cu_seqlens_cpu, cp_context, kwargs)
    check_hints(public, safe_gate, chunk_size, disable_recompute)
    args = checked(
        DPLR, backend, q, k, v, a, b, gk, scale, initial_state, output_final_state, lower_bound
    )
    return run(DPLR, args, output_final_state)
