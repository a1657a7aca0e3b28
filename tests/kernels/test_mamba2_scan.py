"""mamba2_scan against its reference (the per-step recurrence, mecheval_kernels.ssd.reference):
forward, every gradient, the chunked PyTorch path across chunk boundaries, the Triton path (the
selective scan's kernels, under the interpreter on CPU), initial and final states, states at
positions, vmap, torch.compile, extreme inputs, bad input.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.func import vmap

from mecheval_kernels import mamba2_scan
from mecheval_kernels.ssd import mamba2_scan_ref
from tests.kernels.tolerances import assert_close

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    length: int = 37
    heads: int = 4
    head_dim: int = 3
    groups: int = 2
    state: int = 5
    D: str | None = "H"  # None, "H" or "H P"
    z: bool = True
    dt_bias: bool = True
    softplus: bool = True
    initial_states: bool = False

    def id(self) -> str:
        flags = [n for n in ("z", "dt_bias", "softplus", "initial_states") if getattr(self, n)]
        return (
            f"B{self.batch}L{self.length}H{self.heads}P{self.head_dim}G{self.groups}"
            f"N{self.state}-D{self.D}-" + "+".join(flags or ["plain"])
        )


CASES = [
    Case(),
    Case(length=1, groups=1, D=None, z=False),
    Case(length=70, D="H P", initial_states=True),  # more than one chunk, ragged last one
    Case(length=9, heads=3, groups=3, dt_bias=False, softplus=False, initial_states=True),
]


def make_inputs(case: Case, dtype=torch.float32, seed=0) -> dict:
    """A Mamba-2 layer's scan inputs: A < 0, dt around softplus's knee (or positive)."""
    g = torch.Generator().manual_seed(seed)
    b, L, H, P, G, N = (
        case.batch, case.length, case.heads, case.head_dim, case.groups, case.state
    )  # fmt: skip

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    if case.softplus:
        dt, bias = rand(b, L, H, scale=0.5), rand(H, scale=0.3)
    else:
        dt, bias = torch.rand(b, L, H, generator=g).to(dtype), None
    return dict(
        x=rand(b, L, H, P),
        dt=dt,
        A=-torch.exp(rand(H, scale=0.5)),
        B=rand(b, L, G, N),
        C=rand(b, L, G, N),
        D={None: None, "H": rand(H), "H P": rand(H, P)}[case.D],
        z=rand(b, L, H, P) if case.z else None,
        dt_bias=bias if case.dt_bias else None,
        initial_states=rand(b, H, P, N) if case.initial_states else None,
    )


def _call(fn, args, case, **kw):
    out, last = fn(
        **{n: args[n] for n in NAMES[:8]},
        dt_softplus=case.softplus,
        initial_states=args["initial_states"],
        return_final_states=True,
        **kw,
    )
    return out, last


def _outputs_and_grads(fn, args, case, **kw):
    """(out, final state, gradients of every given input) for a fixed random cotangent."""
    ins = {k: None if v is None else v.clone().requires_grad_() for k, v in args.items()}
    out, last = _call(fn, ins, case, **kw)
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(out.shape, generator=g).to(out.dtype)
    last_weights = torch.randn(last.shape, generator=g).to(last.dtype)
    ((out.float() * weights).sum() + (last * last_weights).sum()).backward()
    grads = {k: v.grad for k, v in ins.items() if v is not None}
    return out.detach(), last.detach(), grads


def _reference(args, case):
    """The reference in float64 on the same (already rounded) inputs."""
    wide = {k: None if v is None else v.double() for k, v in args.items()}
    return _outputs_and_grads(mamba2_scan_ref, wide, case)


def _check_against_reference(args, case, dtype, **kw):
    out, last, grads = _outputs_and_grads(mamba2_scan, args, case, **kw)
    ref_out, ref_last, ref_grads = _reference(args, case)
    assert out.dtype == dtype and last.dtype == torch.float32
    assert_close(out, ref_out, dtype, "out")
    assert_close(last, ref_last, torch.float32, "final state")
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert grad.dtype == args[name].dtype, name
        assert_close(grad, ref_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize("case", CASES, ids=Case.id)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_torch_path_matches_reference(case, chunk_size):
    args = make_inputs(case)
    _check_against_reference(args, case, torch.float32, backend="torch", chunk_size=chunk_size)


def test_torch_path_fp16_matches_reference():
    case = Case(length=20)
    args = make_inputs(case, torch.float16)
    out = _call(mamba2_scan, args, case, backend="torch")[0]
    ref = _call(
        mamba2_scan_ref, {k: None if v is None else v.double() for k, v in args.items()}, case
    )[0]
    assert out.dtype == torch.float16
    assert_close(out, ref, torch.float16, "out")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=Case.id)
def test_triton_matches_reference(device, case):
    args = {k: None if v is None else v.to(device) for k, v in make_inputs(case).items()}
    _check_against_reference(args, case, torch.float32, backend="triton")


@pytest.mark.parametrize("chunk_size", [2, 3])
def test_gradcheck_float64_torch_path(chunk_size):
    case = Case(batch=1, length=5, heads=2, head_dim=2, groups=1, state=2, D="H P",
                initial_states=True)  # fmt: skip
    args = make_inputs(case, torch.float64)
    names = [n for n in NAMES if args[n] is not None]

    def fn(*tensors):
        a = dict(zip(names, tensors, strict=True))
        out, last = mamba2_scan(
            **{n: a.get(n) for n in NAMES[:8]},
            dt_softplus=True,
            initial_states=a["initial_states"],
            return_final_states=True,
            chunk_size=chunk_size,
            backend="torch",
        )
        return out, last

    inputs = tuple(args[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_splitting_the_scan_and_carrying_the_state_equals_one_scan(device, backend):
    case = Case(length=23, initial_states=True)
    args = make_inputs(case)
    if backend == "triton":
        args = {k: None if v is None else v.to(device) for k, v in args.items()}
    whole, whole_last = _call(mamba2_scan, args, case, backend=backend)
    state, pieces = args["initial_states"], []
    for a, b in ((0, 7), (7, 8), (8, 23)):
        part = {k: v for k, v in args.items()}
        for n in ("x", "dt", "B", "C", "z"):
            part[n] = args[n][:, a:b]
        part["initial_states"] = state
        out, state = _call(mamba2_scan, part, case, backend=backend)
        pieces.append(out)
    assert_close(torch.cat(pieces, 1), whole, torch.float32, "out")
    assert_close(state, whole_last, torch.float32, "final state")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vmap_over_stacked_models_equals_a_loop(backend):
    """torch.vmap over a model axis (mecheval_kernels.stacking) gives each model's own outputs and
    gradients; the groups' B and C differ per model."""
    M, case = 3, Case(length=9)
    per_model = [make_inputs(case, seed=k) for k in range(M)]
    names = [n for n in NAMES[:8] if per_model[0][n] is not None]
    stacked = [torch.stack([a[n] for a in per_model]).requires_grad_() for n in names]

    def scan(*tensors):
        a = dict(zip(names, tensors, strict=True))
        out, last = mamba2_scan(
            **{n: a.get(n) for n in NAMES[:8]}, dt_softplus=True, return_final_states=True,
            backend=backend,
        )  # fmt: skip
        return out.square().sum() + last.sum()

    vmap(scan)(*stacked).sum().backward()
    for k in range(M):
        ins = [per_model[k][n].clone().requires_grad_() for n in names]
        scan(*ins).backward()
        for name, ours, theirs in zip(names, stacked, ins, strict=True):
            torch.testing.assert_close(ours.grad[k], theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_compiles_fullgraph_with_backward():
    class Mamba2Scan(torch.nn.Module):
        def __init__(self, heads=2, head_dim=4, n=3):
            super().__init__()
            self.shape, self.n = (heads, head_dim), n
            self.A_log = torch.nn.Parameter(torch.randn(heads) * 0.1)
            self.dt_bias = torch.nn.Parameter(torch.zeros(heads))
            self.proj = torch.nn.Linear(8, 2 * 8 + 2 * n + heads)

        def forward(self, u):  # (B, L, 8)
            b, L, _ = u.shape
            x, z, B, C, dt = self.proj(u).split([8, 8, self.n, self.n, self.shape[0]], -1)
            out, last = mamba2_scan(
                x.reshape(b, L, *self.shape), dt, -torch.exp(self.A_log),
                B[:, :, None], C[:, :, None], z=z.reshape(b, L, *self.shape),
                dt_bias=self.dt_bias, dt_softplus=True, return_final_states=True,
                backend="torch",
            )  # fmt: skip
            return out, last

    model, u = Mamba2Scan(), torch.randn(2, 11, 8)
    eager, eager_last = model(u)
    (eager.square().sum() + eager_last.sum()).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled, compiled_last = torch.compile(model, fullgraph=True)(u)
    (compiled.square().sum() + compiled_last.sum()).backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_last, eager_last)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_large_dt_stays_finite_and_exact():
    """A huge step (dt * A ~ -1e4) at one position, small ones after it: every decay is a sum
    over its own segment, so the later positions keep float32 precision."""
    case = Case(length=40, softplus=False, dt_bias=False)
    args = make_inputs(case)
    args["dt"] = args["dt"] * 0.1
    args["dt"][:, 5] = 1e4
    out, last, grads = _outputs_and_grads(mamba2_scan, args, case, backend="torch")
    ref_out, ref_last, ref_grads = _reference(args, case)
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(last, ref_last, torch.float32, "final state")
    for name in ("x", "B", "C"):
        assert_close(grads[name], ref_grads[name], torch.float32, f"d{name}")
    assert all(torch.isfinite(g).all() for g in grads.values())


