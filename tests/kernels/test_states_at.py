"""States after given positions from one pass (`states_at` of the selective scan and of the
delta rule) against the per-step references and against the state a scan cut after that
position carries out."""

from __future__ import annotations

import pytest
import torch

from kernels import chunk_delta_rule, selective_scan_fn
from kernels.delta_rule import delta_rule_ref
from kernels.delta_rule import torch_path as delta_torch_path
from kernels.selective_scan import selective_scan_ref
from kernels.selective_scan import torch_path as scan_torch_path


def _scan_inputs(layout: str, seed: int = 0, batch: int = 3, channels: int = 6, length: int = 13):
    g = torch.Generator().manual_seed(seed)
    N = 4
    shapes = {"fixed": (channels, N), "var": (batch, N, length), "group": (batch, 2, N, length)}
    return dict(
        u=torch.randn(batch, channels, length, generator=g),
        delta=torch.randn(batch, channels, length, generator=g),
        A=-torch.rand(channels, N, generator=g) - 0.1,
        B=torch.randn(*shapes[layout], generator=g),
        C=torch.randn(*shapes[layout], generator=g),
        D=torch.randn(channels, generator=g),
        z=torch.randn(batch, channels, length, generator=g),
        delta_bias=torch.randn(channels, generator=g),
        delta_softplus=True,
        initial_state=torch.randn(batch, channels, N, generator=g),
    )


@pytest.mark.parametrize("layout", ["fixed", "var", "group"])
@pytest.mark.parametrize("small_tiles", [False, True], ids=["one_tile", "tiles_and_chunks"])
def test_selective_scan_states_equal_the_reference(monkeypatch, layout, small_tiles):
    if small_tiles:  # tiles of 1 row, chunks of 2 positions
        monkeypatch.setattr(scan_torch_path, "CHUNK_ELEMENTS", 2 * 6 * 4)
        monkeypatch.setattr(scan_torch_path, "MIN_CHUNK", 2)
    x = _scan_inputs(layout)
    every = torch.arange(13).expand(3, 13)
    out, last, states = selective_scan_fn(
        **x, return_last_state=True, states_at=every, backend="torch"
    )
    ref_out, ref_last, ref_states = selective_scan_ref(**x, return_last_state=True, states_at=every)
    assert states.shape == (3, 13, 6, 4) and states.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, ref_last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    # Without the last state, the states come second; rows may ask for their own positions.
    at = torch.tensor([[12, 0, 5], [3, 3, 7], [0, 11, 1]])
    only = selective_scan_fn(**x, states_at=at, backend="torch")
    torch.testing.assert_close(only[1], states[torch.arange(3)[:, None], at])


@pytest.mark.parametrize("layout", ["fixed", "var", "group"])
@pytest.mark.parametrize("small_tiles", [False, True], ids=["one_tile", "tiles_and_chunks"])
def test_selective_scan_out_at_is_the_whole_output_there(monkeypatch, layout, small_tiles):
    """out_at forms each row's output at its position alone: the whole output's there, with
    the same last state; with gradients (or without D and z) too."""
    if small_tiles:
        monkeypatch.setattr(scan_torch_path, "CHUNK_ELEMENTS", 2 * 6 * 4)
        monkeypatch.setattr(scan_torch_path, "MIN_CHUNK", 2)
    x = _scan_inputs(layout)
    at = torch.tensor([12, 0, 5])
    rows = torch.arange(3)
    whole, last = selective_scan_fn(**x, return_last_state=True, backend="torch")
    out, last_at = selective_scan_fn(**x, return_last_state=True, out_at=at, backend="torch")
    assert out.shape == (3, 6, 1)
    torch.testing.assert_close(out[..., 0], whole[rows, :, at], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last_at, last)
    bare = {k: v for k, v in x.items() if k not in ("D", "z")}
    plain = selective_scan_fn(**bare, backend="torch")
    torch.testing.assert_close(
        selective_scan_fn(**bare, out_at=at, backend="torch")[..., 0], plain[rows, :, at]
    )
    x["u"].requires_grad_()
    with_grad = selective_scan_fn(**x, out_at=at)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad[..., 0], whole[rows, :, at], atol=1e-5, rtol=1e-5)


