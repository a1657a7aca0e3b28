"""chunk_comba (a recall key p read before the step's decay) against flash-linear-attention
0.6.0's naive chunk reference (fp32 and fp64; fla's own kernels compute what it computes) and
the family's per-step reference: forward, every gradient (p's included), the scan at positions,
decays, determinism, vmap, torch.compile, bad input.

The Triton kernels run under Triton's interpreter on CPU; shapes are small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import mecheval_kernels
from mecheval_kernels import at_positions, chunk_comba
from mecheval_kernels.comba import comba_ref
from mecheval_kernels.delta_rule import torch_path
from tests.kernels.tolerances import assert_close, relative_error

fla_naive = pytest.importorskip("fla.ops.comba.naive")

GRAD_NAMES = ("dq", "dk", "dv", "dp", "dg", "dbeta", "dinitial_state")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class Float64Torch:
    """`torch` as fla's naive module sees it, with torch.float and torch.float32 meaning
    float64."""

    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _inputs(B, T, H, K, V, dtype, device="cpu", seed=0, HV=None, g_scale=1.0):
    """Unit keys (k and p), beta in (0, 1), log decays logsigmoid(.) <= 0 (g and the state stay
    float32, as a model's are); HV value heads (GVA) when given."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rand(B, T, H, K)
    k, p = F.normalize(rand(B, T, H, K), dim=-1), F.normalize(rand(B, T, H, K), dim=-1)
    v, g = rand(B, T, HV, V), g_scale * F.logsigmoid(rand(B, T, HV) + 2)
    beta, s = torch.rand(B, T, HV, generator=gen), rand(B, HV, K, V)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), to(p), g.to(device), to(beta), s.to(device)