def _bad(**overrides):
    args = make_inputs(Case(length=4))
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "words"),
    [
        (dict(x=torch.randn(2, 4, 12)), ValueError, "x must have shape (B, L, H, P)"),
        (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
        (dict(dt=torch.randn(2, 4, 3)), ValueError, "dt must have shape (B, L, H) = (2, 4, 4)"),
        (dict(A=torch.randn(4, 5)), ValueError, "A must have shape (H)"),
        (dict(B=torch.randn(2, 4, 3, 5)), ValueError, "must divide the heads H = 4"),
        (dict(C=torch.randn(2, 4, 2, 6)), ValueError, "C must have shape (B, L, G, N)"),
        (dict(D=torch.randn(4, 2)), ValueError, "D must have shape (H, P) = (4, 3)"),
        (dict(z=torch.randn(2, 4, 4, 3).int()), TypeError, "z has dtype int32"),
        (dict(initial_states=torch.randn(2, 4, 3, 4)), ValueError, "initial_states must"),
        (dict(B=torch.randn(2, 4, 2, 300), C=torch.randn(2, 4, 2, 300)), ValueError, "256"),
    ],
)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _bad(**overrides)
    with pytest.raises(error) as info:
        mamba2_scan(
            **{n: args[n] for n in NAMES[:8]},
            dt_softplus=True,
            initial_states=args["initial_states"],
            backend="torch",
        )
    assert words in str(info.value)
    assert "mamba2_scan" in str(info.value)