def test_selective_scan_out_at_refuses_bad_positions():
    x = _scan_inputs("var")
    with pytest.raises(ValueError, match=r"out_at must be a \(B,\) = \(3,\) integer tensor"):
        selective_scan_fn(**x, out_at=torch.tensor([[1], [2], [3]]))
    with pytest.raises(ValueError, match=r"out_at must be a \(B,\)"):
        selective_scan_fn(**x, out_at=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"out_at must lie in \[0, 12\]"):
        selective_scan_fn(**x, out_at=torch.tensor([1, 13, 0]))


def test_selective_scan_out_at_with_states_at_gives_both():
    """The outputs at out_at and the states at states_at from one scan, as each alone gives
    them (without gradients and with: by steps)."""
    x = _scan_inputs("var")
    at, read = torch.tensor([4, 11, 0]), torch.tensor([[0, 5], [3, 12], [7, 7]])
    whole, last, states = selective_scan_fn(**x, return_last_state=True, states_at=read)
    rows = torch.arange(3)
    out, last_at, states_at = selective_scan_fn(
        **x, return_last_state=True, states_at=read, out_at=at
    )
    torch.testing.assert_close(out[..., 0], whole[rows, :, at], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states_at, states)
    torch.testing.assert_close(last_at, last)
    x["u"].requires_grad_()
    out, states_grad = selective_scan_fn(**x, states_at=read, out_at=at)
    assert out.requires_grad
    torch.testing.assert_close(out[..., 0], whole[rows, :, at], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states_grad, states, atol=1e-5, rtol=1e-5)


def _row_after(x: dict, row: int, p: int) -> dict:
    """Scan inputs of one row from position p + 1 on (inputs without a batch axis as given)."""
    per_row = {"u", "delta", "z", "initial_state"} | {k for k in ("B", "C") if x[k].dim() > 2}
    timed = per_row - {"initial_state"}
    one = {k: v[row : row + 1] if k in per_row else v for k, v in x.items()}
    return {k: v[..., p + 1 :] if k in timed else v for k, v in one.items()}


@pytest.mark.parametrize("layout", ["fixed", "var", "group"])
@pytest.mark.parametrize("small_tiles", [False, True], ids=["one_tile", "tiles_and_chunks"])
def test_selective_scan_state_patch_equals_a_scan_cut_there(monkeypatch, layout, small_tiles):
    """state_patch replaces the state after each row's position within the one scan: the
    outputs up to it are the unpatched scan's, those after it the scan resumed from the patch,
    and states read from it on (and the last state) are the patched ones."""
    if small_tiles:
        monkeypatch.setattr(scan_torch_path, "CHUNK_ELEMENTS", 2 * 6 * 4)
        monkeypatch.setattr(scan_torch_path, "MIN_CHUNK", 2)
    x = _scan_inputs(layout, seed=4)
    positions = torch.tensor([3, 0, 12])
    values = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(5))
    every = torch.arange(13).expand(3, 13)
    with torch.no_grad():
        whole = selective_scan_fn(**x, backend="torch")
        out, last, states = selective_scan_fn(
            **x, return_last_state=True, states_at=every, state_patch=(positions, values)
        )
        for row, p in enumerate(positions.tolist()):
            after = _row_after(x, row, p)
            after["initial_state"] = values[row : row + 1]
            torch.testing.assert_close(out[row, :, : p + 1], whole[row, :, : p + 1])
            torch.testing.assert_close(states[row, p], values[row])
            if p + 1 < 13:
                rest, rest_last = selective_scan_fn(**after, return_last_state=True)
                torch.testing.assert_close(
                    out[row : row + 1, :, p + 1 :], rest, atol=1e-5, rtol=1e-5
                )
                torch.testing.assert_close(last[row], rest_last[0], atol=1e-5, rtol=1e-5)
            else:
                torch.testing.assert_close(last[row], values[row])
        # Read out at one position per row (one of them the patched position itself).
        out_at = torch.tensor([3, 7, 12])
        picked = selective_scan_fn(**x, out_at=out_at, state_patch=(positions, values))
        torch.testing.assert_close(picked[..., 0], out[torch.arange(3), :, out_at])
        with pytest.raises(ValueError, match=r"state_patch values must have shape \(3, 6, 4\)"):
            selective_scan_fn(**x, state_patch=(positions, values[:, :, :2]))
        with pytest.raises(ValueError, match=r"state_patch positions must lie in \[0, 12\]"):
            selective_scan_fn(**x, state_patch=(torch.tensor([0, 13, 1]), values))
    x["u"].requires_grad_()
    with pytest.raises(ValueError, match="state_patch runs without gradients"):
        selective_scan_fn(**x, state_patch=(positions, values))


