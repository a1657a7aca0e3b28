"""chunk_delta_rule against its reference (the per-step recurrence): forward, every gradient,
properties of the memory, determinism, torch.compile, bad input.

The Triton kernels (chunked and fused recurrent) run under Triton's interpreter on CPU (set up
in tests/conftest.py) and compiled on a GPU; the reference computes in float32 (float64 for
gradcheck) on the same, already-rounded inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mecheval_kernels import chunk_delta_rule
from mecheval_kernels.delta_rule import delta_rule_ref, op, torch_path
from tests.kernels.tolerances import assert_close

REPO = Path(__file__).resolve().parents[2]

GRAD_NAMES = ("dq", "dk", "dv", "dbeta", "dinitial_state")


def _inputs(B, T, H, K, V, dtype, device, init=False, l2norm=False, seed=0, beta_max=1.0):
    """Unit keys (or raw ones, with l2norm: the op normalises them) and beta in (0, beta_max)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    if not l2norm:
        k = F.normalize(k, dim=-1)
    beta = beta_max * torch.rand(B, T, H, generator=g)
    s = rand(B, H, K, V) if init else None
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), to(beta), None if s is None else s.to(device)


def _forward_and_grads(fn, q, k, v, beta, init, do, dfinal, l2norm=False, **kw):
    leaves = [
        None if t is None else t.detach().clone().requires_grad_() for t in (q, k, v, beta, init)
    ]
    q_, k_, v_, b_, s_ = leaves
    o, final = fn(
        q_,
        k_,
        v_,
        b_,
        initial_state=s_,
        output_final_state=dfinal is not None,
        use_qk_l2norm_in_kernel=l2norm,
        **kw,
    )
    outs, cots = [o], [do]
    if dfinal is not None:
        outs.append(final)
        cots.append(dfinal)
    torch.autograd.backward(outs, cots)
    return o, final, [None if t is None else t.grad for t in leaves]


def _check_against_reference(q, k, v, beta, init, dtype, backend, final_grad, l2norm=False):
    B, T, H, _ = q.shape
    V, K = v.shape[-1], q.shape[-1]
    g = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=g).to(device=q.device, dtype=dtype)
    dfinal = torch.randn(B, H, K, V, generator=g).to(q.device) if final_grad else None
    o, final, grads = _forward_and_grads(
        chunk_delta_rule, q, k, v, beta, init, do, dfinal, l2norm, backend=backend
    )
    up = lambda t: None if t is None else t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        delta_rule_ref, up(q), up(k), up(v), up(beta), up(init), up(do), up(dfinal), l2norm
    )
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert_close(o, o_ref, dtype, "o")
    if final_grad:
        assert final.dtype == torch.float32
        assert_close(final, final_ref, dtype, "final_state")
    else:
        assert final is None
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            assert_close(grad, grad_ref, dtype, name)


