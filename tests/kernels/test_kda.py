"""chunk_kda (a decay per key channel) against flash-linear-attention 0.6.0's naive references
(fp32 and fp64) and the family's per-step reference: forward, every gradient, the drop-in's
options, the scan at positions, properties of the decaying memory, determinism, vmap,
torch.compile, bad input.

The Triton kernels run under Triton's interpreter on CPU (set up in tests/conftest.py); shapes
are small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import mecheval_kernels
from mecheval_kernels import at_positions, chunk_gated_delta_rule, chunk_kda
from mecheval_kernels.delta_rule import torch_path
from mecheval_kernels.kda import kda_ref
from tests.kernels.tolerances import assert_close, relative_error

fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class Float64Torch:
    """`torch` as fla's naive module sees it, with torch.float meaning float64: its reference,
    which casts to torch.float, then runs in float64 (an fp64 oracle)."""

    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _inputs(B, T, H, K, V, dtype, device="cpu", init=False, seed=0, HV=None, g_scale=1.0):
    """Unit keys, beta in (0, 1), per-channel log decays logsigmoid(.) <= 0 (g and the state
    stay float32, as a model's are). HV value heads (GVA) when given."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, HV, V)
    g = g_scale * F.logsigmoid(rand(B, T, HV, K) + 2)
    beta = torch.rand(B, T, HV, generator=gen)
    s = rand(B, HV, K, V) if init else None
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), g.to(device), to(beta), None if s is None else s.to(device)


def _forward_and_grads(fn, q, k, v, g, beta, init, do, dfinal, **kw):
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (q, k, v, g, beta, init)]  # fmt: skip
    o, final = fn(*leaves[:5], initial_state=leaves[5], output_final_state=dfinal is not None, **kw)
    outs, cots = [o], [do]
    if dfinal is not None:
        outs.append(final)
        cots.append(dfinal)
    torch.autograd.backward(outs, cots)
    return o, final, [None if t is None else t.grad for t in leaves]