def test_selective_scan_states_equal_splitting_the_scan():
    """states[:, t] is the last state of the scan cut after position t."""
    x = _scan_inputs("var", seed=1)
    _, states = selective_scan_fn(**x, states_at=torch.arange(13).expand(3, 13))
    for t in (0, 5, 12):
        cut = {
            k: v[..., : t + 1] if k in ("u", "delta", "z", "B", "C") else v for k, v in x.items()
        }
        _, last = selective_scan_fn(**cut, return_last_state=True)
        torch.testing.assert_close(states[:, t], last, atol=1e-5, rtol=1e-5)


def test_selective_scan_states_with_gradients():
    """When a gradient is needed the states come from one call per position, and gradients
    through them equal the reference's."""
    x = _scan_inputs("group", seed=2, length=6)
    x["u"].requires_grad_()
    x["initial_state"].requires_grad_()
    at = torch.tensor([[5, 0, 2], [1, 1, 4], [3, 5, 0]])
    _, states = selective_scan_fn(**x, states_at=at)
    _, ref_states = selective_scan_ref(**x, states_at=at)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    weights = torch.randn(states.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((states * weights).sum(), [x["u"], x["initial_state"]])
    ref = torch.autograd.grad((ref_states * weights).sum(), [x["u"], x["initial_state"]])
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_selective_scan_states_on_the_triton_backend_run_the_torch_path():
    x = _scan_inputs("fixed", seed=4)
    at = torch.tensor([[4], [0], [12]])
    a = selective_scan_fn(**x, states_at=at, backend="torch")
    b = selective_scan_fn(**x, states_at=at, backend="triton")
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


def _delta_inputs(seed: int = 0, B: int = 2, T: int = 11, H: int = 2, K: int = 5, V: int = 3):
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(B, T, H, K, generator=g),
        k=torch.randn(B, T, H, K, generator=g),
        v=torch.randn(B, T, H, V, generator=g),
        beta=torch.rand(B, T, H, generator=g),
        initial_state=torch.randn(B, H, K, V, generator=g),
        use_qk_l2norm_in_kernel=True,
    )


