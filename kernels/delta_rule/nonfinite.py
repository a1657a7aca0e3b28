"""Non-finite inputs in the delta-rule family's PyTorch path (torch_path.py) stay causal, as in
the per-step recurrence. Inside a chunk the masked
products multiply the later steps' rows by zeros, and 0 * NaN is NaN: a NaN at step t would
reach the outputs before t. So the forward runs on the inputs with every non-finite entry set
to zero, and then marks non-finite what the recurrence makes non-finite: from step t on, every
output of the row and head for a non-finite k, g or beta at t (the whole state), only output
column c for a non-finite v[..., c] (state column c), and the output at t alone for a
non-finite q at t. Finite inputs give exactly what they gave without this: `marks` tells the
two apart (one sum per input, on CPU; on a GPU inputs always take the masking way).
"""

from __future__ import annotations

import math

import torch

from mecheval_kernels.delta_rule.op import DeltaArgs


def all_finite(args: DeltaArgs) -> bool:
    """Whether every input is known to be finite, so that `NonFinite`'s passes over them can
    be skipped: one sum per tensor, read on CPU only (on a GPU the read would be a sync, which
    a CUDA graph's capture refuses). A sum of finite values that overflows only sends them down
    the exact, slower way. Each sum is read as it comes (stacking them first took twice as long
    at a model's size)."""
    if args.q.device.type != "cpu":
        return False
    tensors = (args.q, args.k, args.v, args.p, args.g, args.beta, args.initial_state)
    return all(math.isfinite(t.sum(dtype=torch.float32)) for t in tensors if t is not None)


class AllFinite:
    """Finite inputs: they run as they are, and nothing is marked."""

    def __init__(self, args: DeltaArgs) -> None:
        self.finite = args

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o

    def output_at(self, o: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return o

    def final_state(self, state: torch.Tensor | None) -> torch.Tensor | None:
        return state

    def states_at(self, states: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return states


class NonFinite(AllFinite):
    """Where the recurrence's outputs and states are non-finite, from where its inputs are (see
    the module docstring); `finite` holds the inputs with each non-finite entry set to zero."""

    def __init__(self, args: DeltaArgs) -> None:
        def zeroed(t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if t is None:
                return None, None
            bad = ~torch.isfinite(t)
            return t.masked_fill(bad, 0), bad

        (q, bad_q), (k, bad_k), (v, bad_v) = zeroed(args.q), zeroed(args.k), zeroed(args.v)
        (g, bad_g), (beta, bad_beta), (p, bad_p) = zeroed(args.g), zeroed(args.beta), zeroed(args.p)
        whole = bad_k.any(-1) | bad_beta  # (B, T, H): every state column
        if bad_p is not None:
            whole |= bad_p.any(-1)
        if bad_g is not None:  # one per head, or one per key channel
            whole |= bad_g if bad_g.dim() == 3 else bad_g.any(-1)
        written = whole[..., None] | bad_v  # (B, T, H, V): the state columns made non-finite
        initial, bad_initial = zeroed(args.initial_state)
        if bad_initial is not None:
            written[:, 0] |= bad_initial.any(-2)
        self.state_columns = written.cummax(dim=1).values  # (B, T, H, V), from t on
        self.outputs = self.state_columns | bad_q.any(-1, keepdim=True)
        super().__init__(args._replace(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=initial))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.masked_fill(self.outputs, torch.nan)

    def output_at(self, o: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The output at steps at (B,), (B, 1, H, V)."""
        rows = torch.arange(at.shape[0], device=at.device)
        return o.masked_fill(self.outputs[rows, at][:, None], torch.nan)

    def final_state(self, state: torch.Tensor | None) -> torch.Tensor | None:
        """The state after the last step, (B, H, K, V)."""
        if state is None:
            return None
        return state.masked_fill(self.state_columns[:, -1, :, None, :], torch.nan)

    def states_at(self, states: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The states after steps at (B, P): (B, P, H, K, V)."""
        rows = torch.arange(at.shape[0], device=at.device)[:, None]
        return states.masked_fill(self.state_columns[rows, at][..., None, :], torch.nan)


def marks(args: DeltaArgs) -> AllFinite:
    """The inputs to run (`finite`) and how to mark the results (see the module docstring)."""
    return AllFinite(args) if all_finite(args) else NonFinite(args)