# (B, T, H, K, V, initial_state, final-state gradient, l2norm): every T, K, V and H value, each
# flag both ways, paired with the others, without the full product (the interpreter is slow).
CASES = [
    (2, 1, 2, 16, 16, True, True, False),
    (1, 15, 1, 20, 64, False, True, False),
    (2, 37, 2, 64, 20, True, False, False),
    (1, 64, 1, 16, 20, False, False, True),
    (2, 100, 1, 64, 64, True, True, False),
    (1, 300, 2, 20, 16, True, False, False),
    (2, 15, 2, 64, 16, False, False, False),
    (1, 37, 1, 20, 20, True, True, True),
    (2, 64, 2, 20, 64, True, True, False),
    (1, 100, 2, 16, 20, False, True, False),
    (1, 300, 1, 64, 64, False, True, False),
    (2, 1, 1, 20, 64, False, False, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}" for c in CASES]


@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(B, T, H, K, V, init, final_grad, l2norm):
    q, k, v, beta, s = _inputs(B, T, H, K, V, torch.float32, "cpu", init, l2norm, seed=T)
    _check_against_reference(q, k, v, beta, s, torch.float32, "torch", final_grad, l2norm)


def _force_kernel(monkeypatch, kernel: str) -> None:
    """Make the Triton backend run `kernel` whatever the length (the dispatch threshold)."""
    monkeypatch.setattr(op, "RECURRENT_MAX_LEN", 10**9 if kernel == "recurrent" else 0)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_chunked_matches_reference(
    monkeypatch, device, dtype, B, T, H, K, V, init, final_grad, l2norm
):
    _force_kernel(monkeypatch, "chunked")
    dt = DTYPES[dtype]
    q, k, v, beta, s = _inputs(B, T, H, K, V, dt, device, init, l2norm, seed=T + K)
    _check_against_reference(q, k, v, beta, s, dt, "triton", final_grad, l2norm)


# The recurrent kernel steps through time under the interpreter: short sequences (its use),
# one dtype per case, every T up to 100, K, V and H value and flag; V = 64 with one program
# per batch row and head exercises the sums over several V blocks.
RECURRENT_CASES = [
    (2, 1, 2, 16, 16, True, True, False, "fp32"),
    (1, 15, 1, 20, 64, False, True, False, "fp16"),
    (1, 37, 2, 64, 20, True, False, False, "fp32"),
    (1, 64, 1, 16, 20, False, False, True, "fp16"),
    (1, 100, 2, 20, 16, True, True, False, "fp32"),
    (1, 37, 1, 64, 64, True, True, False, "fp16"),
]


@pytest.mark.parametrize(
    "B,T,H,K,V,init,final_grad,l2norm,dtype",
    RECURRENT_CASES,
    ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-{c[8]}" for c in RECURRENT_CASES],
)
def test_triton_recurrent_matches_reference(
    monkeypatch, device, B, T, H, K, V, init, final_grad, l2norm, dtype
):
    _force_kernel(monkeypatch, "recurrent")
    dt = DTYPES[dtype]
    q, k, v, beta, s = _inputs(B, T, H, K, V, dt, device, init, l2norm, seed=T + V)
    _check_against_reference(q, k, v, beta, s, dt, "triton", final_grad, l2norm)


def test_triton_chunked_wide_head_fp16(monkeypatch, device):
    """K = 100 pads to 128 in the state kernels and splits the gradient kernel over four K
    blocks of 32 (the last one reaching past K)."""
    _force_kernel(monkeypatch, "chunked")
    q, k, v, beta, s = _inputs(1, 70, 1, 100, 36, torch.float16, device, True, seed=9)
    _check_against_reference(q, k, v, beta, s, torch.float16, "triton", True)


# (kernel, B, T, H, K, V, dtype): T not a multiple of the chunk, K and V not powers of two
# (K = 100 pads to 128), initial state and final-state gradient everywhere.
UNWRITTEN_CASES = [
    ("chunked", 2, 37, 2, 20, 36, "fp32"),
    ("chunked", 1, 70, 1, 100, 36, "fp16"),
    ("recurrent", 1, 13, 2, 20, 36, "fp32"),
    ("recurrent", 1, 9, 1, 100, 20, "fp16"),
]


@pytest.mark.parametrize(
    "kernel,B,T,H,K,V,dtype",
    UNWRITTEN_CASES,
    ids=[f"{c[0]}-B{c[1]}-T{c[2]}-H{c[3]}-K{c[4]}-V{c[5]}-{c[6]}" for c in UNWRITTEN_CASES],
)
def test_triton_reads_only_what_it_wrote(
    monkeypatch, device, nan_fresh_buffers, bounds_checked_interpreter, kernel, B, T, H, K, V, dtype
):
    _force_kernel(monkeypatch, kernel)
    dt = DTYPES[dtype]
    q, k, v, beta, s = _inputs(B, T, H, K, V, dt, device, True, seed=T + K + V)
    _check_against_reference(q, k, v, beta, s, dt, "triton", True)


def _inside_nan(t: torch.Tensor, margin: int = 4096) -> torch.Tensor:
    """t's values as a contiguous view into the middle of a NaN-filled buffer: the op uses it
    in place (no copy), and any read outside t's extent picks up NaN."""
    flat = torch.full((2 * margin + t.numel(),), float("nan"), dtype=t.dtype, device=t.device)
    flat[margin : margin + t.numel()] = t.detach().reshape(-1)
    return flat[margin : margin + t.numel()].view(t.shape)


def test_triton_chunked_wide_head_reads_no_neighbours(
    monkeypatch, device, nan_fresh_buffers, bounds_checked_interpreter
):
    """The K = 100, V = 36 case with every input, cotangent and the initial state placed inside
    NaN: a load past the real extent of any of them (a padded K or V column, a row past T, a K
    block starting past K) whose value is used makes the outputs or gradients NaN, and under the
    interpreter any access outside them fails (`bounds_checked_interpreter`)."""
    _force_kernel(monkeypatch, "chunked")
    B, T, H, K, V = 1, 70, 1, 100, 36
    dt = torch.float16
    q, k, v, beta, s = _inputs(B, T, H, K, V, dt, device, True, seed=9)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=g).to(device=device, dtype=dt)
    dfinal = torch.randn(B, H, K, V, generator=g).to(device)
    inputs = [_inside_nan(t).requires_grad_() for t in (q, k, v, beta, s)]
    assert all(t.is_contiguous() and t.storage_offset() > 0 for t in inputs)
    o, final = chunk_delta_rule(
        *inputs[:4], initial_state=inputs[4], output_final_state=True, backend="triton"
    )
    grads = torch.autograd.grad([o, final], inputs, [_inside_nan(do), _inside_nan(dfinal)])
    up = lambda t: t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        delta_rule_ref, *(up(t) for t in (q, k, v, beta, s)), up(do), dfinal
    )
    assert_close(o, o_ref, dt, "o")
    assert_close(final, final_ref, dt, "final_state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert_close(grad, grad_ref, dt, name)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["chunked", "recurrent"])
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_bf16_matches_reference(
    monkeypatch, device, kernel, B, T, H, K, V, init, final_grad, l2norm
):
    _force_kernel(monkeypatch, kernel)
    q, k, v, beta, s = _inputs(B, T, H, K, V, torch.bfloat16, device, init, l2norm, seed=T)
    _check_against_reference(q, k, v, beta, s, torch.bfloat16, "triton", final_grad, l2norm)


@pytest.mark.gpu
def test_triton_bf16_large_heads(device):
    """The benchmark's long shape, scaled down: K = V = 128 over many chunks."""
    q, k, v, beta, s = _inputs(2, 1000, 4, 128, 128, torch.bfloat16, device, True, seed=11)
    _check_against_reference(q, k, v, beta, s, torch.bfloat16, "triton", True)


def test_torch_path_fp16_matches_reference():
    q, k, v, beta, s = _inputs(2, 100, 2, 20, 64, torch.float16, "cpu", True, seed=3)
    _check_against_reference(q, k, v, beta, s, torch.float16, "torch", True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extreme_beta_and_long_sequence_stay_finite_and_exact(monkeypatch, device, backend):
    """beta at both ends of [0, 2] on unit keys, over many chunks: no inf/NaN, still exact."""
    _force_kernel(monkeypatch, "chunked")
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, beta, s = _inputs(1, 300, 2, 20, 16, torch.float32, device, True, seed=5)
    g = torch.Generator().manual_seed(5)
    beta = torch.where(torch.rand(beta.shape, generator=g) < 0.5, 2.0, 0.0).to(device)
    _check_against_reference(q, k, v, beta, s, torch.float32, backend, True)


def _with_chunk_size(monkeypatch, size: int) -> None:
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", size)


@pytest.mark.parametrize("with_init", [True, False])
def test_gradcheck_float64_torch_path(monkeypatch, with_init):
    _with_chunk_size(monkeypatch, 3)  # several chunks and a ragged last one at T = 7
    g = torch.Generator().manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, 7, 2, 3, 2
    q, v = make(B, T, H, K), make(B, T, H, V)
    k = F.normalize(make(B, T, H, K), dim=-1)
    beta = 2 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    init = make(B, H, K, V) if with_init else None
    leaves = [t.requires_grad_() for t in (q, k, v, beta) + ((init,) if with_init else ())]

    def fn(q, k, v, beta, init=None):
        o, final = chunk_delta_rule(
            q, k, v, beta, 0.7, init, output_final_state=True, backend="torch"
        )
        return o, final

    assert torch.autograd.gradcheck(fn, leaves)


def test_gradcheck_float64_l2norm():
    g = torch.Generator().manual_seed(8)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = make(1, 4, 1, 3), make(1, 4, 1, 3), make(1, 4, 1, 2)
    beta = torch.rand(1, 4, 1, generator=g, dtype=torch.float64).requires_grad_()
    fn = lambda *a: chunk_delta_rule(*a, use_qk_l2norm_in_kernel=True, backend="torch")[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, beta))


# (backend, kernel): the PyTorch path and both Triton kernels.
IMPLEMENTATIONS = [("torch", None), ("triton", "chunked"), ("triton", "recurrent")]
IMPL_IDS = ["torch", "triton-chunked", "triton-recurrent"]


def _implementation(monkeypatch, device, backend, kernel) -> torch.device:
    if kernel is not None:
        _force_kernel(monkeypatch, kernel)
    return device if backend == "triton" else torch.device("cpu")


@pytest.mark.parametrize("backend,kernel", IMPLEMENTATIONS, ids=IMPL_IDS)
def test_zero_beta_leaves_the_state_unchanged(monkeypatch, device, backend, kernel):
    device = _implementation(monkeypatch, device, backend, kernel)
    q, k, v, beta, s = _inputs(1, 37, 2, 20, 16, torch.float32, device, True, seed=2)
    o, final = chunk_delta_rule(
        q, k, v, torch.zeros_like(beta), 1.0, s, output_final_state=True, backend=backend
    )
    assert torch.equal(final, s)
    # Every read then sees the initial memory.
    assert_close(o, torch.einsum("bthk,bhkv->bthv", q, s), torch.float32, "o")


@pytest.mark.parametrize("backend,kernel", IMPLEMENTATIONS, ids=IMPL_IDS)
def test_full_write_of_a_unit_key_recalls_its_value(monkeypatch, device, backend, kernel):
    """beta = 1 on a unit key overwrites what the memory holds for it: reading it returns v."""
    device = _implementation(monkeypatch, device, backend, kernel)
    q, k, v, beta, s = _inputs(1, 37, 2, 20, 16, torch.float32, device, True, seed=4)
    t = 23
    beta[:, t] = 1.0
    q[:, t] = k[:, t]
    o, _ = chunk_delta_rule(q, k, v, beta, 1.0, s, backend=backend)
    assert_close(o[:, t], v[:, t], torch.float32, "o at the write")


@pytest.mark.parametrize("backend,kernel", IMPLEMENTATIONS, ids=IMPL_IDS)
def test_splitting_the_sequence_and_carrying_the_state_equals_one_call(
    monkeypatch, device, backend, kernel
):
    device = _implementation(monkeypatch, device, backend, kernel)
    T = 40 if kernel == "recurrent" else 100  # pieces within and across chunks
    q, k, v, beta, s = _inputs(2, T, 1, 16, 16, torch.float32, device, True, seed=6)
    o_whole, final_whole = chunk_delta_rule(
        q, k, v, beta, initial_state=s, output_final_state=True, backend=backend
    )
    pieces, state = [], s
    for start, stop in ((0, 1), (1, 37), (37, T)):
        o, state = chunk_delta_rule(
            q[:, start:stop],
            k[:, start:stop],
            v[:, start:stop],
            beta[:, start:stop],
            initial_state=state,
            output_final_state=True,
            backend=backend,
        )
        pieces.append(o)
    assert_close(torch.cat(pieces, dim=1), o_whole, torch.float32, "o")
    assert_close(state, final_whole, torch.float32, "final_state")


@pytest.mark.parametrize("backend,kernel", IMPLEMENTATIONS, ids=IMPL_IDS)
def test_gradients_through_the_final_state_alone(monkeypatch, device, backend, kernel):
    """A loss on the final state only (o unused): the state's gradient flows back alone."""
    device = _implementation(monkeypatch, device, backend, kernel)
    q, k, v, beta, s = _inputs(1, 20, 2, 16, 20, torch.float32, device, True, seed=13)
    dfinal = torch.randn(1, 2, 16, 20).to(device)
    grads = []
    for fn, kw in ((chunk_delta_rule, dict(backend=backend)), (delta_rule_ref, {})):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, beta, s)]
        _, final = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, **kw)
        torch.autograd.backward(final, dfinal)
        grads.append([t.grad for t in leaves])
    ours, ref = grads
    assert ref[0] is None and torch.equal(ours[0], torch.zeros_like(q))  # the state ignores q
    for name, grad, grad_ref in zip(GRAD_NAMES[1:], ours[1:], ref[1:], strict=True):
        assert_close(grad, grad_ref, torch.float32, name)


