"""`at_positions`: a recurrent drop-in's scan at positions, what an intervention engine needs
from a scan beyond the drop-in itself, from one call that returns `ScanAt` whatever is asked.

    at_positions(scan, *args, states_at=None, out_at=None, state_patch=None,
                 return_final_state=False, **kwargs) -> ScanAt

`scan` is one of the drop-ins

    mecheval_kernels.selective_scan_fn        Mamba's selective scan
    mecheval_kernels.mamba2_scan              Mamba-2's scan
    mecheval_kernels.chunk_delta_rule         the delta rule
    mecheval_kernels.chunk_gated_delta_rule   the gated delta rule
    mecheval_kernels.chunk_kda                KDA (a decay per key channel)
    mecheval_kernels.chunk_gated_delta_product   Gated DeltaProduct (positions are tokens)
    mecheval_kernels.chunk_comba              Comba (a recall key p)
    mecheval_kernels.chunk_dplr_delta_rule    the DPLR delta rule (fla's generalised one)
    mecheval_kernels.chunk_rwkv7              RWKV-7's state update (the same, RWKV-7's names)
    mecheval_kernels.mamba3_siso_combined     Mamba-3's scan (SISO)
    mecheval_kernels.mamba3_mimo              Mamba-3's scan (MIMO)

and `*args, **kwargs` are its own arguments, as it takes them (`backend` included). Beyond them:

    states_at           (B, P) integer positions: `states` holds the states after positions
                        states_at[b, :] of each row b, (B, P, *state)
    out_at              (B,) one position per row: `out` is the output there alone (its time
                        axis of length 1)
    state_patch         (positions (B,), values (B, *state)): the state after positions[b] of
                        row b is replaced with values[b] and the scan goes on from it: the
                        outputs after the position, the final state and the states at or after
                        it see the patch; the output at the position itself does not
    return_final_state  return the state after the last position (else None, and a scan may
                        skip forming it)

The drop-in's own final-state flag (`return_last_state`, `return_final_states`,
`output_final_state`) is refused: `return_final_state` asks for the final state. So are its
packed-sequence arguments (`seq_idx`, `cu_seqlens`, `return_varlen_states`, `head_first`) at
anything but their defaults, as the drop-ins refuse them.

Gradients flow to every tensor input and to the patch values. A patch is exact: each scan is
affine in its state (mecheval_kernels.scan_at.patch_by_jump). What runs where: each op's at.py
(mecheval_kernels.selective_scan.at, mecheval_kernels.ssd.at, mecheval_kernels.delta_rule.at, the
last for both delta rules, mecheval_kernels.dplr.at for the DPLR delta rule and RWKV-7,
mecheval_kernels.mamba3.at for Mamba-3's, whose state is the SSM state h alone).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch

from mecheval_kernels.comba.op import COMBA, arguments_of, chunk_comba
from mecheval_kernels.delta_rule.at import at_positions_of_delta_rule
from mecheval_kernels.delta_rule.op import DELTA_RULE, chunk_delta_rule
from mecheval_kernels.dplr.at import at_positions_of_dplr
from mecheval_kernels.dplr.op import DPLR, chunk_dplr_delta_rule
from mecheval_kernels.gated_delta_product.at import at_positions_of_gated_delta_product
from mecheval_kernels.gated_delta_product.op import chunk_gated_delta_product
from mecheval_kernels.gated_delta_rule.op import GATED_DELTA_RULE, chunk_gated_delta_rule
from mecheval_kernels.kda.op import KDA, chunk_kda
from mecheval_kernels.mamba3.at import at_positions_of_mamba3
from mecheval_kernels.mamba3.op import mamba3_mimo, mamba3_siso_combined
from mecheval_kernels.rwkv7.op import NAMES as RWKV7_NAMES
from mecheval_kernels.rwkv7.op import OP as RWKV7
from mecheval_kernels.rwkv7.op import chunk_rwkv7
from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.selective_scan.at import at_positions_of_selective_scan
from mecheval_kernels.selective_scan.op import selective_scan_fn
from mecheval_kernels.ssd.at import at_positions_of_mamba2_scan
from mecheval_kernels.ssd.op import mamba2_scan
from mecheval_kernels.validation import refuse_unsupported


class Implementation(NamedTuple):
    """How `at_positions` runs one drop-in.

    Attributes:
        run: run(arguments, asked) -> ScanAt, on the drop-in's arguments by name and what
            the call asks for (mecheval_kernels.scan_at.Asked).
        final_state_flag: the drop-in's own flag for returning its final state.
        unsupported: the drop-in's arguments that run only at one value: name -> that value.
    """

    run: Callable[..., ScanAt]
    final_state_flag: str
    unsupported: dict[str, object]


IMPLEMENTATIONS: dict[Callable, Implementation] = {
    selective_scan_fn: Implementation(at_positions_of_selective_scan, "return_last_state", {}),
    mamba2_scan: Implementation(
        at_positions_of_mamba2_scan,
        "return_final_states",
        {"seq_idx": None, "cu_seqlens": None, "return_varlen_states": False},
    ),
    chunk_delta_rule: Implementation(
        functools.partial(at_positions_of_delta_rule, DELTA_RULE),
        "output_final_state",
        {},  # the family refuses its packed-sequence arguments itself (delta_rule/dropin.py)
    ),
    chunk_gated_delta_rule: Implementation(
        functools.partial(at_positions_of_delta_rule, GATED_DELTA_RULE), "output_final_state", {}
    ),
    chunk_kda: Implementation(
        functools.partial(at_positions_of_delta_rule, KDA), "output_final_state", {}
    ),
    chunk_gated_delta_product: Implementation(
        at_positions_of_gated_delta_product, "output_final_state", {}
    ),
    chunk_comba: Implementation(
        lambda arguments, asked: at_positions_of_delta_rule(COMBA, arguments_of(arguments), asked),
        "output_final_state",
        {},
    ),
    # Packed sequences and fla's kernel hints are checked as the drop-ins check them.
    chunk_dplr_delta_rule: Implementation(
        functools.partial(at_positions_of_dplr, DPLR, {}), "output_final_state", {}
    ),
    chunk_rwkv7: Implementation(
        functools.partial(at_positions_of_dplr, RWKV7, RWKV7_NAMES), "output_final_state", {}
    ),
    mamba3_siso_combined: Implementation(
        functools.partial(at_positions_of_mamba3, "siso"), "return_final_states", {}
    ),
    mamba3_mimo: Implementation(
        functools.partial(at_positions_of_mamba3, "mimo"), "return_state", {}
    ),
}


def at_positions(
    scan: Callable,
    /,
    *args: object,
    states_at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    state_patch: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_final_state: bool = False,
    **kwargs: object,
) -> ScanAt:
    """`scan`, one of the recurrent drop-ins, at positions (see the module docstring).

    Args:
        scan: one of the drop-ins of the module docstring (mecheval_kernels.selective_scan_fn,
            mecheval_kernels.mamba2_scan, mecheval_kernels.chunk_delta_rule, ...).
        *args, **kwargs: `scan`'s own arguments, as it takes them (`backend` included).
        states_at: optional (B, P) integer positions; `states` is then (B, P, *state).
        out_at: optional (B,) integer positions; `out` then has a time axis of length 1.
        state_patch: optional (positions (B,), values (B, *state)).
        return_final_state: return the state after the last position.

    Returns:
        ScanAt(out, final_state or None, states or None). The state is (B, D, N) float32 for
        the selective scan, (B, H, P, N) float32 for Mamba-2's, (B, H, K, V) for the delta
        rules, the DPLR delta rule and RWKV-7, (B, H, P, N) for Mamba-3's SSM state (float32,
        float64 for float64 inputs).

    Raises:
        TypeError: `scan` is not one of the drop-ins, its arguments do not bind, or its own
            final-state flag is set.
        ValueError: an argument the scan at positions does not run (packed sequences), or
            a bad input (named).
    """
    implementation = _implementation(scan)
    arguments = _bound(scan, args, kwargs)
    flag = implementation.final_state_flag
    if arguments[flag]:
        raise TypeError(
            f"at_positions({scan.__name__}): {flag}={arguments[flag]!r} is not how at_positions "
            "asks for the final state: pass return_final_state=True instead"
        )
    refuse_unsupported(
        scan.__name__,
        **{name: (arguments[name], value) for name, value in implementation.unsupported.items()},
    )
    asked = Asked(states_at, out_at, state_patch, return_final_state)
    return implementation.run(arguments, asked)


def _implementation(scan: object) -> Implementation:
    """The implementation of `scan`, one of the drop-ins (else a TypeError naming them)."""
    for drop_in, implementation in IMPLEMENTATIONS.items():
        if scan is drop_in:
            return implementation
    allowed = ", ".join(f"mecheval_kernels.{drop_in.__name__}" for drop_in in IMPLEMENTATIONS)
    raise TypeError(f"at_positions: scan must be one of {allowed}, got {scan!r}")


@functools.cache
def _signature(scan: Callable) -> inspect.Signature:
    return inspect.signature(scan)


def _bound(scan: Callable, args: tuple, kwargs: dict) -> dict:
    """`scan`'s arguments by name, its defaults filled in."""
    try:
        bound = _signature(scan).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"at_positions({scan.__name__}): {error}") from None
    bound.apply_defaults()
    return bound.arguments
