"""causal_conv1d_fn against its reference: forward, every gradient, layouts, bad input.

The Triton path runs under Triton's interpreter on CPU (set up in tests/conftest.py) and
compiled on a GPU; the reference computes in float32 (float64 for gradcheck).
"""

from __future__ import annotations

import pytest
import torch

from mecheval_kernels import causal_conv1d_fn
from mecheval_kernels.short_conv import causal_conv1d_ref
from tests.kernels.tolerances import assert_close

D = 37  # not a power of two
LENGTHS = (1, 2, 7, 64, 130)


def _covering_cases() -> list[tuple[int, int, bool, str | None, bool]]:
    """(W, L, bias, activation, initial_states): every width twice, every length, flag and
    pairing of flags several times, without the full product (the interpreter is slow)."""
    cases = []
    for width in range(1, 9):
        for j in range(2):
            i = 2 * (width - 1) + j
            cases.append(
                (
                    width,
                    LENGTHS[i % len(LENGTHS)],
                    i % 2 == 0,
                    ("silu", None, "swish")[i % 3],
                    (i // 2) % 2 == 0,
                )
            )
    return cases


def _inputs(B, L, W, bias, init, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = make(B, D, L)
    weight = make(D, W)
    b = make(D) if bias else None
    s = make(B, D, W - 1) if init else None
    return x, weight, b, s


def _forward_and_grads(fn, x, weight, bias, activation, init, dy, dfinal, **kw):
    leaves = [
        t.detach().clone().requires_grad_() if t is not None else None
        for t in (x, weight, bias, init)
    ]
    y, final = fn(
        leaves[0],
        leaves[1],
        leaves[2],
        activation=activation,
        initial_states=leaves[3],
        return_final_states=True,
        **kw,
    )
    torch.autograd.backward([y, final], [dy, dfinal])
    return y, final, [t.grad if t is not None else None for t in leaves]


def _check_against_reference(x, weight, bias, activation, init, dtype, backend):
    B, _, L = x.shape
    dy = torch.randn_like(x)
    dfinal = torch.randn(B, D, weight.shape[1] - 1, dtype=x.dtype, device=x.device)
    y, final, grads = _forward_and_grads(
        causal_conv1d_fn, x, weight, bias, activation, init, dy, dfinal, backend=backend
    )
    # The oracle sees the same (already rounded) inputs, in float32.
    up = lambda t: None if t is None else t.float()  # noqa: E731
    y_ref, final_ref, grads_ref = _forward_and_grads(
        causal_conv1d_ref, up(x), up(weight), up(bias), activation, up(init), up(dy), up(dfinal)
    )
    assert y.dtype == x.dtype and final.dtype == x.dtype
    assert_close(y, y_ref, dtype, "y")
    assert_close(final, final_ref, dtype, "final_states")
    for name, g, g_ref in zip(
        ("dx", "dweight", "dbias", "dinitial_states"), grads, grads_ref, strict=True
    ):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            assert g.dtype == dtype, name
            assert_close(g, g_ref, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("width,L,bias,activation,init", _covering_cases())
def test_triton_matches_reference(device, dtype, width, L, bias, activation, init):
    x, weight, b, s = _inputs(2, L, width, bias, init, dtype, device)
    _check_against_reference(x, weight, b, activation, s, dtype, "triton")


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_torch_path_matches_reference(width, L, activation):
    x, weight, b, s = _inputs(3, L, width, True, True, torch.float32, "cpu", seed=width * L)
    _check_against_reference(x, weight, b, activation, s, torch.float32, "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("width,L,bias,activation,init", _covering_cases())
def test_triton_bf16_matches_reference(device, width, L, bias, activation, init):
    x, weight, b, s = _inputs(2, L, width, bias, init, torch.bfloat16, device)
    _check_against_reference(x, weight, b, activation, s, torch.bfloat16, "triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_inputs(device, backend, layout):
    B, L, W = 2, 20, 4
    if backend == "torch":
        device = torch.device("cpu")
    if layout == "transposed":  # models hold (B, L, D); the op reads it in place as (B, D, L)
        x = torch.randn(B, L, D, device=device).transpose(1, 2)
    else:  # every other position of a longer sequence
        x = torch.randn(B, D, 2 * L, device=device)[:, :, ::2]
    assert not x.is_contiguous()
    weight, bias = torch.randn(D, W, device=device), torch.randn(D, device=device)
    _check_against_reference(x, weight, bias, "silu", None, torch.float32, backend)
    y = causal_conv1d_fn(x, weight, bias, activation="silu", backend=backend)
    assert y.stride() == torch.empty_like(x).stride()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_streaming_in_chunks_equals_one_call(device, backend):
    """Feeding the sequence in pieces, carrying final_states, gives the one-call output."""
    if backend == "torch":
        device = torch.device("cpu")
    x, weight, bias, _ = _inputs(2, 23, 4, True, False, torch.float32, device)
    whole = causal_conv1d_fn(x, weight, bias, activation="silu", backend=backend)
    pieces, state = [], None
    for start, stop in ((0, 1), (1, 3), (3, 14), (14, 23)):
        y, state = causal_conv1d_fn(
            x[:, :, start:stop],
            weight,
            bias,
            initial_states=state,
            return_final_states=True,
            activation="silu",
            backend=backend,
        )
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=-1), whole, rtol=1e-6, atol=1e-6)


def test_triton_backward_is_deterministic(device):
    x, weight, bias, init = _inputs(3, 130, 4, True, True, torch.float32, device)
    dy = torch.randn_like(x)
    dfinal = torch.zeros(3, D, 3, device=device)
    runs = [
        _forward_and_grads(
            causal_conv1d_fn, x, weight, bias, "silu", init, dy, dfinal, backend="triton"
        )[2]
        for _ in range(2)
    ]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_gradcheck_float64_torch_path(width):
    g = torch.Generator().manual_seed(width)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    args = (make(2, 5, 6), make(5, width), make(5), None, make(2, 5, width - 1), True)
    fn = lambda *a: causal_conv1d_fn(*a, activation="silu", backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_final_states_shorter_than_window_reach_into_initial_states(device, backend):
    if backend == "torch":
        device = torch.device("cpu")
    x = torch.arange(2.0, device=device).reshape(1, 1, 2)  # L = 2 < W - 1 = 4
    init = torch.tensor([[[10.0, 11.0, 12.0, 13.0]]], device=device)
    weight = torch.zeros(1, 5, device=device)
    _, final = causal_conv1d_fn(x, weight, None, None, init, True, backend=backend)
    assert torch.equal(final.cpu(), torch.tensor([[[12.0, 13.0, 0.0, 1.0]]]))


def test_compiles_fullgraph_with_backward():
    class ConvModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.weight = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, h):  # h (B, L, C), as models hold it
            y = causal_conv1d_fn(self.proj(h).transpose(1, 2), self.weight, activation="silu")
            return y.transpose(1, 2)

    model, h = ConvModel(), torch.randn(2, 9, 8)
    eager = model(h)
    eager.square().sum().backward()
    expected = model.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(h)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.weight.grad, expected)


# (arguments as keyword overrides of a valid call, expected error type, words the message names)
BAD_INPUTS = [
    (dict(x=torch.randn(4, 5)), ValueError, ["x", "(B, D, L)"]),
    (dict(x=torch.randn(2, 4, 5).long()), TypeError, ["x", "int64"]),
    (dict(x="not a tensor"), TypeError, ["x", "Tensor"]),
    (dict(x=torch.randn(2, 4, 0)), ValueError, ["x", "L >= 1"]),
    (dict(weight=torch.randn(3, 4)), ValueError, ["weight", "(D, W)", "D: 3 != 4"]),
    (dict(weight=torch.randn(4)), ValueError, ["weight", "(D, W)"]),
    (dict(weight=torch.randn(4, 9)), ValueError, ["width", "between 1 and 8", "9"]),
    (dict(weight=torch.randn(4, 4, dtype=torch.float64)), None, []),  # fine on the torch path
    (dict(bias=torch.randn(5)), ValueError, ["bias", "(D)"]),
    (dict(initial_states=torch.randn(2, 4, 4)), ValueError, ["initial_states", "W-1: 4 != 3"]),
    (dict(initial_states=torch.randn(3, 4, 3)), ValueError, ["initial_states", "B: 3 != 2"]),
    (dict(activation="relu"), ValueError, ["activation", "relu"]),
    (dict(weight=torch.randn(4, 4, device="meta")), ValueError, ["one device", "weight on meta"]),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = dict(
        x=torch.randn(2, 4, 5),
        weight=torch.randn(4, 4),
        bias=None,
        activation=None,
        initial_states=None,
    )
    args.update(overrides)
    if error is None:
        causal_conv1d_fn(**args, backend="torch")
        return
    with pytest.raises(error) as info:
        causal_conv1d_fn(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_triton_refuses_float64_by_name(device):
    x = torch.randn(1, 2, 3, dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match="x has dtype float64"):
        causal_conv1d_fn(x, torch.randn(2, 2, device=device), backend="triton")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_conv1d_fn(torch.randn(1, 2, 3), torch.randn(2, 2), backend="cuda")


@pytest.mark.parametrize("activation", [None, "silu"])
def test_second_derivatives_gradgradcheck_float64(activation):
    """Second derivatives (create_graph) as causal-conv1d's causal_conv1d_ref (F.conv1d) gives
    them, the initial states' included."""
    gen = torch.Generator().manual_seed(4)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    leaves = [t.requires_grad_() for t in (make(2, 3, 5), make(3, 4), make(3), make(2, 3, 3))]

    def fn(x, weight, bias, initial_states):
        return causal_conv1d_fn(x, weight, bias, None, initial_states, activation=activation,
                                backend="torch")  # fmt: skip

    assert torch.autograd.gradgradcheck(fn, leaves)