@pytest.mark.parametrize("kernel", ["chunked", "recurrent"])
def test_triton_backward_is_deterministic(monkeypatch, device, kernel):
    _force_kernel(monkeypatch, kernel)
    T, H = (100, 2) if kernel == "chunked" else (12, 1)
    # K = 64 in float32 splits the gradient kernel over K blocks; V = 64 splits V.
    q, k, v, beta, s = _inputs(1, T, H, 64, 64, torch.float32, device, True, seed=10)
    do = torch.randn(1, T, H, 64).to(device)
    dfinal = torch.randn(1, H, 64, 64).to(device)
    runs = [
        _forward_and_grads(chunk_delta_rule, q, k, v, beta, s, do, dfinal, backend="triton")[2]
        for _ in range(2)
    ]
    for name, a, b in zip(GRAD_NAMES, *runs, strict=True):
        assert torch.equal(a, b), name


def test_dispatch_between_the_triton_kernels(monkeypatch, device):
    """Up to RECURRENT_MAX_LEN steps run the fused recurrent kernel, longer ones the chunked."""
    assert op.kernel_for("triton", op.RECURRENT_MAX_LEN) == "recurrent"
    assert op.kernel_for("triton", op.RECURRENT_MAX_LEN + 1) == "chunked"
    assert op.kernel_for("torch", 1) == "chunked"
    from mecheval_kernels.delta_rule import launch

    seen = []
    real_forward = launch.forward

    def spy(a):
        seen.append(a.kernel)
        return real_forward(a)

    monkeypatch.setattr(launch, "forward", spy)
    monkeypatch.setattr(op, "RECURRENT_MAX_LEN", 3)
    for T in (3, 4):
        q, k, v, beta, _ = _inputs(1, T, 1, 16, 16, torch.float32, device)
        chunk_delta_rule(q, k, v, beta, backend="triton")
    assert seen == ["recurrent", "chunked"]


