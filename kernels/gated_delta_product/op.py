"""`chunk_gated_delta_product`: Gated DeltaProduct, n Householder steps a token, run as the gated
delta rule (or, without g, the delta rule) on the sequence of the n T steps: the token's decay
on its first step, its query on its last (zero queries elsewhere, whose outputs are dropped).
Its own custom ops (`mecheval_kernels::gated_delta_product_fwd`, `_bwd`) on the family's
implementations (mecheval_kernels.delta_rule), so the Triton kernels are the gated delta rule's.
"""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule import dropin
from mecheval_kernels.delta_rule.op import Variant, family_op, run
from mecheval_kernels.validation import check_tensor

OP = family_op("chunk_gated_delta_product", "gated_delta_product", gate="B T HV")
GATED_DELTA_PRODUCT = Variant(OP, kwargs=frozenset(), chunk_sizes=())


def _validate(arguments: dict) -> int:
    """The token-level shapes (k, v and beta with n rows a token); returns n."""
    public, n = OP.public, arguments["num_householder"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{public}: num_householder must be an integer >= 1, got {n!r}")
    sizes: dict[str, int] = {}
    check_tensor(public, "q", arguments["q"], "B T H K", sizes)
    sizes["Tn"] = sizes["T"] * n  # T * num_householder
    for name, dims in (("k", "B Tn H K"), ("v", "B Tn H V"), ("beta", "B Tn H")):
        check_tensor(public, name, arguments[name], dims, sizes)
    check_tensor(public, "g", arguments["g"], "B T H", sizes, optional=True)
    return n


def steps(arguments: dict) -> tuple[dict, int]:
    """The arguments of the family's op over the n T steps (q, k already normalised when
    asked), and n."""
    dropin.refuse(OP.public, arguments)
    n = _validate(arguments)
    q, k, g = arguments["q"], arguments["k"], arguments["g"]
    if arguments["use_qk_l2norm_in_kernel"]:
        q, k = (dropin.normalised(t, torch.promote_types(t.dtype, torch.float32)) for t in (q, k))
    B, T, H, K = q.shape
    # Token t's query on its last step, its decay on its first.
    q = torch.cat([q.new_zeros(B, T, n - 1, H, K), q[:, :, None]], dim=2).flatten(1, 2)
    if g is not None:
        g = torch.cat([g[:, :, None], g.new_zeros(B, T, n - 1, H)], dim=2).flatten(1, 2)
    inner = {name: arguments[name] for name in ("v", "beta", "initial_state", "backend")}
    inner.update(q=q, k=k, g=g, scale=arguments["scale"], use_qk_l2norm_in_kernel=False)
    inner["output_final_state"] = arguments["output_final_state"]
    return inner, n


def chunk_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: object | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaProduct, drop-in for flash-linear-attention 0.6.0's
    `fla.ops.gated_delta_product.chunk_gated_delta_product`.

    Per batch row and head, with a (K, V) state S, token t: S <- exp(g_t) S, then for each of
    its n = num_householder steps j: u = beta_{t,j} (v_{t,j} - S^T k_{t,j}), S <- S + k_{t,j} u^T;
    o_t = S^T (scale q_t).

    Args:
        q: (B, T, H, K) float32/float16/bfloat16 (float64 on the PyTorch path).
        k: (B, T n, H, K), q's dtype: token t's keys at rows t n .. t n + n - 1.
        v: (B, T n, H, V), q's dtype.
        g: (B, T, H) the log decay of each token (finite, <= 0), or None (DeltaProduct).
        beta: (B, T n, H), the write strength of each step.
        num_householder: n, the steps a token.
        scale: the query scale; None means K ** -0.5.
        initial_state: optional (B, H, K, V).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and every key over K inside the op.
        cu_seqlens, cu_seqlens_cpu, cp_context: fla's packed sequences and context
            parallelism; only None is supported (refused by name).
        backend: "auto", "triton" or "torch"; None uses the process default.

    Returns:
        (o (B, T, H, V) in q's dtype, the final state (B, H, K, V) float32 (float64 for float64
        inputs) or None). States after given tokens, the output at one token, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.chunk_gated_delta_product, ...)`.
    """
    inner, n = steps(locals())
    o, final = run(GATED_DELTA_PRODUCT, inner)
    return o[:, n - 1 :: n], final
