"""`at_positions_of_delta_rule`: the scan at positions of an op of the delta-rule family (the
delta rule, the gated delta rule, KDA, Comba; states after steps, the output at one step per row,
a patched state; mecheval_kernels.at_positions says what each means), and `scan_at`, the same on
validated arguments."""

from __future__ import annotations

import torch

from mecheval_kernels._op import Op
from mecheval_kernels.delta_rule import dropin
from mecheval_kernels.delta_rule.op import DeltaArgs, Variant, kernel_for, prepare
from mecheval_kernels.scan_at import Asked, ScanAt, scan_at_by_jump


def at_positions_of_delta_rule(variant: Variant, arguments: dict, asked: Asked) -> ScanAt:
    """The scan at positions of `variant`'s op (see mecheval_kernels.at_positions).

    Args:
        variant: the op of the family (mecheval_kernels.delta_rule.op.DELTA_RULE, ...).
        arguments: the op's public function's arguments by name, as it takes them.
        asked: what to return beside the output; the state is (B, HV, K, V) float32 (float64
            for float64 inputs), (B, HV, V, K) with state_v_first (`states` (B, P, *state),
            patch values (B, *state)), `out` at `out_at` (B, 1, HV, V).
    """
    call = prepare(variant, arguments, asked.return_final_state)
    patch = asked.state_patch
    if isinstance(patch, tuple) and len(patch) == 2 and isinstance(patch[1], torch.Tensor):
        patch = (patch[0], dropin.state_in(patch[1], call.options))
    result = scan_at(variant.op, call.args, call.backend, asked._replace(state_patch=patch))
    return result._replace(
        final_state=dropin.state_out(result.final_state, call.options),
        states=dropin.state_out(result.states, call.options),
    )


def scan_at(op: Op, a: DeltaArgs, backend: str, asked: Asked) -> ScanAt:
    """The scan at positions of an op of the family on its validated arguments `a` (q and k
    already normalised; `a.output_final_state` says whether the final state is wanted; `asked`'s
    positions not yet checked), as mecheval_kernels.scan_at.scan_at_by_jump runs it."""
    kernel = kernel_for(backend, 1, gated=a.g is not None or a.p is not None)
    return scan_at_by_jump(op, a, backend, asked, _held, TIMED, step=dict(kernel=kernel))


TIMED = ("q", "k", "v", "p", "g", "beta")


def _held(a: DeltaArgs, after: torch.Tensor) -> dict:
    """No writes (beta = 0) and, gated, no decay (g = 0) where `after` (B, T) is False."""
    mask = after[..., None]  # (B, T, 1) over the heads
    fields = dict(beta=a.beta * mask)
    if a.g is not None:  # (B, T, H) or, a decay per key channel, (B, T, H, K)
        fields["g"] = a.g * (mask if a.g.dim() == 3 else mask[..., None])
    return fields