def test_single_step_decoding_matches_reference(device):
    """T = 1 with a carried state, as in generation: the default dispatch (recurrent)."""
    q, k, v, beta, s = _inputs(3, 1, 2, 64, 64, torch.float16, device, True, seed=12)
    _check_against_reference(q, k, v, beta, s, torch.float16, "triton", True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_inputs(monkeypatch, device, backend):
    """q, k, v sliced out of one fused projection, as models hold them; the gradients come
    back in the inputs' layouts."""
    _force_kernel(monkeypatch, "chunked")
    device = device if backend == "triton" else torch.device("cpu")
    B, T, H, K, V = 2, 20, 2, 16, 20
    qkv = torch.randn(B, T, H, 2 * K + V, device=device)
    q, k, v = qkv[..., :K], F.normalize(qkv[..., K : 2 * K], dim=-1), qkv[..., 2 * K :]
    beta = torch.rand(B, 2 * T, H, device=device)[:, ::2]
    assert not q.is_contiguous() and not beta.is_contiguous()
    _check_against_reference(q, k, v, beta, None, torch.float32, backend, True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, beta)]
    o, _ = chunk_delta_rule(*leaves, backend=backend)
    o.sum().backward()
    for t in leaves:
        assert t.grad.stride() == torch.empty_like(t).stride()


