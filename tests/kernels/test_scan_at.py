"""The scans at positions (mecheval_kernels.at_positions over selective_scan_fn, mamba2_scan,
chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, chunk_comba; chunk_gated_delta_product's in
its own test file): states after positions and outputs at positions against each op's per-step
reference, and a patched state against the reference resumed from the patch on each row's
suffix, without gradients and with them (the gradients too); bad arguments refused by name."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable

import pytest
import torch

from mecheval_kernels import (
    ScanAt,
    at_positions,
    chunk_comba,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    mamba2_scan,
    selective_scan_fn,
)
from mecheval_kernels.delta_rule import delta_rule_ref
from mecheval_kernels.delta_rule import torch_path as delta_torch_path
from mecheval_kernels.gated_delta_rule import gated_delta_rule_ref
from mecheval_kernels.positions import IMPLEMENTATIONS
from mecheval_kernels.selective_scan import selective_scan_ref
from mecheval_kernels.selective_scan import torch_path as scan_torch_path
from mecheval_kernels.ssd import mamba2_scan_ref

BATCH, LENGTH = 3, 11


def _selective_inputs(g: torch.Generator, layout: str = "var") -> dict:
    D, N = 6, 4
    shapes = {"fixed": (D, N), "var": (BATCH, N, LENGTH), "group": (BATCH, 2, N, LENGTH)}
    return dict(
        u=torch.randn(BATCH, D, LENGTH, generator=g),
        delta=torch.randn(BATCH, D, LENGTH, generator=g),
        A=-torch.rand(D, N, generator=g) - 0.1,
        B=torch.randn(*shapes[layout], generator=g),
        C=torch.randn(*shapes[layout], generator=g),
        D=torch.randn(D, generator=g),
        z=torch.randn(BATCH, D, LENGTH, generator=g),
        delta_bias=torch.randn(D, generator=g),
        delta_softplus=True,
        initial_state=torch.randn(BATCH, D, N, generator=g),
    )


def _mamba2_inputs(g: torch.Generator) -> dict:
    H, P, G, N = 4, 3, 2, 5
    return dict(
        x=torch.randn(BATCH, LENGTH, H, P, generator=g),
        dt=torch.randn(BATCH, LENGTH, H, generator=g),
        A=-torch.rand(H, generator=g) - 0.1,
        B=torch.randn(BATCH, LENGTH, G, N, generator=g),
        C=torch.randn(BATCH, LENGTH, G, N, generator=g),
        D=torch.randn(H, generator=g),
        z=torch.randn(BATCH, LENGTH, H, P, generator=g),
        dt_bias=torch.randn(H, generator=g),
        dt_softplus=True,
        initial_states=torch.randn(BATCH, H, P, N, generator=g),
    )


def _delta_inputs(g: torch.Generator, gated: bool = False) -> dict:
    H, K, V = 2, 5, 3
    x = dict(
        q=torch.randn(BATCH, LENGTH, H, K, generator=g),
        k=torch.randn(BATCH, LENGTH, H, K, generator=g),
        v=torch.randn(BATCH, LENGTH, H, V, generator=g),
        beta=torch.rand(BATCH, LENGTH, H, generator=g),
    )
    if gated:
        x["g"] = -torch.rand(BATCH, LENGTH, H, generator=g)
    return dict(
        x, initial_state=torch.randn(BATCH, H, K, V, generator=g), use_qk_l2norm_in_kernel=True
    )


def _kda_inputs(g: torch.Generator) -> dict:
    x = _delta_inputs(g)
    x["g"] = -torch.rand(*x["q"].shape, generator=g)  # a decay per key channel
    return x


def _comba_inputs(g: torch.Generator) -> dict:
    x = _delta_inputs(g, gated=True)
    x["p"] = torch.randn(*x["q"].shape, generator=g)  # the recall key
    return x


def _selective_ref(x: dict, states_at):
    return selective_scan_ref(**x, return_last_state=True, states_at=states_at)


def _mamba2_ref(x: dict, states_at):
    return mamba2_scan_ref(**x, return_final_states=True, states_at=states_at)


def _delta_ref(x: dict, states_at):
    return delta_rule_ref(**x, output_final_state=True, states_at=states_at)


def _gated_ref(x: dict, states_at):
    return gated_delta_rule_ref(**x, output_final_state=True, states_at=states_at)


_kda_ref = _gated_ref  # the family's reference, g per key channel
_comba_ref = _gated_ref  # the family's reference, with the recall key p


@dataclasses.dataclass(frozen=True)
class Spec:
    """One drop-in scan, at positions, and what its oracles need to know of its layouts."""

    name: str
    scan: Callable  # the drop-in
    ref: Callable  # ref(inputs, states_at) -> (out, final state, states)
    make: Callable[[torch.Generator], dict]
    initial: str  # the initial state's keyword
    timed: dict[str, int]  # inputs with batch and time axes -> their time axis
    out_time: int  # the output's time axis
    grad_input: str  # an input whose gradient the tests compare

    def at(self, *args, **kwargs) -> ScanAt:
        return at_positions(self.scan, *args, **kwargs)

    def inputs(self, seed: int) -> dict:
        return self.make(torch.Generator().manual_seed(seed))

    def cut(self, x: dict, row: int, start: int, stop: int) -> dict:
        """One row's inputs at positions [start, stop) (the row's initial state kept)."""
        out = {}
        for key, value in x.items():
            if key in self.timed and value.dim() > 2 or key == self.initial:
                value = value[row : row + 1]
            if key in self.timed and value.dim() > 2:
                value = value.narrow(self.timed[key], start, stop - start)
            out[key] = value
        return out


SPECS = [
    Spec(
        "selective_scan",
        selective_scan_fn,
        _selective_ref,
        _selective_inputs,
        "initial_state",
        {"u": -1, "delta": -1, "z": -1, "B": -1, "C": -1},
        2,
        "u",
    ),
    Spec(
        "mamba2_scan",
        mamba2_scan,
        _mamba2_ref,
        _mamba2_inputs,
        "initial_states",
        {"x": 1, "dt": 1, "z": 1, "B": 1, "C": 1},
        1,
        "x",
    ),
    Spec(
        "delta_rule",
        chunk_delta_rule,
        _delta_ref,
        _delta_inputs,
        "initial_state",
        {"q": 1, "k": 1, "v": 1, "beta": 1},
        1,
        "v",
    ),
    Spec(
        "gated_delta_rule",
        chunk_gated_delta_rule,
        _gated_ref,
        lambda g: _delta_inputs(g, gated=True),
        "initial_state",
        {"q": 1, "k": 1, "v": 1, "beta": 1, "g": 1},
        1,
        "g",
    ),
    Spec(
        "kda",
        chunk_kda,
        _kda_ref,
        _kda_inputs,
        "initial_state",
        {"q": 1, "k": 1, "v": 1, "beta": 1, "g": 1},
        1,
        "g",
    ),
    Spec(
        "comba",
        chunk_comba,
        _comba_ref,
        _comba_inputs,
        "initial_state",
        {"q": 1, "k": 1, "v": 1, "p": 1, "beta": 1, "g": 1},
        1,
        "p",
    ),
]
IDS = [s.name for s in SPECS]
ROWS = torch.arange(BATCH)


def _picked(spec: Spec, out: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The output at one position per row, with a time axis of 1 (as out_at returns it)."""
    return out.movedim(spec.out_time, 1)[ROWS, at].unsqueeze(spec.out_time)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_states_and_outputs_at_positions_equal_the_reference(spec, grad):
    x = spec.inputs(seed=0)
    if grad:
        x[spec.grad_input].requires_grad_()
    read = torch.tensor([[10, 0, 4], [3, 7, 3], [0, 10, 9]])
    one = torch.tensor([4, 10, 0])
    ref_out, ref_final, ref_states = spec.ref(x, read)
    result = spec.at(**x, states_at=read, out_at=one, return_final_state=True)
    torch.testing.assert_close(result.states, ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.out, _picked(spec, ref_out, one), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.final_state, ref_final, atol=1e-5, rtol=1e-5)
    alone = spec.at(**x, out_at=one)  # without states, and without the final state
    assert alone.final_state is None and alone.states is None
    torch.testing.assert_close(alone.out, result.out, atol=1e-5, rtol=1e-5)
    whole = spec.at(**x)
    torch.testing.assert_close(whole.out, ref_out, atol=1e-5, rtol=1e-5)
    if grad:
        weights = torch.randn(result.states.shape, generator=torch.Generator().manual_seed(1))
        got = torch.autograd.grad(
            (result.states * weights).sum() + result.out.sum(), x[spec.grad_input]
        )
        want = torch.autograd.grad(
            (ref_states * weights).sum() + _picked(spec, ref_out, one).sum(), x[spec.grad_input]
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _patched_oracle(spec: Spec, x: dict, positions, values) -> tuple:
    """(out, final state, every state) of the scan patched after positions[b]: each row's
    reference run up to its position, then the reference resumed from the patch."""
    outs, finals, states = [], [], []
    everything = torch.arange(LENGTH).expand(BATCH, LENGTH)
    whole_out, _, whole_states = spec.ref(x, everything)
    for row, p in enumerate(positions.tolist()):
        head = whole_out.movedim(spec.out_time, 1)[row : row + 1, : p + 1]
        row_states = [whole_states[row : row + 1, :p], values[row : row + 1, None]]
        final = values[row : row + 1]
        if p + 1 < LENGTH:
            rest = spec.cut(x, row, p + 1, LENGTH)
            rest[spec.initial] = values[row : row + 1]
            steps = torch.arange(LENGTH - p - 1)[None]
            tail, final, tail_states = spec.ref(rest, steps)
            head = torch.cat([head, tail.movedim(spec.out_time, 1)], dim=1)
            row_states.append(tail_states)
        outs.append(head.movedim(1, spec.out_time))
        finals.append(final)
        states.append(torch.cat(row_states, dim=1))
    return torch.cat(outs), torch.cat(finals), torch.cat(states)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_state_patch_equals_the_reference_resumed_from_the_patch(spec, grad):
    """The state after each row's position replaced inside the scan: outputs up to the
    position unpatched, after it the reference resumed from the patch; states read from the
    position on and the final state patched; with gradients, to the inputs and the values."""
    x = spec.inputs(seed=2)
    positions = torch.tensor([3, 0, LENGTH - 1])
    state_shape = spec.ref(x, None)[1].shape
    values = torch.randn(state_shape, generator=torch.Generator().manual_seed(3))
    if grad:
        x[spec.grad_input].requires_grad_()
        values.requires_grad_()
    everything = torch.arange(LENGTH).expand(BATCH, LENGTH)
    want_out, want_final, want_states = _patched_oracle(spec, x, positions, values)
    got = spec.at(
        **x, states_at=everything, state_patch=(positions, values), return_final_state=True
    )
    torch.testing.assert_close(got.out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.final_state, want_final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.states, want_states, atol=1e-5, rtol=1e-5)
    one = torch.tensor([3, 7, LENGTH - 1])  # one of them the patched position itself
    picked = spec.at(**x, out_at=one, state_patch=(positions, values))
    torch.testing.assert_close(picked.out, _picked(spec, want_out, one), atol=1e-5, rtol=1e-5)
    if grad:
        w = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(4))
        leaves = [x[spec.grad_input], values]
        grads = torch.autograd.grad((got.out * w).sum() + got.final_state.sum(), leaves)
        ref = torch.autograd.grad((want_out * w).sum() + want_final.sum(), leaves)
        for g_got, g_want in zip(grads, ref, strict=True):
            torch.testing.assert_close(g_got, g_want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_bad_arguments_are_refused_by_name(spec):
    x = spec.inputs(seed=5)
    state_shape = tuple(spec.ref(x, None)[1].shape)
    values = torch.zeros(state_shape)
    expected = ", ".join(map(str, state_shape))
    with pytest.raises(ValueError, match=rf"state_patch values must have shape \({expected}\)"):
        spec.at(**x, state_patch=(torch.tensor([0, 1, 2]), values[..., :1]))
    with pytest.raises(ValueError, match=rf"state_patch positions must lie in \[0, {LENGTH - 1}\]"):
        spec.at(**x, state_patch=(torch.tensor([0, LENGTH, 1]), values))
    with pytest.raises(ValueError, match="state_patch must be a"):
        spec.at(**x, state_patch=values)
    with pytest.raises(ValueError, match=rf"out_at must be a \(B,\) = \({BATCH},\) integer"):
        spec.at(**x, out_at=torch.tensor([[1], [2], [3]]))
    with pytest.raises(ValueError, match=rf"out_at must lie in \[0, {LENGTH - 1}\]"):
        spec.at(**x, out_at=torch.tensor([0, LENGTH, 1]))
    with pytest.raises(ValueError, match=r"states_at must be a \(B, P\)"):
        spec.at(**x, states_at=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="states_at must lie in"):
        spec.at(**x, states_at=torch.tensor([[0], [LENGTH], [1]]))


def test_a_scan_that_is_not_a_drop_in_is_refused_by_type():
    x = SPECS[0].inputs(seed=5)
    # Every drop-in of the table (mecheval_kernels.positions.IMPLEMENTATIONS), by name.
    allowed = ", ".join(f"mecheval_kernels.{scan.__name__}" for scan in IMPLEMENTATIONS)
    assert allowed.startswith(
        "mecheval_kernels.selective_scan_fn, mecheval_kernels.mamba2_scan, "
        "mecheval_kernels.chunk_delta_rule, mecheval_kernels.chunk_gated_delta_rule"
    )
    for scan in (selective_scan_ref, "selective_scan_fn", [selective_scan_fn]):
        with pytest.raises(TypeError, match=f"scan must be one of {re.escape(allowed)}, got"):
            at_positions(scan, **x)
    with pytest.raises(TypeError) as info:
        at_positions(selective_scan_ref, **x)
    for spec in SPECS:
        assert f"mecheval_kernels.{spec.scan.__name__}" in str(info.value)


FINAL_STATE_FLAGS = {
    "selective_scan": "return_last_state",
    "mamba2_scan": "return_final_states",
    "delta_rule": "output_final_state",
    "gated_delta_rule": "output_final_state",
    "kda": "output_final_state",
    "comba": "output_final_state",
}


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_drop_ins_own_final_state_flag_is_refused_by_name(spec):
    x = spec.inputs(seed=5)
    flag = FINAL_STATE_FLAGS[spec.name]
    with pytest.raises(TypeError, match=f"{flag}=True .* pass return_final_state=True"):
        spec.at(**x, **{flag: True})
    assert spec.at(**x, **{flag: False}).final_state is None  # its default: accepted


UNSUPPORTED = {
    "selective_scan": [],
    "mamba2_scan": [
        ("seq_idx", torch.zeros(BATCH, LENGTH, dtype=torch.int32)),
        ("cu_seqlens", torch.tensor([0, LENGTH])),
        ("return_varlen_states", True),
    ],
    "delta_rule": [("cu_seqlens", torch.tensor([0, LENGTH])), ("cu_seqlens_cpu", [0, LENGTH])],
    "gated_delta_rule": [("cu_seqlens", torch.tensor([0, LENGTH])), ("cp_context", object())],
    "kda": [("cu_seqlens", torch.tensor([0, LENGTH])), ("return_intermediate_states", True)],
    "comba": [("cu_seqlens", torch.tensor([0, LENGTH])), ("cu_seqlens_cpu", [0, LENGTH])],
}


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_arguments_the_scan_at_positions_does_not_run_are_refused_by_name(spec):
    """Packed sequences, whatever is asked (asked for nothing, Mamba-2's runs its drop-in)."""
    x = spec.inputs(seed=5)
    read = torch.tensor([[1], [2], [3]])
    for name, value in UNSUPPORTED[spec.name]:
        for asked in ({}, {"states_at": read}):
            with pytest.raises(
                ValueError, match=f"{spec.scan.__name__}: {name}=.* is not supported"
            ):
                spec.at(**x, **asked, **{name: value})
    # Bound by at_positions, or (a drop-in with **kwargs) refused by the drop-in: by name.
    with pytest.raises(TypeError, match=f"{spec.scan.__name__}.*'no_such'"):
        spec.at(**x, no_such=1)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_drop_ins_arguments_bind_positionally_in_its_order(spec):
    x = spec.inputs(seed=10)
    parameters = list(inspect.signature(spec.scan).parameters)
    ordered = {name: x[name] for name in parameters if name in x}
    positional = []
    for name in parameters[: max(parameters.index(name) for name in ordered) + 1]:
        default = inspect.signature(spec.scan).parameters[name].default
        positional.append(ordered.get(name, default))
    read = torch.tensor([[1], [2], [3]])
    by_name = spec.at(**x, states_at=read, return_final_state=True)
    by_position = spec.at(*positional, states_at=read, return_final_state=True)
    for a, b in zip(by_name, by_position, strict=True):
        assert torch.equal(a, b)


def test_mamba2_step_size_limit_is_honoured_at_positions():
    """dt_limit clamps the step sizes of the scan at positions too (states, patches)."""
    x = SPECS[1].inputs(seed=11)
    limit = (0.2, 0.6)
    out, final = mamba2_scan(**x, dt_limit=limit, return_final_states=True)
    everything = torch.arange(LENGTH).expand(BATCH, LENGTH)
    got = at_positions(
        mamba2_scan, **x, dt_limit=limit, states_at=everything, return_final_state=True
    )
    torch.testing.assert_close(got.out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.final_state, final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.states[:, -1], final, atol=1e-5, rtol=1e-5)
    unclamped = at_positions(mamba2_scan, **x, states_at=everything).out
    assert not torch.allclose(unclamped, out, atol=1e-3)


# States read at a few positions (each formed from its chunk), at most of them out of order and
# at every position in order (both stepped by the recurrence).
READS = {
    "few": [[10, 0, 4], [3, 7, 3], [1, 1, 9]],
    "most": [[2, 0, 1, 3, 3, 5], [4, 1, 0, 2, 2, 6], [0, 1, 2, 3, 4, 5]],
    "every": [list(range(LENGTH))] * BATCH,
}


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("chunk", [64, 4, 1], ids=["one_chunk", "chunks", "steps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_mamba2_states_and_patches_across_chunks(chunk, dtype, reads):
    """Mamba-2's chunked form: states read from the state entering their chunk (or, where
    most positions are read, by the recurrence), the output at one position per row from its
    chunk's row, a patched state as the scan plus its closed-form jump, across chunk boundaries
    (one chunk, chunks of 4 and of 1), in float32 and float64; with a position whose step is
    large (a decay of exp(-40)) to show the jump's decay is summed, not differenced."""
    spec = SPECS[1]
    x = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in spec.inputs(7).items()}
    x["dt"][:, 5] = 20.0
    read = torch.tensor(READS[reads])
    ref_out, ref_final, ref_states = spec.ref(x, read)
    got = spec.at(**x, chunk_size=chunk, states_at=read, return_final_state=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.states, ref_states, **tol)
    torch.testing.assert_close(got.final_state, ref_final, **tol)
    one = torch.tensor([3, 10, 6])
    alone = spec.at(**x, chunk_size=chunk, out_at=one)
    torch.testing.assert_close(alone.out, _picked(spec, ref_out, one), **tol)
    positions = torch.tensor([3, 8, 0])
    values = torch.randn(ref_final.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
    want_out, want_final, want_states = _patched_oracle(spec, x, positions, values)
    patched = spec.at(
        **x, chunk_size=chunk, states_at=read, state_patch=(positions, values),
        return_final_state=True,
    )  # fmt: skip
    torch.testing.assert_close(patched.out, want_out, **tol)
    torch.testing.assert_close(patched.final_state, want_final, **tol)
    torch.testing.assert_close(patched.states, want_states[ROWS[:, None], read], **tol)
    picked = spec.at(**x, chunk_size=chunk, out_at=one, state_patch=(positions, values))
    torch.testing.assert_close(picked.out, _picked(spec, want_out, one), **tol)


@pytest.mark.parametrize("layout", ["fixed", "var", "group"])
@pytest.mark.parametrize("small_tiles", [False, True], ids=["one_tile", "tiles_and_chunks"])
def test_selective_scan_one_pass_across_tiles_and_chunks(monkeypatch, layout, small_tiles):
    """The selective scan's PyTorch path forms states, outputs at positions and patches inside
    its tiles of rows and chunks of positions: the same as the reference and the oracle."""
    if small_tiles:  # tiles of 1 row, chunks of 2 positions
        monkeypatch.setattr(scan_torch_path, "CHUNK_ELEMENTS", 2 * 6 * 4)
        monkeypatch.setattr(scan_torch_path, "MIN_CHUNK", 2)
    spec = dataclasses.replace(SPECS[0], make=lambda g: _selective_inputs(g, layout))
    x = spec.inputs(seed=6)
    everything = torch.arange(LENGTH).expand(BATCH, LENGTH)
    ref_out, ref_final, ref_states = spec.ref(x, everything)
    got = spec.at(**x, states_at=everything, return_final_state=True, backend="torch")
    torch.testing.assert_close(got.states, ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.out, ref_out, atol=1e-5, rtol=1e-5)
    one = torch.tensor([10, 0, 5])
    picked = spec.at(**x, out_at=one, backend="torch")
    torch.testing.assert_close(picked.out, _picked(spec, ref_out, one), atol=1e-5, rtol=1e-5)
    positions = torch.tensor([3, 0, LENGTH - 1])
    values = torch.randn(BATCH, 6, 4, generator=torch.Generator().manual_seed(7))
    want_out, want_final, want_states = _patched_oracle(spec, x, positions, values)
    patched = spec.at(
        **x, states_at=everything, state_patch=(positions, values), return_final_state=True
    )
    torch.testing.assert_close(patched.out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patched.states, want_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patched.final_state, want_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS[2:], ids=IDS[2:])
@pytest.mark.parametrize("chunk", [64, 4], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("few", [False, True], ids=["every", "few"])
def test_delta_rule_states_and_out_at_across_chunks(monkeypatch, spec, chunk, few):
    """The delta-rule family: every state (a running sum per chunk) and a few per row (one
    masked matmul each), and the output at one step per row, across chunk boundaries."""
    monkeypatch.setattr(delta_torch_path, "CHUNK_SIZE", chunk)
    monkeypatch.setattr(delta_torch_path, "KEY_CHUNK_SIZE", chunk)
    x = spec.inputs(seed=8)
    read = (
        torch.tensor([[10, 0, 4], [3, 7, 3], [1, 1, 9]])
        if few
        else torch.arange(LENGTH).expand(BATCH, LENGTH)
    )
    ref_out, ref_final, ref_states = spec.ref(x, read)
    got = spec.at(**x, states_at=read, return_final_state=True, backend="torch")
    torch.testing.assert_close(got.states, ref_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.final_state, ref_final, atol=1e-5, rtol=1e-5)
    one = torch.tensor([10, 0, 5])
    picked = spec.at(**x, out_at=one, backend="torch")
    torch.testing.assert_close(picked.out, _picked(spec, ref_out, one), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_triton_backend_gives_the_same_scan_at_positions(spec):
    """Under the interpreter: the plain scan runs the Triton kernels; states and patches run
    the PyTorch path whatever the backend, so they agree exactly."""
    x = spec.inputs(seed=9)
    read, positions = torch.tensor([[4], [0], [10]]), torch.tensor([2, 5, 0])
    values = torch.randn(spec.ref(x, None)[1].shape, generator=torch.Generator().manual_seed(1))
    both = dict(states_at=read, state_patch=(positions, values), return_final_state=True)
    torch_run = spec.at(**x, **both, backend="torch")
    triton_run = spec.at(**x, **both, backend="triton")
    for a, b in zip(torch_run, triton_run, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        spec.at(**x, backend="triton").out, spec.at(**x, backend="torch").out, atol=1e-4, rtol=1e-4
    )
