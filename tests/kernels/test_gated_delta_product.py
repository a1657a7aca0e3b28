"""chunk_gated_delta_product (n Householder steps a token) against flash-linear-attention 0.6.0's
naive reference (fp32 and fp64) and its own per-token reference: forward, every gradient, with
and without the gate, the scan at positions over tokens, vmap, torch.compile, bad input.

The Triton kernels (the gated delta rule's, over the n T steps) run under Triton's interpreter
on CPU; shapes are small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import mecheval_kernels
from mecheval_kernels import at_positions, chunk_gated_delta_product
from mecheval_kernels.delta_rule import torch_path
from mecheval_kernels.gated_delta_product import gated_delta_product_ref
from tests.kernels.tolerances import assert_close

fla_naive = pytest.importorskip("fla.ops.gated_delta_product.naive")

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class Float64Torch:
    """`torch` as fla's naive module sees it, with torch.float32 meaning float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _inputs(B, T, H, K, V, n, dtype, device="cpu", gated=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T * n, H, K), dim=-1), rand(B, T * n, H, V)
    g = F.logsigmoid(rand(B, T, H) + 2) if gated else None
    beta = 2 * torch.rand(B, T * n, H, generator=gen)  # up to 2: negative eigenvalues
    s = rand(B, H, K, V)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), None if g is None else g.to(device), to(beta), s.to(device)


def _forward_and_grads(fn, q, k, v, g, beta, init, n, do, dfinal, **kw):
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (q, k, v, g, beta, init)]  # fmt: skip
    o, final = fn(*leaves[:5], n, 0.5, leaves[5], True, **kw)
    torch.autograd.backward([o, final], [do, dfinal])
    return o, final, [None if t is None else t.grad for t in leaves]


