"""selective_scan_fn against its reference (the per-step recurrence): forward, every gradient,
scan splitting with a carried state, determinism, extreme inputs, torch.compile, bad input.

The Triton kernels run under Triton's interpreter on CPU (set up in tests/conftest.py) and
compiled on a GPU; the reference computes in float32 (float64 for gradcheck) on the same,
already-rounded inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mecheval_kernels import selective_scan_fn
from mecheval_kernels.selective_scan import selective_scan_ref
from tests.kernels.tolerances import assert_close

INPUT_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: shape, which optional parts are present, and the layouts of B and C."""

    batch: int = 2
    channels: int = 6
    state: int = 5
    length: int = 37
    b_layout: str = "var"  # "fixed" (D, N), "var" (B, N, L) or "group" (B, G, N, L)
    c_layout: str = "var"
    groups: int = 2  # of a grouped B or C
    D: bool = True
    z: bool = True
    delta_bias: bool = True
    softplus: bool = True
    last_state: bool = True
    initial_state: bool = False

    def id(self) -> str:
        flags = [
            n for n in ("D", "z", "delta_bias", "softplus", "initial_state") if getattr(self, n)
        ]
        if self.last_state:
            flags.append("last")
        return (
            f"B{self.batch}D{self.channels}N{self.state}L{self.length}-"
            f"{self.b_layout}{self.c_layout}{self.groups}-" + "+".join(flags or ["plain"])
        )


