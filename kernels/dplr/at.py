"""`at_positions_of_dplr`: the scan at positions of `chunk_dplr_delta_rule` and of
`chunk_rwkv7` (states after steps, the output at one step per row, a patched state;
mecheval_kernels.at_positions says what each means), run by
mecheval_kernels.scan_at.scan_at_by_jump."""

from __future__ import annotations

import torch

from mecheval_kernels._op import Op
from mecheval_kernels.dplr.op import DplrArgs, check_hints, checked, refuse_packed
from mecheval_kernels.scan_at import ScanAt, scan_at_by_jump

TIMED = ("q", "k", "v", "a", "b", "gk")


def _held(a: DplrArgs, after: torch.Tensor) -> dict:
    """No decay (gk = 0) and no low-rank term (b = 0) where `after` (B, T) is False."""
    mask = after[..., None, None]  # (B, T, 1, 1) over heads and channels
    return dict(b=a.b * mask, gk=a.gk * mask)


def at_positions_of_dplr(op: Op, names: dict, arguments: dict, asked) -> ScanAt:
    """The scan at positions of `op` on its public function's arguments by name (`names`: the
    public names of fla's dplr arguments q and gk, RWKV-7's r and w); see
    mecheval_kernels.at_positions. Its kernel hints are checked as the op checks them."""
    public = op.public
    refuse_packed(
        public, arguments["cu_seqlens"], arguments["cu_seqlens_cpu"], arguments["cp_context"],
        arguments.get("kwargs", {}),
    )  # fmt: skip
    check_hints(
        public, arguments["safe_gate"], arguments["chunk_size"], arguments["disable_recompute"]
    )
    get = lambda name: arguments[names.get(name, name)]  # noqa: E731
    a, chosen = checked(
        op, arguments["backend"], get("q"), get("k"), get("v"), get("a"), get("b"), get("gk"),
        arguments["scale"], arguments["initial_state"], asked.return_final_state,
        arguments["lower_bound"], names,
    )  # fmt: skip
    return scan_at_by_jump(op, a, chosen, asked, _held, TIMED)
