"""The scan at positions of Gated DeltaProduct: the family's (mecheval_kernels.delta_rule.at) over
its n T steps, token t's state being the one after its last step, t n + n - 1."""

from __future__ import annotations

from mecheval_kernels.delta_rule.at import scan_at
from mecheval_kernels.delta_rule.op import prepare
from mecheval_kernels.gated_delta_product.op import GATED_DELTA_PRODUCT, OP, steps
from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row


def at_positions_of_gated_delta_product(arguments: dict, asked: Asked) -> ScanAt:
    """`chunk_gated_delta_product` at tokens (see mecheval_kernels.at_positions): states
    (B, P, H, K, V), out at `out_at` (B, 1, H, V), a patch of the state after a token."""
    inner, n = steps(arguments)
    call = prepare(GATED_DELTA_PRODUCT, inner, asked.return_final_state)
    B, T = arguments["q"].shape[:2]
    device = call.args.q.device
    last = lambda t: None if t is None else t * n + n - 1  # noqa: E731
    read = asked.states_at
    if read is not None:
        read = last(check_positions(OP.public, read, B, T, device))
    one = asked.out_at
    if one is not None:
        one = last(one_per_row(OP.public, "out_at", one, B, T, device))
    patch = asked.state_patch
    if patch is not None:
        shape = (B, *arguments["q"].shape[2:], arguments["v"].shape[-1])  # (B, H, K, V)
        positions, values = check_state_patch(OP.public, patch, shape, T, device)
        patch = (last(positions), values)
    result = scan_at(OP, call.args, call.backend, Asked(read, one, patch))
    return result if one is not None else result._replace(out=result.out[:, n - 1 :: n])