def make_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Inputs of a Mamba layer's scan: A < 0, delta around softplus's knee (or positive)."""
    g = torch.Generator().manual_seed(seed)
    Bn, Dn, N, L = case.batch, case.channels, case.state, case.length

    def rand(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    def bc(layout):
        return {
            "fixed": lambda: rand(Dn, N),
            "var": lambda: rand(Bn, N, L),
            "group": lambda: rand(Bn, case.groups, N, L),
        }[layout]()

    # Without softplus, dt = delta + delta_bias is used as is: keep it positive (a decay).
    if case.softplus:
        delta, bias = rand(Bn, Dn, L, scale=0.5), rand(Dn, scale=0.3)
    else:
        delta, bias = torch.rand(Bn, Dn, L, generator=g), 0.1 * torch.rand(Dn, generator=g)
    args = dict(
        u=rand(Bn, Dn, L),
        delta=delta,
        A=-torch.exp(rand(Dn, N, scale=0.5)),
        B=bc(case.b_layout),
        C=bc(case.c_layout),
        D=rand(Dn) if case.D else None,
        z=rand(Bn, Dn, L) if case.z else None,
        delta_bias=bias if case.delta_bias else None,
        initial_state=rand(Bn, Dn, N) if case.initial_state else None,
    )
    # A stays float32, as Mamba keeps it; the rest in the tested dtype.
    return {
        k: None if v is None else v.to(device=device, dtype=torch.float32 if k == "A" else dtype)
        for k, v in args.items()
    }


def fresh_leaves(args: dict) -> dict:
    return {k: None if v is None else v.detach().clone().requires_grad_() for k, v in args.items()}


def forward_and_grads(fn, args: dict, case: Case, dout, dlast, **kw):
    """Output, last state (or None) and the gradient of every input (None for absent ones)."""
    leaves = fresh_leaves(args)
    result = fn(**leaves, delta_softplus=case.softplus, return_last_state=case.last_state, **kw)
    out, last = result if case.last_state else (result, None)
    outs, cots = [out], [dout]
    if case.last_state:
        outs.append(last)
        cots.append(dlast)
    torch.autograd.backward(outs, cots)
    return out, last, {k: None if v is None else v.grad for k, v in leaves.items()}


def check_against_reference(case: Case, dtype: torch.dtype, device, backend: str, args=None):
    args = make_inputs(case, dtype, device) if args is None else args
    g = torch.Generator().manual_seed(1)
    shape = (case.batch, case.channels, case.length)
    dout = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    dlast = torch.randn(case.batch, case.channels, case.state, generator=g).to(device)
    out, last, grads = forward_and_grads(
        selective_scan_fn, args, case, dout, dlast, backend=backend
    )
    up = lambda t: None if t is None else t.float()  # noqa: E731
    out_ref, last_ref, grads_ref = forward_and_grads(
        selective_scan_ref, {k: up(v) for k, v in args.items()}, case, up(dout), dlast
    )
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, out_ref, dtype, "out")
    if case.last_state:
        assert last.dtype == torch.float32
        assert_close(last, last_ref, dtype, "last_state")
    for name in INPUT_NAMES:
        assert (grads[name] is None) == (grads_ref[name] is None), name
        if grads[name] is not None:
            assert grads[name].dtype == args[name].dtype, name
            assert_close(grads[name], grads_ref[name], dtype, f"d{name}")


# The Triton kernels under the interpreter (slow: its scans run element by element), so small
# shapes and a covering set rather than the full product: every value of every option appears
# several times, in both dtypes, across lengths that stop inside, at and across chunk boundaries
# (chunks are 16 positions here), with channel and state sizes that are not powers of two.
TRITON_CASES = [
    Case(length=1),
    Case(
        length=5,
        b_layout="fixed",
        c_layout="group",
        groups=3,
        D=False,
        delta_bias=False,
        softplus=False,
        last_state=False,
        initial_state=True,
    ),
    Case(length=37, b_layout="group", c_layout="fixed", z=False, initial_state=True),
    Case(batch=1, channels=5, state=3, length=37, c_layout="fixed", D=False, softplus=False),
    Case(
        batch=1,
        state=3,
        length=100,
        b_layout="group",
        delta_bias=False,
        last_state=False,
        initial_state=True,
    ),
    Case(
        batch=1, channels=3, length=100, b_layout="fixed", c_layout="fixed", z=False, softplus=False
    ),
    Case(
        batch=1,
        channels=3,
        state=3,
        length=300,
        c_layout="group",
        groups=3,
        D=False,
        initial_state=True,
    ),
    Case(
        batch=1,
        channels=3,
        state=2,
        length=300,
        b_layout="fixed",
        D=True,
        z=False,
        delta_bias=False,
        softplus=False,
        last_state=False,
    ),
    Case(
        channels=7,
        state=3,
        length=5,
        b_layout="group",
        c_layout="group",
        groups=7,
        delta_bias=False,
        initial_state=True,
    ),
    Case(batch=1, channels=3, state=17, length=20),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c.id() for c in TRITON_CASES])
def test_triton_matches_reference(device, case, dtype):
    check_against_reference(case, dtype, device, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c.id() for c in TRITON_CASES])
def test_triton_bf16_matches_reference(device, case):
    check_against_reference(case, torch.bfloat16, device, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [
        Case(batch=2, channels=64, state=16, length=300, initial_state=True),
        Case(
            batch=2,
            channels=96,
            state=16,
            length=1000,
            b_layout="group",
            c_layout="group",
            groups=4,
        ),
        Case(batch=1, channels=32, state=64, length=129, b_layout="fixed", c_layout="var"),
    ],
    ids=["mamba-shape", "grouped-long", "wide-state"],
)
def test_triton_model_shapes_match_reference(device, case, dtype):
    """Model-sized shapes (several channel blocks and chunks per program), on a GPU only."""
    check_against_reference(case, dtype, device, "triton")


# The PyTorch path: fast, so a broad set of cases.
TORCH_CASES = [
    Case(),
    Case(length=1),
    Case(length=5, D=False, z=False, delta_bias=False, softplus=False, last_state=False),
    Case(length=100, b_layout="fixed", c_layout="fixed", initial_state=True),
    Case(length=37, b_layout="group", c_layout="fixed", groups=3, z=False),
    Case(length=37, b_layout="fixed", c_layout="group", groups=6, delta_bias=False),
    Case(length=300, b_layout="group", c_layout="var", initial_state=True, softplus=False),
    Case(channels=7, state=3, length=64, b_layout="var", c_layout="group", groups=7, D=False),
    Case(batch=1, channels=1, state=1, length=9, b_layout="fixed", c_layout="var", z=False),
    Case(batch=3, channels=4, state=16, length=50, b_layout="group", c_layout="group", groups=4),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=[c.id() for c in TORCH_CASES])
def test_torch_path_matches_reference(case):
    check_against_reference(case, torch.float32, "cpu", "torch")


@pytest.mark.parametrize("case", TORCH_CASES[:4], ids=[c.id() for c in TORCH_CASES[:4]])
def test_torch_path_fp16_matches_reference(case):
    check_against_reference(case, torch.float16, "cpu", "torch")


def test_torch_path_long_sequence_spans_many_chunks(monkeypatch):
    """Chunk boundaries and batch tiles inside the PyTorch path (normally sized by a memory
    budget): tiles of one row, chunks of 7 positions."""
    from mecheval_kernels.selective_scan import torch_path

    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 6 * 5 * 7)
    monkeypatch.setattr(torch_path, "MIN_CHUNK", 7)
    assert torch_path.tile_rows(2, 6, 5, 40) == 1 and torch_path.chunk_length(2, 6, 5, 40) == 7
    case = Case(length=40, b_layout="group", c_layout="fixed", initial_state=True)
    check_against_reference(case, torch.float32, "cpu", "torch")


@pytest.mark.parametrize(
    "case",
    [
        Case(batch=2, channels=3, state=2, length=5, initial_state=True),
        Case(
            batch=2,
            channels=4,
            state=3,
            length=4,
            b_layout="fixed",
            c_layout="group",
            groups=2,
            softplus=False,
            z=False,
        ),
    ],
    ids=["var-all-options", "fixed-group"],
)
def test_gradcheck_float64_torch_path(monkeypatch, case):
    from mecheval_kernels.selective_scan import torch_path

    # Tiles of one row and chunks of 2 positions, so the carried state and adjoint cross chunk
    # boundaries and the gradients of shared inputs are summed over tiles.
    monkeypatch.setattr(torch_path, "CHUNK_ELEMENTS", 2 * case.channels * case.state)
    monkeypatch.setattr(torch_path, "MIN_CHUNK", 2)
    args = make_inputs(case, torch.float64, "cpu")
    args["A"] = args["A"].double()
    names = [k for k, v in args.items() if v is not None]

    def fn(*tensors):
        kw = dict(zip(names, tensors, strict=True))
        return selective_scan_fn(
            **kw, delta_softplus=case.softplus, return_last_state=True, backend="torch"
        )

    inputs = tuple(args[k].requires_grad_() for k in names)
    assert torch.autograd.gradcheck(fn, inputs)


def check_split_equals_one_scan(backend: str, device, case: Case, splits: list[int]):
    """Scanning [0, p) then [p, L) from the carried state equals one scan: outputs, last state
    and every gradient, the gradient reaching the first part through the carried state."""
    length = case.length
    args = make_inputs(case, torch.float32, device)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(case.batch, case.channels, length, generator=g).to(device)
    dlast = torch.randn(case.batch, case.channels, case.state, generator=g).to(device)
    out, last, grads = forward_and_grads(
        selective_scan_fn, args, case, dout, dlast, backend=backend
    )

    leaves = fresh_leaves(args)
    state, pieces = leaves["initial_state"], []
    for p0, p1 in zip([0, *splits], [*splits, length], strict=True):
        cut = {k: leaves[k][..., p0:p1] for k in ("u", "delta", "z", "B", "C")}
        piece, state = selective_scan_fn(
            **cut,
            A=leaves["A"],
            D=leaves["D"],
            delta_bias=leaves["delta_bias"],
            delta_softplus=True,
            return_last_state=True,
            initial_state=state,
            backend=backend,
        )
        pieces.append(piece)
    torch.autograd.backward([torch.cat(pieces, dim=-1), state], [dout, dlast])
    assert_close(torch.cat(pieces, dim=-1), out, torch.float32, "out")
    assert_close(state, last, torch.float32, "last_state")
    for name in INPUT_NAMES:
        assert_close(leaves[name].grad, grads[name], torch.float32, f"d{name}")


class _NaNBuffers:
    """Stands in for `torch` in the Triton kernels' module: every float buffer it allocates
    starts as NaN, so a kernel that reads memory nothing wrote (garbage on a GPU, often zeros
    under the interpreter) gives NaN. Counts the buffers it poisoned."""

    def __init__(self):
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _nan(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            self.poisoned += 1
            t.fill_(float("nan"))
        return t

    def empty(self, *args, **kwargs):
        return self._nan(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._nan(torch.empty_like(*args, **kwargs))


@pytest.fixture
def nan_buffers(monkeypatch) -> _NaNBuffers:
    """The Triton op's freshly allocated buffers (outputs, checkpoints, partial sums) start
    as NaN for the duration of the test."""
    from mecheval_kernels.selective_scan import launch

    poison = _NaNBuffers()
    monkeypatch.setattr(launch, "torch", poison)
    return poison


# One position; lengths that end inside a chunk; fixed, variable and grouped B and C; with and
# without an initial state; and (TILE_ELEMENTS = 64) several chunks and several channel
# blocks per program's segment, the last block and chunk partly past the end.
NAN_BUFFER_CASES = [
    (TRITON_CASES[0], None),
    (TRITON_CASES[1], None),
    (TRITON_CASES[2], None),
    (TRITON_CASES[8], None),
    (Case(batch=2, channels=7, state=3, length=21, b_layout="fixed", initial_state=True), 64),
    (Case(batch=1, channels=6, state=3, length=13, c_layout="group", groups=2), 64),
]


@pytest.mark.parametrize(
    "case,tile",
    NAN_BUFFER_CASES,
    ids=[c.id() + (f"-tile{t}" if t else "") for c, t in NAN_BUFFER_CASES],
)
def test_triton_reads_only_what_was_written(monkeypatch, nan_buffers, device, case, tile):
    """Parity with fresh buffers filled with NaN: no read of memory that nothing wrote."""
    if tile is not None:
        from mecheval_kernels.selective_scan import launch

        monkeypatch.setattr(launch, "TILE_ELEMENTS", tile)
    check_against_reference(case, torch.float32, device, "triton")
    # out, last state, checkpoints; du, ddelta, dA, dB and dC partials at least.
    assert nan_buffers.poisoned >= 8


def test_splitting_the_scan_and_carrying_the_state_equals_one_scan_torch_path():
    case = Case(length=40, b_layout="var", c_layout="group", initial_state=True)
    check_split_equals_one_scan("torch", "cpu", case, [1, 17, 39])


def test_splitting_the_scan_and_carrying_the_state_equals_one_scan_triton(device):
    # Splits inside a chunk, at a chunk boundary (16) and one before the end.
    case = Case(batch=1, channels=4, state=3, length=40, c_layout="group", initial_state=True)
    check_split_equals_one_scan("triton", device, case, [7, 16, 39])


def test_triton_backward_is_deterministic(device):
    """Two backward passes give bitwise-equal gradients (no atomics; partials summed in order).
    The interpreter runs programs one after another, so this bites on a GPU."""
    big = device.type == "cuda"
    case = Case(
        batch=4 if big else 1,
        channels=256 if big else 4,
        state=16 if big else 3,
        length=1000 if big else 20,
        b_layout="var",
        c_layout="group",
        groups=2,
        initial_state=True,
    )
    args = make_inputs(case, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(case.batch, case.channels, case.length, generator=g).to(device)
    dlast = torch.randn(case.batch, case.channels, case.state, generator=g).to(device)
    runs = [
        forward_and_grads(selective_scan_fn, args, case, dout, dlast, backend="triton")[2]
        for _ in range(2)
    ]
    for name in INPUT_NAMES:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_triton_large_delta_stays_finite_and_exact(device):
    """delta up to 100 with A down to -16: every decay underflows to 0; finite, and equal to
    the reference (a long sequence runs on a GPU; the interpreter takes a shorter one)."""
    Bn, Dn, N = 1, 2, 16
    L = 16384 if device.type == "cuda" else 100
    g = torch.Generator().manual_seed(5)
    args = dict(
        u=torch.randn(Bn, Dn, L, generator=g),
        delta=100 * torch.rand(Bn, Dn, L, generator=g),
        A=-torch.rand(Dn, N, generator=g) * 16 - 0.01,
        B=torch.randn(Bn, N, L, generator=g),
        C=torch.randn(Bn, N, L, generator=g),
        D=None,
        z=None,
        delta_bias=None,
        initial_state=torch.randn(Bn, Dn, N, generator=g),
    )
    args = {k: None if v is None else v.to(device) for k, v in args.items()}
    case = Case(batch=Bn, channels=Dn, state=N, length=L, D=False, z=False, delta_bias=False)
    check_against_reference(case, torch.float32, device, "triton", args=args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_inputs(device, backend):
    """u, delta, z as slices of one (B, L, 3D) projection viewed as (B, D, L); B, C transposed."""
    device = device if backend == "triton" else torch.device("cpu")
    Bn, Dn, N, L = 2, 6, 4, 21
    proj = torch.randn(Bn, L, 3 * Dn)
    u, delta, z = (proj[..., i * Dn : (i + 1) * Dn].transpose(1, 2) for i in range(3))
    bc = torch.randn(Bn, L, 2 * N)
    B, C = bc[..., :N].transpose(1, 2), bc[..., N:].transpose(1, 2)
    assert not u.is_contiguous() and not B.is_contiguous()
    args = dict(
        u=u,
        delta=0.5 * delta,
        A=-torch.rand(N, Dn).t() - 0.5,
        B=B,
        C=C,
        D=torch.randn(2 * Dn)[::2],
        z=z,
        delta_bias=torch.randn(Dn),
        initial_state=torch.randn(Bn, N, Dn).transpose(1, 2),
    )
    args = {k: v.to(device) for k, v in args.items()}  # .to keeps the strides
    case = Case(batch=Bn, channels=Dn, state=N, length=L, initial_state=True)
    check_against_reference(case, torch.float32, device, backend, args=args)
    out = selective_scan_fn(**args, delta_softplus=True, backend=backend)
    assert out.stride() == torch.empty_like(u).stride()  # the output keeps u's layout


def test_large_delta_and_long_sequence_stay_finite_torch_path():
    """delta up to 100 (exp(delta * A) underflows to 0) over 16k positions: finite, and equal to
    the reference on a prefix."""
    Bn, Dn, N, L = 1, 4, 16, 16384
    g = torch.Generator().manual_seed(5)
    u = torch.randn(Bn, Dn, L, generator=g, requires_grad=True)
    delta = (100 * torch.rand(Bn, Dn, L, generator=g)).requires_grad_()
    A = (-torch.rand(Dn, N, generator=g) * 16 - 0.01).requires_grad_()
    B, C = torch.randn(Bn, N, L, generator=g), torch.randn(Bn, N, L, generator=g)
    B.requires_grad_()
    out, last = selective_scan_fn(
        u, delta, A, B, C, delta_softplus=True, return_last_state=True, backend="torch"
    )
    (out.sum() + last.sum()).backward()
    for t in (out, last, u.grad, delta.grad, A.grad, B.grad):
        assert torch.isfinite(t).all()
    prefix = slice(0, 64)
    ref = selective_scan_ref(
        u[..., prefix], delta[..., prefix], A, B[..., prefix], C[..., prefix], delta_softplus=True
    )
    assert_close(out[..., prefix], ref, torch.float32, "out prefix")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiles_fullgraph_with_backward(device, backend):
    """One opaque custom op with a registered backward: no graph break, same values."""
    device = device if backend == "triton" else torch.device("cpu")

    class MambaScan(torch.nn.Module):
        def __init__(self, d=8, n=4):
            super().__init__()
            self.n = n
            self.A_log = torch.nn.Parameter(torch.randn(d, n) * 0.1)
            self.D = torch.nn.Parameter(torch.ones(d))
            self.dt_bias = torch.nn.Parameter(torch.zeros(d))
            self.proj = torch.nn.Linear(d, 3 * d + 2 * n)

        def forward(self, x):  # x (B, L, d)
            d = x.shape[-1]
            u, delta, z, B, C = self.proj(x).transpose(1, 2).split([d, d, d, self.n, self.n], 1)
            out, last = selective_scan_fn(
                u,
                delta,
                -torch.exp(self.A_log),
                B,
                C,
                self.D,
                z,
                self.dt_bias,
                delta_softplus=True,
                return_last_state=True,
                backend=backend,
            )
            return out.transpose(1, 2), last

    model, x = MambaScan().to(device), torch.randn(2, 11, 8, device=device)
    eager, eager_last = model(x)
    (eager.square().sum() + eager_last.sum()).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled, compiled_last = torch.compile(model, fullgraph=True)(x)
    (compiled.square().sum() + compiled_last.sum()).backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_last, eager_last)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def _valid_args() -> dict:
    return dict(
        u=torch.randn(2, 6, 5),
        delta=torch.rand(2, 6, 5),
        A=-torch.rand(6, 4),
        B=torch.randn(2, 4, 5),
        C=torch.randn(2, 3, 4, 5),
        D=torch.randn(6),
        z=torch.randn(2, 6, 5),
        delta_bias=torch.randn(6),
        initial_state=torch.randn(2, 6, 4),
    )


# (arguments as keyword overrides of a valid call, expected error type, words the message names)
BAD_INPUTS = [
    (dict(u=torch.randn(2, 6)), ValueError, ["u", "(B, D, L)"]),
    (dict(u=[1.0, 2.0]), TypeError, ["u", "Tensor"]),
    (dict(u=torch.randn(2, 6, 5).long()), TypeError, ["u", "int64"]),
    (dict(u=torch.randn(2, 6, 0)), ValueError, ["u", "L >= 1"]),
    (dict(delta=torch.rand(2, 6, 4)), ValueError, ["delta", "(B, D, L)", "L: 4 != 5"]),
    (dict(delta=torch.rand(3, 6, 5)), ValueError, ["delta", "B: 3 != 2"]),
    (dict(delta=torch.rand(2, 6, 5) > 0.5), TypeError, ["delta", "bool"]),
    (dict(A=-torch.rand(5, 4)), ValueError, ["A", "(D, N)", "D: 5 != 6"]),
    (dict(A=-torch.rand(6)), ValueError, ["A", "(D, N)"]),
    (dict(A=-torch.rand(6, 300)), ValueError, ["N", "between 1 and 256", "300"]),
    (dict(B=torch.randn(2, 4)), ValueError, ["B", "(D, N)", "D: 2 != 6"]),
    (dict(B=torch.randn(2, 5, 5)), ValueError, ["B", "(B, N, L)", "N: 5 != 4"]),
    (dict(B=torch.randn(2, 4, 6)), ValueError, ["B", "(B, N, L)", "L: 6 != 5"]),
    (dict(B=torch.randn(2, 1, 4, 5, 1)), ValueError, ["B", "(B, G, N, L)", "5-d"]),
    (dict(B=torch.randn(2, 4, 4, 5)), ValueError, ["B", "G = 4", "divide", "D = 6"]),
    (dict(C=torch.randn(2, 5, 4, 5)), ValueError, ["C", "G = 5", "divide"]),
    (dict(C=torch.randn(2, 3, 4, 5, dtype=torch.complex64)), TypeError, ["C", "complex64"]),
    (dict(C=torch.randn(2, 3, 3, 5)), ValueError, ["C", "N: 3 != 4"]),
    (dict(D=torch.randn(5)), ValueError, ["D", "(D)", "D: 5 != 6"]),
    (dict(D=torch.randn(6, 1)), ValueError, ["D", "(D)"]),
    (dict(z=torch.randn(2, 6, 6)), ValueError, ["z", "(B, D, L)", "L: 6 != 5"]),
    (dict(delta_bias=torch.randn(7)), ValueError, ["delta_bias", "D: 7 != 6"]),
    (dict(initial_state=torch.randn(2, 6, 5)), ValueError, ["initial_state", "N: 5 != 4"]),
    (dict(initial_state=torch.randn(6, 4)), ValueError, ["initial_state", "(B, D, N)"]),
    (dict(delta_softplus="yes"), ValueError, ["delta_softplus"]),
    (dict(B=torch.randn(2, 4, 5, device="meta")), ValueError, ["one device", "B on meta"]),
    (dict(initial_state=torch.randn(2, 6, 4, device="meta")), ValueError, ["initial_state"]),
    # Mixed float dtypes are fine: Mamba keeps A, D and delta_bias in float32.
    (dict(u=torch.randn(2, 6, 5).half(), z=torch.randn(2, 6, 5).bfloat16()), None, []),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        selective_scan_fn(**args, backend="torch")
        return
    with pytest.raises(error) as info:
        selective_scan_fn(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_triton_refuses_float64_by_name(device):
    # On the test device: with CPU tensors on a GPU machine the backend check would fire first.
    args = {k: v.to(device=device, dtype=torch.float64) for k, v in _valid_args().items()}
    with pytest.raises(TypeError, match="u has dtype float64"):
        selective_scan_fn(**args, backend="triton")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        selective_scan_fn(**_valid_args(), backend="cuda")


@pytest.mark.parametrize("layout", ["fixed", "var"])
def test_second_derivatives_gradgradcheck_float64(layout):
    """Second derivatives (create_graph) as mamba-ssm's selective_scan_ref gives them: autograd
    through the per-position reference."""
    gen = torch.Generator().manual_seed(3)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, D, N, L = 1, 2, 2, 4
    bc = (D, N) if layout == "fixed" else (B, N, L)
    leaves = [make(B, D, L), make(B, D, L), -make(D, N).abs() - 0.1, make(*bc), make(*bc),
              make(D), make(B, D, L), make(D), make(B, D, N)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]

    def fn(u, delta, A, B, C, D, z, bias, state):
        return selective_scan_fn(u, delta, A, B, C, D, z, bias, True, True, state, backend="torch")

    assert torch.autograd.gradgradcheck(fn, leaves)