def _check_against_reference(inputs, n, dtype, backend, l2norm=False):
    q, k, v, g, beta, init = inputs
    B, T, H, K = q.shape
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, v.shape[-1], generator=gen).to(device=q.device, dtype=dtype)
    dfinal = torch.randn(B, H, K, v.shape[-1], generator=gen).to(q.device)
    kw = dict(use_qk_l2norm_in_kernel=l2norm)
    o, final, grads = _forward_and_grads(
        chunk_gated_delta_product, *inputs, n, do, dfinal, backend=backend, **kw
    )
    up = lambda t: None if t is None else t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        gated_delta_product_ref, *(up(t) for t in inputs), n, up(do), dfinal, **kw
    )
    assert o.dtype == dtype and o.shape == (B, T, H, v.shape[-1])
    assert_close(o, o_ref, dtype, "o")
    assert_close(final, final_ref, dtype, "final_state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            assert_close(grad, grad_ref, dtype, name)


# (B, T, H, K, V, n, gated, l2norm)
CASES = [
    (2, 1, 2, 16, 16, 2, True, False),
    (1, 13, 1, 20, 12, 3, True, True),
    (1, 20, 2, 16, 16, 2, False, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-n{c[5]}-{'gated' if c[6] else 'plain'}" for c in CASES]


@pytest.mark.parametrize("B,T,H,K,V,n,gated,l2norm", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(monkeypatch, B, T, H, K, V, n, gated, l2norm):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 8)  # chunks that split tokens' steps
    inputs = _inputs(B, T, H, K, V, n, torch.float32, gated=gated, seed=T)
    _check_against_reference(inputs, n, torch.float32, "torch", l2norm)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,n,gated,l2norm", CASES, ids=CASE_IDS)
def test_triton_matches_reference(device, dtype, B, T, H, K, V, n, gated, l2norm):
    dt = DTYPES[dtype]
    inputs = _inputs(B, T, H, K, V, n, dt, device, gated, seed=T + K)
    _check_against_reference(inputs, n, dt, "triton", l2norm)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V,n,gated,l2norm", CASES, ids=CASE_IDS)
def test_triton_bf16_matches_reference(device, B, T, H, K, V, n, gated, l2norm):
    inputs = _inputs(B, T, H, K, V, n, torch.bfloat16, device, gated, seed=T)
    _check_against_reference(inputs, n, torch.bfloat16, "triton", l2norm)


@pytest.mark.parametrize("precision", [torch.float32, torch.float64])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_matches_flash_linear_attention_naive_reference(monkeypatch, precision, gated):
    """fla 0.6.0's naive_recurrent_gated_delta_product; in float64 with its casts to float32
    (torch.float32, Tensor.float) made casts to float64 while it runs: an fp64 oracle."""
    q, k, v, g, beta, s = _inputs(2, 24, 2, 16, 12, 3, precision, gated=gated, seed=4)
    g, s = None if g is None else g.to(precision), s.to(precision)
    with monkeypatch.context() as patch:
        if precision == torch.float64:
            patch.setattr(fla_naive, "torch", Float64Torch())
            patch.setattr(torch.Tensor, "float", torch.Tensor.double)
        o_ref, final_ref = fla_naive.naive_recurrent_gated_delta_product(
            q, k, v, g, beta, 0.3, initial_state=s.clone(), output_final_state=True,
            num_householder=3,
        )  # fmt: skip
    o, final = chunk_gated_delta_product(q, k, v, g, beta, 3, 0.3, s, True, backend="torch")
    assert_close(o, o_ref, precision, "o")
    assert_close(final, final_ref, precision, "final_state")


def test_one_step_a_token_is_the_gated_delta_rule():
    q, k, v, g, beta, s = _inputs(2, 20, 2, 8, 4, 1, torch.float32, seed=3)
    ours = chunk_gated_delta_product(q, k, v, g, beta, 1, None, s, True)
    theirs = mecheval_kernels.chunk_gated_delta_rule(q, k, v, g, beta, None, s, True)
    for a, b, name in zip(ours, theirs, ("o", "final_state"), strict=True):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("with_gate", [True, False])
def test_gradcheck_float64_torch_path(monkeypatch, with_gate):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 3)
    q, k, v, g, beta, s = _inputs(1, 4, 2, 3, 2, 2, torch.float64, gated=with_gate, seed=7)
    leaves = [t.double().requires_grad_() for t in (q, k, v, beta, s)]
    if with_gate:
        leaves.append(g.double().requires_grad_())

    def fn(q, k, v, beta, s, g=None):
        return chunk_gated_delta_product(q, k, v, g, beta, 2, 0.7, s, True, True, backend="torch")

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scan_at_tokens_matches_the_reference(device, backend):
    """States after tokens, the output at one token, a patched state after a token (the
    reference resumed from the patch on each row's remaining tokens)."""
    device = device if backend == "triton" else torch.device("cpu")
    n = 3
    q, k, v, g, beta, s = _inputs(2, 9, 2, 8, 4, n, torch.float32, device, seed=12)
    at = torch.tensor([[0, 5, 8], [3, 3, 7]], device=device)
    r = at_positions(chunk_gated_delta_product, q, k, v, g, beta, n, initial_state=s,
                     states_at=at, out_at=torch.tensor([8, 4], device=device),
                     return_final_state=True, backend=backend)  # fmt: skip
    o_ref, final_ref, states_ref = gated_delta_product_ref(q, k, v, g, beta, n, None, s, True,
                                                           states_at=at)  # fmt: skip
    assert_close(r.states, states_ref, torch.float32, "states")
    assert_close(r.final_state, final_ref, torch.float32, "final_state")
    assert_close(r.out[:, 0], o_ref[[0, 1], [8, 4]], torch.float32, "out")
    values = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(3)).to(device)
    where = torch.tensor([4, 0], device=device)
    patched = at_positions(chunk_gated_delta_product, q, k, v, g, beta, n, initial_state=s,
                           state_patch=(where, values), return_final_state=True,
                           backend=backend)  # fmt: skip
    for row in range(2):
        p = int(where[row]) + 1
        tail = (q[row : row + 1, p:], k[row : row + 1, p * n :], v[row : row + 1, p * n :],
                g[row : row + 1, p:], beta[row : row + 1, p * n :])  # fmt: skip
        o_tail, final_tail = gated_delta_product_ref(*tail, n, None, values[row : row + 1], True)
        assert_close(patched.out[row : row + 1, p:], o_tail, torch.float32, "patched out")
        assert_close(patched.out[row, :p], o_ref[row, :p], torch.float32, "out before")
        assert_close(patched.final_state[row : row + 1], final_tail, torch.float32, "final")
    with pytest.raises(ValueError, match=r"states_at must lie in \[0, 8\]"):
        at_positions(chunk_gated_delta_product, q, k, v, g, beta, n, states_at=at + 1)


def test_vmap_folds_models_into_heads():
    M, B, T, H, K, V, n = 3, 2, 5, 2, 4, 4, 2
    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(M, B, T, H, K, generator=gen), torch.randn(M, B, T * n, H, V, generator=gen)
    k = F.normalize(torch.randn(M, B, T * n, H, K, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(M, B, T, H, generator=gen))
    beta, state = (
        torch.rand(M, B, T * n, H, generator=gen),
        torch.randn(M, B, H, K, V, generator=gen),
    )

    def product(q, k, v, g, beta, state):
        o, final = chunk_gated_delta_product(q, k, v, g, beta, n, None, state, True)
        return o.sum() + final

    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    out = vmap(product)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    ref = torch.stack([product(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    assert_close(out, ref, torch.float32, "out")
    for name, ours, theirs in zip(GRAD_NAMES, ins, ref_ins, strict=True):
        assert_close(ours.grad, theirs.grad, torch.float32, name)


def test_compiles_fullgraph_with_backward():
    n = 2

    class ProductMixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.q = torch.nn.Linear(d, heads * head_dim)
            self.kv = torch.nn.Linear(d, 2 * n * heads * head_dim)
            self.gb = torch.nn.Linear(d, heads + n * heads)

        def forward(self, x):  # x (B, T, d)
            B, T, _ = x.shape
            q = self.q(x).view(B, T, self.heads, self.head_dim)
            k, v = self.kv(x).view(B, T * n, 2, self.heads, self.head_dim).unbind(2)
            a, b = self.gb(x).split([self.heads, n * self.heads], dim=-1)
            o, _ = chunk_gated_delta_product(
                q, k, v, -F.softplus(a), b.sigmoid().reshape(B, T * n, self.heads), n,
                use_qk_l2norm_in_kernel=True, backend="torch",
            )  # fmt: skip
            return o.flatten(2)

    model, x = ProductMixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = model.kv.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.kv.weight.grad, expected)


def _valid_args() -> dict:
    return dict(
        q=torch.randn(2, 5, 3, 4),
        k=torch.randn(2, 10, 3, 4),
        v=torch.randn(2, 10, 3, 6),
        g=-torch.rand(2, 5, 3),
        beta=torch.rand(2, 10, 3),
        num_householder=2,
    )


BAD_INPUTS = [
    (dict(k=torch.randn(2, 9, 3, 4)), ValueError, ["k", "Tn: 9 != 10"]),
    (dict(v=torch.randn(2, 5, 3, 6)), ValueError, ["v", "Tn: 5 != 10"]),
    (dict(beta=torch.rand(2, 5, 3)), ValueError, ["beta", "Tn: 5 != 10"]),
    (dict(g=-torch.rand(2, 10, 3)), ValueError, ["g", "T: 10 != 5"]),
    (dict(g=torch.rand(2, 5, 3) + 0.1), ValueError, ["g", "<= 0"]),
    (dict(num_householder=0), ValueError, ["num_householder", ">= 1"]),
    (dict(num_householder=2.0), ValueError, ["num_householder"]),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens", "not supported"]),
    (dict(cp_context=object()), ValueError, ["cp_context", "not supported"]),
    (dict(g=None), None, []),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        o, _ = chunk_gated_delta_product(**args, backend="torch")
        assert o.shape == (2, 5, 3, 6) and torch.isfinite(o).all()
        return
    with pytest.raises(error) as info:
        chunk_gated_delta_product(**args, backend="torch")
    assert str(info.value).startswith("chunk_gated_delta_product")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_second_derivatives_gradgradcheck_float64():
    q, k, v, g, beta, s = _inputs(1, 3, 1, 3, 2, 2, torch.float64, seed=13)
    leaves = [t.double().requires_grad_() for t in (q, k, v, g, beta, s)]

    def fn(q, k, v, g, beta, state):
        return chunk_gated_delta_product(q, k, v, g, beta, 2, 0.7, state, True, True,
                                         backend="torch")  # fmt: skip

    assert torch.autograd.gradgradcheck(fn, leaves)