def test_compiles_fullgraph_with_backward():
    class DeltaNetMixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.qkv = torch.nn.Linear(d, 3 * heads * head_dim)
            self.b = torch.nn.Linear(d, heads)

        def forward(self, x):  # x (B, T, d)
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
            o, _ = chunk_delta_rule(
                q, k, v, self.b(x).sigmoid(), use_qk_l2norm_in_kernel=True, backend="torch"
            )
            return o.flatten(2)

    model, x = DeltaNetMixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = model.qkv.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.qkv.weight.grad, expected)


def _valid_args() -> dict:
    return dict(
        q=torch.randn(2, 5, 3, 4),
        k=torch.randn(2, 5, 3, 4),
        v=torch.randn(2, 5, 3, 6),
        beta=torch.rand(2, 5, 3),
        scale=None,
        initial_state=None,
    )


# (arguments as keyword overrides of a valid call, expected error type, words the message names)
BAD_INPUTS = [
    (dict(q=torch.randn(2, 5, 4)), ValueError, ["q", "(B, T, H, K)"]),
    (dict(q="not a tensor"), TypeError, ["q", "Tensor"]),
    (dict(q=torch.randn(2, 5, 3, 4).long()), TypeError, ["q", "int64"]),
    (dict(q=torch.randn(2, 0, 3, 4)), ValueError, ["q", "T >= 1"]),
    (dict(k=torch.randn(2, 5, 3, 5)), ValueError, ["k", "(B, T, H, K)", "K: 5 != 4"]),
    (dict(k=torch.randn(2, 6, 3, 4)), ValueError, ["k", "T: 6 != 5"]),
    (dict(k=torch.randn(2, 5, 3, 4).half()), TypeError, ["k", "float16", "float32"]),
    (dict(v=torch.randn(2, 5, 2, 6)), ValueError, ["v", "HV = 2", "multiple", "H = 3"]),
    (dict(v=torch.randn(2, 5, 3)), ValueError, ["v", "(B, T, HV, V)"]),
    (dict(beta=torch.rand(2, 5, 3, 1)), ValueError, ["beta", "(B, T, HV)"]),
    (dict(beta=torch.rand(3, 5, 3)), ValueError, ["beta", "B: 3 != 2"]),
    (dict(beta=torch.rand(2, 5, 3) > 0.5), TypeError, ["beta", "bool"]),
    (dict(initial_state=torch.randn(2, 3, 4, 5)), ValueError, ["initial_state", "V: 5 != 6"]),
    (dict(initial_state=torch.randn(2, 3, 4)), ValueError, ["initial_state", "(B, HV, K, V)"]),
    (dict(q=torch.randn(1, 2, 1, 300), k=torch.randn(1, 2, 1, 300)), ValueError, ["K", "256"]),
    (dict(v=torch.randn(2, 5, 3, 257)), ValueError, ["V", "between 1 and 256", "257"]),
    (dict(scale="0.5"), TypeError, ["scale", "str"]),
    (dict(scale=float("nan")), ValueError, ["scale", "finite"]),
    (dict(k=torch.randn(2, 5, 3, 4, device="meta")), ValueError, ["one device", "k on meta"]),
    (dict(initial_state=torch.randn(2, 3, 4, 6, device="meta")), ValueError, ["initial_state"]),
    (dict(initial_state=torch.randn(2, 3, 4, 6, dtype=torch.float64)), None, []),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        chunk_delta_rule(**args, backend="torch")
        return
    with pytest.raises(error) as info:
        chunk_delta_rule(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_delta_rule(**_valid_args(), backend="cuda")


def test_triton_refuses_float64_by_name(device):
    args = {
        n: t.to(device, torch.float64) if isinstance(t, torch.Tensor) else t
        for n, t in _valid_args().items()
    }
    with pytest.raises(TypeError, match="q has dtype float64"):
        chunk_delta_rule(**args, backend="triton")


def test_second_derivatives_gradgradcheck_float64():
    """Second derivatives (create_graph) as fla's naive delta rule gives them: autograd through
    the per-step reference."""
    gen = torch.Generator().manual_seed(5)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, 4, 1, 3, 2
    leaves = [make(B, T, H, K), make(B, T, H, K), make(B, T, H, V), torch.rand(B, T, H,
              generator=gen, dtype=torch.float64), make(B, H, K, V)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]

    def fn(q, k, v, beta, state):
        return chunk_delta_rule(q, k, v, beta, 0.7, state, True, True, backend="torch")

    assert torch.autograd.gradgradcheck(fn, leaves)