def test_bad_chunk_size_and_unsupported_arguments_are_refused():
    args = _bad()
    with pytest.raises(ValueError, match="chunk_size must be"):
        mamba2_scan(*(args[n] for n in NAMES[:5]), chunk_size=0)
    for name, value in (
        ("seq_idx", torch.zeros(2, 4, dtype=torch.int32)),
        ("cu_seqlens", torch.tensor([0, 4])),
        ("return_varlen_states", True),
    ):
        with pytest.raises(ValueError, match=f"mamba2_scan: {name}=.* is not supported"):
            mamba2_scan(*(args[n] for n in NAMES[:5]), **{name: value})
    with pytest.raises(ValueError, match="dt_limit must be a"):
        mamba2_scan(*(args[n] for n in NAMES[:5]), dt_limit=(1.0, 0.0))


def test_dt_limit_clamps_the_step_sizes():
    """dt_limit clamps softplus(dt + dt_bias), as mamba-ssm does: the same as passing the
    clamped step sizes with no bias and no softplus."""
    case = Case(length=9)
    args = make_inputs(case)
    step = torch.nn.functional.softplus(args["dt"] + args["dt_bias"])
    limit = (float(step.quantile(0.25)), float(step.quantile(0.75)))
    out = mamba2_scan(
        **{n: args[n] for n in NAMES[:8]}, dt_softplus=True, dt_limit=limit, backend="torch"
    )
    clamped = {**args, "dt": step.clamp(*limit), "dt_bias": None}
    want = mamba2_scan_ref(**{n: clamped[n] for n in NAMES[:8]})
    assert_close(out, want, torch.float32, "out")


def test_second_derivatives_gradgradcheck_float64():
    """Second derivatives (create_graph) on the PyTorch path: autograd through the chunked form,
    as through mamba-ssm's reference."""
    gen = torch.Generator().manual_seed(3)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    b, L, H, P, G, N = 1, 4, 2, 2, 1, 2
    leaves = [make(b, L, H, P), make(b, L, H), -make(H).abs() - 0.1, make(b, L, G, N),
              make(b, L, G, N), make(H), make(b, L, H, P), make(H), make(b, H, P, N)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]

    def fn(x, dt, A, B, C, D, z, bias, state):
        return mamba2_scan(x, dt, A, B, C, 2, D, z, bias, state, dt_softplus=True,
                           return_final_states=True, backend="torch")  # fmt: skip

    assert torch.autograd.gradgradcheck(fn, leaves)


def test_second_derivatives_of_the_triton_path_equal_the_torch_paths():
    """The op's backward differentiated (create_graph) on the Triton path: through its twice
    form, the chunked scan, equal to autograd through the PyTorch path."""
    args = make_inputs(Case(length=5))
    leaves = {n: args[n].clone().requires_grad_() for n in ("x", "B")}

    def hessian_row(backend):
        a = {**args, **leaves}
        out = mamba2_scan(**a, dt_softplus=True, backend=backend)
        (gx,) = torch.autograd.grad(out.square().sum(), leaves["x"], create_graph=True)
        return torch.autograd.grad(gx.square().sum(), list(leaves.values()))

    for ours, theirs in zip(hessian_row("triton"), hessian_row("torch"), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