def _forward_and_grads(fn, inputs, do, dfinal, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, final = fn(*leaves[:6], None, leaves[6], True, **kw)
    torch.autograd.backward([o, final], [do, dfinal])
    return o, final, [t.grad for t in leaves]


def _check_against_reference(inputs, dtype, backend, l2norm=False):
    q, v, s = inputs[0], inputs[2], inputs[6]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(v.shape, generator=gen).to(device=q.device, dtype=dtype)
    dfinal = torch.randn(s.shape, generator=gen).to(q.device)
    kw = dict(use_qk_l2norm_in_kernel=l2norm)
    o, final, grads = _forward_and_grads(chunk_comba, inputs, do, dfinal, backend=backend, **kw)
    up = [t.float() for t in inputs]
    o_ref, final_ref, grads_ref = _forward_and_grads(comba_ref, up, do.float(), dfinal, **kw)
    assert o.dtype == dtype
    assert_close(o, o_ref, dtype, "o")
    assert_close(final, final_ref, dtype, "final_state")
    names = ("dq", "dk", "dv", "dp", "dg", "dbeta", "dinitial_state")
    for name, grad, grad_ref in zip(names, grads, grads_ref, strict=True):
        assert_close(grad, grad_ref, dtype, name)


# (B, T, H, K, V, l2norm): one step, within a chunk, a whole chunk (32 on Triton), several
# ragged chunks; K, V not powers of two.
CASES = [
    (2, 1, 2, 16, 16, False),
    (1, 20, 1, 20, 36, True),
    (2, 32, 1, 16, 20, False),
    (1, 70, 2, 20, 16, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}" for c in CASES]


@pytest.mark.parametrize("B,T,H,K,V,l2norm", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(monkeypatch, B, T, H, K, V, l2norm):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 16)  # several chunks at these lengths
    inputs = _inputs(B, T, H, K, V, torch.float32, seed=T)
    _check_against_reference(inputs, torch.float32, "torch", l2norm)


def test_torch_path_fp16_matches_reference():
    inputs = _inputs(2, 100, 2, 20, 36, torch.float16, seed=3)
    _check_against_reference(inputs, torch.float16, "torch")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,l2norm", CASES, ids=CASE_IDS)
def test_triton_matches_reference(device, dtype, B, T, H, K, V, l2norm):
    dt = DTYPES[dtype]
    inputs = _inputs(B, T, H, K, V, dt, device, seed=T + K)
    _check_against_reference(inputs, dt, "triton", l2norm)


@pytest.mark.usefixtures("nan_fresh_buffers", "bounds_checked_interpreter")
def test_triton_reads_only_what_it_wrote(device):
    inputs = _inputs(2, 37, 2, 20, 36, torch.float32, device, seed=21)
    _check_against_reference(inputs, torch.float32, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V,l2norm", CASES, ids=CASE_IDS)
def test_triton_bf16_matches_reference(device, B, T, H, K, V, l2norm):
    inputs = _inputs(B, T, H, K, V, torch.bfloat16, device, seed=T)
    _check_against_reference(inputs, torch.bfloat16, "triton", l2norm)


@pytest.mark.parametrize("precision", [torch.float32, torch.float64])
def test_matches_flash_linear_attention_naive_chunk_reference(monkeypatch, precision):
    """fla 0.6.0's naive_chunk_comba, with GVA (4 value heads on 2 query heads); in float64 with
    its casts to float32 (torch.float, torch.float32, Tensor.float) made casts to float64."""
    q, k, v, p, g, beta, s = _inputs(2, 50, 2, 16, 12, precision, seed=4, HV=4)
    g, s = g.to(precision), s.to(precision)
    expand = lambda t: t.repeat_interleave(2, 2)  # noqa: E731 (fla's naive has no GVA)
    with monkeypatch.context() as patch:
        if precision == torch.float64:
            patch.setattr(fla_naive, "torch", Float64Torch())
            patch.setattr(torch.Tensor, "float", torch.Tensor.double)
        o_ref, final_ref = fla_naive.naive_chunk_comba(
            expand(q), expand(k), v, expand(p), g, beta, chunk_size=16, scale=0.3,
            initial_state=s, output_final_state=True,
        )  # fmt: skip
    o, final = chunk_comba(q, k, v, p, g, beta, 0.3, s, True, backend="torch")
    assert_close(o, o_ref, precision, "o")
    assert_close(final, final_ref, precision, "final_state")


def test_fla_naive_recurrent_reference_decays_before_the_recall():
    """fla 0.6.0's naive_recurrent_comba decays the memory before p recalls from it, unlike
    fla's chunk and fused recurrent kernels and naive_chunk_comba: it is the family's gated
    delta rule with the recall key p after the decay, not Comba as chunk_comba computes it."""
    q, k, v, p, g, beta, s = _inputs(1, 20, 2, 8, 4, torch.float64, seed=5)
    o_naive, _ = fla_naive.naive_recurrent_comba(q, k, v, p, beta, g, 0.3, s, True)
    o, _ = chunk_comba(q, k, v, p, g.double(), beta, 0.3, s.double(), True)
    assert relative_error(o, o_naive) > 1e-3
    recalled_after = torch.exp(g.double())[..., None] * p  # p^T (exp(g) S) = (exp(g) p)^T S
    o_after, _ = chunk_comba(q, k, v, recalled_after, g.double(), beta, 0.3, s.double(), True)
    assert relative_error(o_after, o_naive) < 1e-6  # fla's naive computes in float32


def test_recall_key_k_differs_from_the_gated_delta_rule_only_by_the_decay_order():
    """p = k: Comba recalls before the decay, the gated delta rule after; with g = 0 the two
    are the same op."""
    q, k, v, _, g, beta, s = _inputs(1, 40, 2, 16, 20, torch.float32, seed=2)
    zero = torch.zeros_like(g)
    ours = chunk_comba(q, k, v, None, zero, beta, 0.5, s, True)
    theirs = mecheval_kernels.chunk_gated_delta_rule(q, k, v, zero, beta, 0.5, s, True)
    for a, b, name in zip(ours, theirs, ("o", "final_state"), strict=True):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strong_and_huge_decays_stay_finite_and_exact(device, backend):
    """Decays down to exp(-60) a step, and memory wipes (-1e4) among slow decays: the shifted
    in-chunk decays of the recalls are summed directly too."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, p, g, beta, s = _inputs(1, 70, 2, 16, 16, torch.float32, device, seed=8)
    gen = torch.Generator().manual_seed(8)
    wipe = torch.rand(g.shape, generator=gen) < 0.1
    strong = torch.rand(g.shape, generator=gen) < 0.3
    g = torch.where(
        wipe, -1e4, torch.where(strong, -60.0, -0.01) * torch.rand(g.shape, generator=gen)
    )
    beta = torch.where(torch.rand(beta.shape, generator=gen) < 0.5, 2.0, 0.0).to(device)
    _check_against_reference((q, k, v, p, g.to(device), beta, s), torch.float32, backend)


def test_triton_backward_is_deterministic(device):
    inputs = _inputs(1, 70, 2, 64, 64, torch.float32, device, seed=10)
    do = torch.randn(1, 70, 2, 64).to(device)
    dfinal = torch.randn(1, 2, 64, 64).to(device)
    runs = [
        _forward_and_grads(chunk_comba, inputs, do, dfinal, backend="triton")[2] for _ in range(2)
    ]
    for name, a, b in zip(GRAD_NAMES, *runs, strict=True):
        assert torch.equal(a, b), name


def test_gradcheck_float64_torch_path(monkeypatch):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 3)
    inputs = _inputs(1, 7, 2, 3, 2, torch.float64, seed=7)
    leaves = [t.double().requires_grad_() for t in inputs]

    def fn(q, k, v, p, g, beta, init):
        return chunk_comba(q, k, v, p, g, 2 * beta, 0.7, init, True, True, backend="torch")

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scan_at_positions_matches_the_reference(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, p, g, beta, s = _inputs(2, 21, 2, 8, 4, torch.float32, device, seed=12)
    at = torch.tensor([[0, 5, 17], [3, 3, 20]], device=device)
    r = at_positions(chunk_comba, q, k, v, p, g, beta, initial_state=s, states_at=at,
                     out_at=torch.tensor([20, 4], device=device), return_final_state=True,
                     backend=backend)  # fmt: skip
    o_ref, final_ref, states_ref = comba_ref(q, k, v, p, g, beta, None, s, True, states_at=at)
    assert_close(r.states, states_ref, torch.float32, "states")
    assert_close(r.final_state, final_ref, torch.float32, "final_state")
    assert_close(r.out[:, 0], o_ref[[0, 1], [20, 4]], torch.float32, "out")
    values = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(3)).to(device)
    where = torch.tensor([6, 0], device=device)
    patched = at_positions(chunk_comba, q, k, v, p, g, beta, initial_state=s, backend=backend,
                           state_patch=(where, values), return_final_state=True)  # fmt: skip
    for row in range(2):
        first = int(where[row]) + 1
        tail = [t[row : row + 1, first:] for t in (q, k, v, p, g, beta)]
        o_tail, final_tail = comba_ref(*tail, None, values[row : row + 1], True)
        assert_close(patched.out[row : row + 1, first:], o_tail, torch.float32, "patched out")
        assert_close(patched.final_state[row : row + 1], final_tail, torch.float32, "final")


def test_vmap_folds_models_into_heads():
    M, B, T, H, K, V = 3, 2, 9, 2, 4, 4
    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(M, B, T, H, K, generator=gen), torch.randn(M, B, T, H, V, generator=gen)
    k, p = (F.normalize(torch.randn(M, B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    g = F.logsigmoid(torch.randn(M, B, T, H, generator=gen))
    beta = torch.rand(M, B, T, H, generator=gen)
    state = torch.randn(M, B, H, K, V, generator=gen)

    def comba(q, k, v, p, g, beta, state):
        o, final = chunk_comba(q, k, v, p, g, beta, None, state, True)
        return o.sum() + final

    ins = [t.clone().requires_grad_() for t in (q, k, v, p, g, beta, state)]
    out = vmap(comba)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, p, g, beta, state)]
    ref = torch.stack([comba(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    assert_close(out, ref, torch.float32, "out")
    for name, ours, theirs in zip(GRAD_NAMES, ins, ref_ins, strict=True):
        assert_close(ours.grad, theirs.grad, torch.float32, name)


def test_compiles_fullgraph_with_backward():
    class CombaMixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.qkvp = torch.nn.Linear(d, 4 * heads * head_dim)
            self.ab = torch.nn.Linear(d, 2 * heads)

        def forward(self, x):  # x (B, T, d)
            B, T, _ = x.shape
            q, k, v, p = self.qkvp(x).view(B, T, 4, self.heads, self.head_dim).unbind(2)
            a, b = self.ab(x).chunk(2, dim=-1)
            o, _ = chunk_comba(q, k, v, p, -F.softplus(a), b.sigmoid(),
                               use_qk_l2norm_in_kernel=True, backend="torch")  # fmt: skip
            return o.flatten(2)

    model, x = CombaMixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = model.qkvp.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.qkvp.weight.grad, expected)


def _valid_args() -> dict:
    return dict(
        q=torch.randn(2, 5, 3, 4),
        k=torch.randn(2, 5, 3, 4),
        v=torch.randn(2, 5, 3, 6),
        p=torch.randn(2, 5, 3, 4),
        g=-torch.rand(2, 5, 3),
        beta=torch.rand(2, 5, 3),
    )


BAD_INPUTS = [
    (dict(p=torch.randn(2, 5, 3, 5)), ValueError, ["p", "K: 5 != 4"]),
    (dict(p=torch.randn(2, 5, 3, 4).half()), TypeError, ["p", "float16"]),
    (dict(beta=None), ValueError, ["beta", "None"]),
    (dict(g=torch.rand(2, 5, 3) + 0.1), ValueError, ["g", "<= 0"]),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens", "not supported"]),
    (dict(cu_seqlens_cpu=torch.tensor([0, 5])), ValueError, ["cu_seqlens_cpu"]),
    (dict(p=None), None, []),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        o, _ = chunk_comba(**args, backend="torch")
        assert torch.isfinite(o).all()
        return
    with pytest.raises(error) as info:
        chunk_comba(**args, backend="torch")
    assert str(info.value).startswith("chunk_comba")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_second_derivatives_gradgradcheck_float64():
    leaves = [t.double().requires_grad_() for t in _inputs(1, 4, 1, 3, 2, torch.float64, seed=13)]

    def fn(q, k, v, p, g, beta, state):
        return chunk_comba(q, k, v, p, g, beta, 0.7, state, True, True, backend="torch")

    assert torch.autograd.gradgradcheck(fn, leaves)