def _check_against_reference(inputs, dtype, backend, final_grad=True, l2norm=False):
    q, k, v, g, beta, init = inputs
    B, T, H, K = q.shape
    V = v.shape[-1]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen).to(device=q.device, dtype=dtype)
    dfinal = torch.randn(B, H, K, V, generator=gen).to(q.device) if final_grad else None
    kw = dict(use_qk_l2norm_in_kernel=l2norm)
    o, final, grads = _forward_and_grads(
        chunk_kda, *inputs, do, dfinal, backend=backend, **kw
    )  # fmt: skip
    up = lambda t: None if t is None else t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        kda_ref, *(up(t) for t in inputs), up(do), up(dfinal), **kw
    )
    assert o.dtype == dtype
    assert_close(o, o_ref, dtype, "o")
    if final_grad:
        assert final.dtype == torch.float32
        assert_close(final, final_ref, dtype, "final_state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            assert_close(grad, grad_ref, dtype, name)


# (B, T, H, K, V, initial_state, final-state gradient, l2norm): one step, within a chunk, a whole
# chunk (16 on Triton), several ragged chunks; K, V not powers of two.
CASES = [
    (2, 1, 2, 16, 16, True, True, False),
    (1, 12, 1, 20, 36, False, True, True),
    (2, 16, 1, 16, 20, True, False, False),
    (1, 37, 2, 20, 16, True, True, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}" for c in CASES]


def _gamma_form(monkeypatch, form: str) -> None:
    """Gamma from two factors or, `exact`, from segment sums, whatever the decays."""
    monkeypatch.setattr(torch_path, "SAFE_DECAY", float("inf") if form == "factored" else -1.0)


@pytest.mark.parametrize("form", ["factored", "exact"])
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(monkeypatch, form, B, T, H, K, V, init, final_grad, l2norm):
    monkeypatch.setattr(torch_path, "KEY_CHUNK_SIZE", 5)  # several ragged chunks
    _gamma_form(monkeypatch, form)
    inputs = _inputs(B, T, H, K, V, torch.float32, init=init, seed=T)
    _check_against_reference(inputs, torch.float32, "torch", final_grad, l2norm)


def test_torch_path_fp16_matches_reference():
    inputs = _inputs(2, 50, 2, 20, 36, torch.float16, init=True, seed=3)
    _check_against_reference(inputs, torch.float16, "torch")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_matches_reference(device, dtype, B, T, H, K, V, init, final_grad, l2norm):
    dt = DTYPES[dtype]
    inputs = _inputs(B, T, H, K, V, dt, device, init, seed=T + K)
    _check_against_reference(inputs, dt, "triton", final_grad, l2norm)


def test_triton_wide_head_fp16(device):
    """K = 100: the state kernels pad it to 128, the Gamma tiles take it in blocks of 32 (16 in
    the gradient kernel, whose last block reaches past K)."""
    inputs = _inputs(1, 20, 1, 100, 36, torch.float16, device, True, seed=9)
    _check_against_reference(inputs, torch.float16, "triton")


@pytest.mark.usefixtures("nan_fresh_buffers", "bounds_checked_interpreter")
def test_triton_reads_only_what_it_wrote(device):
    inputs = _inputs(2, 21, 2, 20, 36, torch.float32, device, True, seed=21)
    _check_against_reference(inputs, torch.float32, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_bf16_matches_reference(device, B, T, H, K, V, init, final_grad, l2norm):
    inputs = _inputs(B, T, H, K, V, torch.bfloat16, device, init, seed=T)
    _check_against_reference(inputs, torch.bfloat16, "triton", final_grad, l2norm)


@pytest.mark.gpu
def test_triton_bf16_large_heads(device):
    inputs = _inputs(2, 1000, 4, 128, 128, torch.bfloat16, device, True, seed=11)
    _check_against_reference(inputs, torch.bfloat16, "triton")


@pytest.mark.parametrize("precision", [torch.float32, torch.float64])
@pytest.mark.parametrize("naive", ["naive_recurrent_kda", "naive_chunk_kda"])
def test_matches_flash_linear_attention_naive_references(monkeypatch, naive, precision):
    """fla 0.6.0's own references, with GVA (4 value heads on 2 query heads), an initial state
    and the final state; in float64 fla's reference runs with torch.float meaning float64."""
    if precision == torch.float64:
        monkeypatch.setattr(fla_naive, "torch", Float64Torch())
    q, k, v, g, beta, s = _inputs(2, 64, 2, 16, 12, precision, init=True, seed=4, HV=4)
    g, s = g.to(precision), s.to(precision)
    kw = dict(chunk_size=16) if naive == "naive_chunk_kda" else {}
    o_ref, final_ref = getattr(fla_naive, naive)(q, k, v, g, beta, 0.3, s, True, **kw)
    o, final = chunk_kda(q, k, v, g, beta, 0.3, s, True, backend="torch")
    assert_close(o, o_ref, precision, "o")
    assert_close(final, final_ref, precision, "final_state")


def test_gate_in_kernel_matches_flash_linear_attention_gates():
    """use_gate_in_kernel: -exp(A_log) softplus(g + dt_bias), and with lower_bound (safe_gate)
    lower_bound * sigmoid(exp(A_log) (g + dt_bias)), as fla's naive gates give them."""
    q, k, v, raw, beta, s = _inputs(1, 9, 2, 8, 4, torch.float64, init=True, seed=5)
    raw, s = raw.double() * 3, s.double()
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = torch.randn(2, generator=gen).double(), torch.randn(16, generator=gen).double()
    for extra, gate in (
        ({}, fla_gate.naive_kda_gate(raw, A_log, dt_bias, output_dtype=torch.float64)),
        (dict(lower_bound=-4.0, safe_gate=True),
         fla_gate.naive_kda_lowerbound_gate(raw, A_log, dt_bias, -4.0, torch.float64)),
    ):  # fmt: skip
        o, final = chunk_kda(q, k, v, raw, beta, None, s, True, use_gate_in_kernel=True,
                             A_log=A_log, dt_bias=dt_bias, backend="torch", **extra)  # fmt: skip
        o_ref, final_ref = kda_ref(q, k, v, gate, beta, None, s, True)
        assert relative_error(o, o_ref) < 1e-6 and relative_error(final, final_ref) < 1e-6


def test_beta_logits_and_state_layout():
    """use_beta_sigmoid_in_kernel (with allow_neg_eigval: 2 sigmoid) and state_v_first."""
    q, k, v, g, logits, s = _inputs(1, 9, 2, 8, 4, torch.float64, init=True, seed=6)
    g, s, logits = g.double(), s.double(), 4 * logits - 2
    o, final = chunk_kda(q, k, v, g, logits, None, s.transpose(-1, -2), True,
                         use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                         state_v_first=True, backend="torch")  # fmt: skip
    o_ref, final_ref = kda_ref(q, k, v, g, 2 * logits.sigmoid(), None, s, True)
    assert relative_error(o, o_ref) < 1e-12
    assert relative_error(final, final_ref.transpose(-1, -2)) < 1e-12


def test_factored_gamma_at_its_limit_is_accurate():
    """Chunks whose total decay sits just inside SAFE_DECAY (the factors reach exp(+-29)): the
    PyTorch path in float32 within 1e-5 of the float64 reference, forward and gradients."""
    q, k, v, g, beta, s = _inputs(2, 37, 2, 16, 16, torch.float32, init=True, seed=9)
    g = -3.6 + 0.05 * torch.rand(g.shape, generator=torch.Generator().manual_seed(9))
    chunks = torch_path._to_chunks(g, 8, 5)  # 37 steps in chunks as the path cuts them
    assert -torch_path.SAFE_DECAY < chunks.sum(3).min() < -0.9 * torch_path.SAFE_DECAY
    do = torch.randn(2, 37, 2, 16, generator=torch.Generator().manual_seed(10))
    ours = _forward_and_grads(chunk_kda, q, k, v, g, beta, s, do, None, backend="torch")
    ref = _forward_and_grads(kda_ref, *(t.double() for t in (q, k, v, g, beta, s, do)), None)
    for name, a, b in zip(("o", *GRAD_NAMES), [ours[0], *ours[2]], [ref[0], *ref[2]], strict=True):
        assert relative_error(a, b) < 1e-5, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strong_and_huge_decays_stay_finite_and_exact(device, backend):
    """Channels decaying by exp(-60) a step, and steps that wipe a channel (-1e4) among slow
    ones: no inf/NaN, no cancellation in the in-chunk decays."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 40, 2, 16, 16, torch.float32, device, True, seed=8)
    gen = torch.Generator().manual_seed(8)
    strong = -60 * torch.rand(g.shape, generator=gen)
    wipe = torch.rand(g.shape, generator=gen) < 0.1
    slow = -0.01 * torch.rand(g.shape, generator=gen)
    g = torch.where(wipe, -1e4, torch.where(torch.rand(g.shape, generator=gen) < 0.5, strong, slow))
    beta = torch.where(torch.rand(beta.shape, generator=gen) < 0.5, 2.0, 0.0).to(device)
    _check_against_reference((q, k, v, g.to(device), beta, s), torch.float32, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_decay_for_every_channel_is_the_gated_delta_rule(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 20, 2, 16, 20, torch.float32, device, True, seed=2)
    head = g[..., 0]
    ours = chunk_kda(q, k, v, head[..., None].expand_as(g), beta, 0.5, s, True, backend=backend)
    theirs = chunk_gated_delta_rule(q, k, v, head, beta, 0.5, s, True, backend=backend)
    for a, b, name in zip(ours, theirs, ("o", "final_state"), strict=True):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_splitting_the_sequence_and_carrying_the_state_equals_one_call(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(2, 40, 1, 16, 16, torch.float32, device, True, seed=6)
    o_whole, final_whole = chunk_kda(q, k, v, g, beta, None, s, True, backend=backend)
    pieces, state = [], s
    for start, stop in ((0, 1), (1, 17), (17, 40)):
        piece = [t[:, start:stop] for t in (q, k, v, g, beta)]
        o, state = chunk_kda(*piece, None, state, True, backend=backend)
        pieces.append(o)
    assert_close(torch.cat(pieces, dim=1), o_whole, torch.float32, "o")
    assert_close(state, final_whole, torch.float32, "final_state")


def test_triton_backward_is_deterministic(device):
    q, k, v, g, beta, s = _inputs(1, 40, 2, 48, 32, torch.float32, device, True, seed=10)
    do = torch.randn(1, 40, 2, 32).to(device)
    dfinal = torch.randn(1, 2, 48, 32).to(device)
    runs = [
        _forward_and_grads(chunk_kda, q, k, v, g, beta, s, do, dfinal, backend="triton")[2]
        for _ in range(2)
    ]
    for name, a, b in zip(GRAD_NAMES, *runs, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("form", ["factored", "exact"])
@pytest.mark.parametrize("with_init", [True, False])
def test_gradcheck_float64_torch_path(monkeypatch, form, with_init):
    monkeypatch.setattr(torch_path, "KEY_CHUNK_SIZE", 3)  # several chunks, a ragged last one
    _gamma_form(monkeypatch, form)
    q, k, v, g, beta, s = _inputs(1, 7, 2, 3, 2, torch.float64, init=with_init, seed=7)
    leaves = [t.double().requires_grad_() for t in (q, k, v, g, 2 * beta)]
    leaves += [s.double().requires_grad_()] if with_init else []

    def fn(q, k, v, g, beta, init=None):
        return chunk_kda(q, k, v, g, beta, 0.7, init, True, True, backend="torch")

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scan_at_positions_matches_the_reference(device, backend):
    """States after steps, the output at one step, a patched state (the reference resumed from
    the patch on each row's suffix)."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(2, 21, 2, 8, 4, torch.float32, device, True, seed=12, HV=4)
    at = torch.tensor([[0, 5, 17], [3, 3, 20]], device=device)
    r = at_positions(chunk_kda, q, k, v, g, beta, initial_state=s, states_at=at,
                     out_at=torch.tensor([20, 4], device=device), return_final_state=True,
                     backend=backend)  # fmt: skip
    qe, ke = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)
    o_ref, final_ref, states_ref = kda_ref(qe, ke, v, g, beta, None, s, True, states_at=at)
    assert_close(r.states, states_ref, torch.float32, "states")
    assert_close(r.final_state, final_ref, torch.float32, "final_state")
    assert_close(r.out[:, 0], o_ref[[0, 1], [20, 4]], torch.float32, "out")
    values = torch.randn(2, 4, 8, 4, generator=torch.Generator().manual_seed(3)).to(device)
    where = torch.tensor([6, 0], device=device)
    patched = at_positions(chunk_kda, q, k, v, g, beta, initial_state=s, backend=backend,
                           state_patch=(where, values), return_final_state=True)  # fmt: skip
    for row in range(2):
        p = int(where[row]) + 1
        tail = [t[row : row + 1, p:] for t in (qe, ke, v, g, beta)]
        o_tail, final_tail = kda_ref(*tail, None, values[row : row + 1], True)
        assert_close(patched.out[row : row + 1, p:], o_tail, torch.float32, "patched out")
        assert_close(patched.out[row, :p], o_ref[row, :p], torch.float32, "out before")
        assert_close(patched.final_state[row : row + 1], final_tail, torch.float32, "final")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vmap_folds_models_into_heads(backend):
    M, B, T, H, K, V = 3, 2, 9, 2, 4, 4
    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(M, B, T, H, K, generator=gen), torch.randn(M, B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(M, B, T, H, K, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(M, B, T, H, K, generator=gen))
    beta, state = torch.rand(M, B, T, H, generator=gen), torch.randn(M, B, H, K, V, generator=gen)

    def kda(q, k, v, g, beta, state):
        o, final = chunk_kda(q, k, v, g, beta, None, state, True, backend=backend)
        return o.sum() + final

    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    out = vmap(kda)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    ref = torch.stack([kda(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    assert_close(out, ref, torch.float32, "out")
    for name, ours, theirs in zip(GRAD_NAMES, ins, ref_ins, strict=True):
        assert_close(ours.grad, theirs.grad, torch.float32, name)


def test_compiles_fullgraph_with_backward():
    class KdaMixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.qkvg = torch.nn.Linear(d, 4 * heads * head_dim)
            self.b = torch.nn.Linear(d, heads)

        def forward(self, x):  # x (B, T, d)
            B, T, _ = x.shape
            q, k, v, g = self.qkvg(x).view(B, T, 4, self.heads, self.head_dim).unbind(2)
            o, _ = chunk_kda(q, k, v, -F.softplus(g), self.b(x).sigmoid(),
                             use_qk_l2norm_in_kernel=True, backend="torch")  # fmt: skip
            return o.flatten(2)

    model, x = KdaMixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = model.qkvg.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.qkvg.weight.grad, expected)


def _valid_args() -> dict:
    return dict(
        q=torch.randn(2, 5, 3, 4),
        k=torch.randn(2, 5, 3, 4),
        v=torch.randn(2, 5, 3, 6),
        g=-torch.rand(2, 5, 3, 4),
        beta=torch.rand(2, 5, 3),
    )


# (arguments as keyword overrides of a valid call, expected error type, words the message names)
BAD_INPUTS = [
    (dict(g=-torch.rand(2, 5, 3)), ValueError, ["g", "(B, T, HV, K)"]),
    (dict(g=-torch.rand(2, 5, 3, 5)), ValueError, ["g", "K: 5 != 4"]),
    (dict(g=torch.rand(2, 5, 3, 4) + 0.01), ValueError, ["g", "<= 0", "positive"]),
    (dict(g=torch.full((2, 5, 3, 4), float("nan"))), ValueError, ["g", "finite"]),
    (dict(v=torch.randn(2, 5, 4, 6)), ValueError, ["HV = 4", "multiple", "H = 3"]),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens", "not supported"]),
    (dict(cu_seqlens_cpu=torch.tensor([0, 5])), ValueError, ["cu_seqlens_cpu", "not supported"]),
    (dict(return_intermediate_states=True), ValueError, ["return_intermediate_states"]),
    (dict(use_graph=True), ValueError, ["use_graph"]),
    (dict(cp_context=object()), ValueError, ["cp_context"]),
    (dict(allow_neg_eigval=True), ValueError, ["allow_neg_eigval", "use_beta_sigmoid_in_kernel"]),
    (dict(use_gate_in_kernel=True), ValueError, ["use_gate_in_kernel", "A_log"]),
    (
        dict(use_gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(3)),
        ValueError,
        ["dt_bias", "12 elements"],
    ),  # fmt: skip
    (
        dict(use_gate_in_kernel=True, A_log=torch.zeros(3), safe_gate=True, lower_bound=-6.0),
        ValueError,
        ["lower_bound", "[-5, 0)"],
    ),  # fmt: skip
    (dict(chunk_size=16), ValueError, ["chunk_size", "(32, 64)"]),
    (dict(head_first=True), ValueError, ["head_first", "removed"]),
    (dict(not_an_argument=1), TypeError, ["not_an_argument"]),
    (dict(chunk_size=32, disable_recompute=True, safe_gate=True), None, []),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        o, _ = chunk_kda(**args, backend="torch")
        assert torch.isfinite(o).all()
        return
    with pytest.raises(error) as info:
        chunk_kda(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_is_exported():
    assert mecheval_kernels.chunk_kda is chunk_kda


def test_second_derivatives_gradgradcheck_float64():
    q, k, v, g, beta, s = _inputs(1, 4, 1, 3, 2, torch.float64, init=True, seed=13)
    leaves = [t.double().requires_grad_() for t in (q, k, v, g, beta, s)]

    def fn(q, k, v, g, beta, state):
        return chunk_kda(q, k, v, g, beta, 0.7, state, True, True, backend="torch")

    assert torch.autograd.gradgradcheck(fn, leaves)