@pytest.mark.parametrize("chunk", [64, 4], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("few", [False, True], ids=["every", "few"])
def test_delta_rule_states_equal_the_reference(monkeypatch, chunk, few):
    """Every state (a cumulative sum per chunk) and a few per row (one masked matmul each)."""
    monkeypatch.setattr(delta_torch_path, "CHUNK_SIZE", chunk)
    x = _delta_inputs()
    at = torch.tensor([[10, 0, 4], [3, 7, 3]]) if few else torch.arange(11).expand(2, 11)
    o, final, states = chunk_delta_rule(**x, output_final_state=True, states_at=at, backend="torch")
    ref_o, ref_final, ref_states = delta_rule_ref(**x, output_final_state=True, states_at=at)
    assert states.shape == (2, at.shape[1], 2, 5, 3) and states.dtype == torch.float32
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    assert chunk_delta_rule(**x, states_at=at)[1] is None


def test_delta_rule_states_equal_splitting_the_sequence():
    x = _delta_inputs(seed=1)
    _, _, states = chunk_delta_rule(**x, states_at=torch.arange(11).expand(2, 11))
    for t in (0, 4, 10):
        cut = {k: v[:, : t + 1] if k in ("q", "k", "v", "beta") else v for k, v in x.items()}
        _, final = chunk_delta_rule(**cut, output_final_state=True)
        torch.testing.assert_close(states[:, t], final, atol=1e-5, rtol=1e-5)


def test_delta_rule_states_with_gradients():
    x = _delta_inputs(seed=2, T=5)
    x["v"].requires_grad_()
    x["initial_state"].requires_grad_()
    at = torch.tensor([[4, 0], [2, 2]])
    _, _, states = chunk_delta_rule(**x, states_at=at)
    _, _, ref_states = delta_rule_ref(**x, states_at=at)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    weights = torch.randn(states.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((states * weights).sum(), [x["v"], x["initial_state"]])
    ref = torch.autograd.grad((ref_states * weights).sum(), [x["v"], x["initial_state"]])
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "at, words",
    [
        (torch.tensor([[0], [13]]), "must lie in"),
        (torch.tensor([0, 1]), "(B, P)"),
        (torch.tensor([[0.0], [1.0]]), "integer"),
    ],
)
def test_bad_positions_are_refused_by_name(at, words):
    x = _scan_inputs("fixed", batch=2)
    with pytest.raises(ValueError, match="states_at") as error:
        selective_scan_fn(**x, states_at=at)
    assert words in str(error.value)


@pytest.mark.parametrize("chunk", [64, 4], ids=["one_chunk", "chunks"])
def test_delta_rule_out_at_is_the_whole_output_there(monkeypatch, chunk):
    """out_at forms each row's output at its step alone: the whole output's there, with the
    same final state; with gradients too (the whole output, picked); bad positions refused."""
    monkeypatch.setattr(delta_torch_path, "CHUNK_SIZE", chunk)
    x = _delta_inputs(seed=6, B=3)
    at = torch.tensor([10, 0, 5])
    rows = torch.arange(3)
    whole, final = chunk_delta_rule(**x, output_final_state=True, backend="torch")
    o, final_at = chunk_delta_rule(**x, output_final_state=True, out_at=at, backend="torch")
    assert o.shape == (3, 1, 2, 3)
    torch.testing.assert_close(o[:, 0], whole[rows, at], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_at, final)
    assert chunk_delta_rule(**x, out_at=at, backend="torch")[1] is None
    x["v"].requires_grad_()
    with_grad, _ = chunk_delta_rule(**x, out_at=at)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad[:, 0], whole[rows, at], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"out_at must be a \(B,\) = \(3,\) integer tensor"):
        chunk_delta_rule(**x, out_at=at[:2])
    with pytest.raises(ValueError, match=r"out_at must lie in \[0, 10\]"):
        chunk_delta_rule(**x, out_at=torch.tensor([11, 0, 0]))


@pytest.mark.parametrize("chunk", [64, 4], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial_state", "zero_state"])
def test_delta_rule_without_a_backward_equals_the_forward_that_saves(monkeypatch, chunk, initial):
    """With no backward to come the PyTorch path keeps no saved buffers: the same outputs."""
    monkeypatch.setattr(delta_torch_path, "CHUNK_SIZE", chunk)
    x = _delta_inputs(seed=7)
    if not initial:
        x["initial_state"] = None
    with torch.no_grad():
        o, final = chunk_delta_rule(**x, output_final_state=True, backend="torch")
    x["v"] = x["v"].clone().requires_grad_()
    o_saving, final_saving = chunk_delta_rule(**x, output_final_state=True, backend="torch")
    torch.testing.assert_close(o, o_saving.detach())
    torch.testing.assert_close(final, final_saving.detach())
