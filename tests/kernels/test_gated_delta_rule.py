"""chunk_gated_delta_rule against its reference (the per-step recurrence): forward, every
gradient (g's included), properties of the decaying memory, determinism, vmap, torch.compile,
bad input.

The Triton kernels run under Triton's interpreter on CPU (set up in tests/conftest.py) and
compiled on a GPU; the reference computes in float32 (float64 for gradcheck) on the same,
already-rounded inputs. Shapes are small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

from mecheval_kernels import chunk_delta_rule, chunk_gated_delta_rule
from mecheval_kernels.delta_rule import torch_path
from mecheval_kernels.gated_delta_rule import gated_delta_rule_ref
from tests.kernels.tolerances import assert_close

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _inputs(B, T, H, K, V, dtype, device, init=False, l2norm=False, seed=0, g_scale=1.0):
    """Unit keys (or raw ones, with l2norm), beta in (0, 1), log decays g = logsigmoid(.) <= 0
    (g_scale times them: larger, faster forgetting). g and the state stay float32, as a
    model's are."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    if not l2norm:
        k = F.normalize(k, dim=-1)
    g = g_scale * F.logsigmoid(rand(B, T, H) + 2)
    beta = torch.rand(B, T, H, generator=gen)
    s = rand(B, H, K, V) if init else None
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(q), to(k), to(v), g.to(device), to(beta), None if s is None else s.to(device)


def _forward_and_grads(fn, q, k, v, g, beta, init, do, dfinal, l2norm=False, **kw):
    leaves = [
        None if t is None else t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, init)
    ]
    o, final = fn(
        *leaves[:5],
        initial_state=leaves[5],
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


def _check_against_reference(inputs, dtype, backend, final_grad, l2norm=False):
    q, k, v, g, beta, init = inputs
    B, T, H, K = q.shape
    V = v.shape[-1]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen).to(device=q.device, dtype=dtype)
    dfinal = torch.randn(B, H, K, V, generator=gen).to(q.device) if final_grad else None
    o, final, grads = _forward_and_grads(
        chunk_gated_delta_rule, *inputs, do, dfinal, l2norm, backend=backend
    )
    up = lambda t: None if t is None else t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        gated_delta_rule_ref, *(up(t) for t in inputs), up(do), up(dfinal), l2norm
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


# (B, T, H, K, V, initial_state, final-state gradient, l2norm): lengths of one step, within a
# chunk, a whole chunk (32 on Triton) and several ragged chunks; K, V not powers of two.
CASES = [
    (2, 1, 2, 16, 16, True, True, False),
    (1, 20, 1, 20, 36, False, True, True),
    (2, 32, 1, 16, 20, True, False, False),
    (1, 70, 2, 20, 16, True, True, False),
    (1, 45, 1, 64, 64, False, False, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}" for c in CASES]


@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(monkeypatch, B, T, H, K, V, init, final_grad, l2norm):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 16)  # several chunks at these lengths
    inputs = _inputs(B, T, H, K, V, torch.float32, "cpu", init, l2norm, seed=T)
    _check_against_reference(inputs, torch.float32, "torch", final_grad, l2norm)


def test_torch_path_fp16_matches_reference():
    inputs = _inputs(2, 100, 2, 20, 36, torch.float16, "cpu", True, seed=3)
    _check_against_reference(inputs, torch.float16, "torch", True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_matches_reference(device, dtype, B, T, H, K, V, init, final_grad, l2norm):
    dt = DTYPES[dtype]
    inputs = _inputs(B, T, H, K, V, dt, device, init, l2norm, seed=T + K)
    _check_against_reference(inputs, dt, "triton", final_grad, l2norm)


def test_triton_wide_head_fp16(device):
    """K = 100 pads to 128 in the state kernels and splits the gradient kernel over four K
    blocks of 32 (the last one reaching past K): dg and dbeta sum partials over them."""
    inputs = _inputs(1, 40, 1, 100, 36, torch.float16, device, True, seed=9)
    _check_against_reference(inputs, torch.float16, "triton", True)


@pytest.mark.usefixtures("nan_fresh_buffers", "bounds_checked_interpreter")
def test_triton_reads_only_what_it_wrote(device):
    inputs = _inputs(2, 37, 2, 20, 36, torch.float32, device, True, seed=21)
    _check_against_reference(inputs, torch.float32, "triton", True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad,l2norm", CASES, ids=CASE_IDS)
def test_triton_bf16_matches_reference(device, B, T, H, K, V, init, final_grad, l2norm):
    inputs = _inputs(B, T, H, K, V, torch.bfloat16, device, init, l2norm, seed=T)
    _check_against_reference(inputs, torch.bfloat16, "triton", final_grad, l2norm)


@pytest.mark.gpu
def test_triton_bf16_large_heads(device):
    inputs = _inputs(2, 1000, 4, 128, 128, torch.bfloat16, device, True, seed=11)
    _check_against_reference(inputs, torch.bfloat16, "triton", True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strong_decay_and_long_sequence_stay_finite_and_exact(device, backend):
    """Decays down to exp(-60) a step (a chunk's cumulative G near -2000) and beta at both ends
    of [0, 2]: no inf/NaN (no exp of a positive difference), still exact."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 100, 2, 20, 16, torch.float32, device, True, seed=5)
    gen = torch.Generator().manual_seed(5)
    g = -60 * torch.rand(g.shape, generator=gen).to(device)
    beta = torch.where(torch.rand(beta.shape, generator=gen) < 0.5, 2.0, 0.0).to(device)
    _check_against_reference((q, k, v, g, beta, s), torch.float32, backend, True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_huge_decays_beside_small_ones_stay_exact(device, backend):
    """A few steps that wipe the memory (g = -1e4, as -exp(A_log) softplus(.) gives with large
    A) among slow decays: the in-chunk decays of the slow steps must not be formed as the
    difference of cumulative sums near -1e4 (float32 keeps ~1e-3 of them there)."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 70, 2, 16, 16, torch.float32, device, True, seed=8)
    gen = torch.Generator().manual_seed(8)
    wipe = torch.rand(g.shape, generator=gen) < 0.1
    g = torch.where(wipe, -1e4, -0.01 * torch.rand(g.shape, generator=gen)).to(device)
    _check_against_reference((q, k, v, g, beta, s), torch.float32, backend, True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_decay_is_the_delta_rule(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 40, 2, 16, 20, torch.float32, device, True, seed=2)
    ours = chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), beta, 0.5, s, True, backend=backend)
    theirs = chunk_delta_rule(q, k, v, beta, 0.5, s, True, backend=backend)
    for a, b, name in zip(ours, theirs, ("o", "final_state"), strict=True):
        assert_close(a, b, torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decay_without_writes_scales_the_state(device, backend):
    """beta = 0: only the decays act, S_T = exp(sum g) S_0, and every read sees the decayed
    initial memory."""
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(1, 37, 2, 20, 16, torch.float32, device, True, seed=4)
    o, final = chunk_gated_delta_rule(q, k, v, g, torch.zeros_like(beta), 1.0, s, True,
                                      backend=backend)  # fmt: skip
    decay = g.cumsum(1).exp()  # (B, T, H)
    assert_close(final, decay[:, -1, :, None, None] * s, torch.float32, "final_state")
    expected = decay[..., None] * torch.einsum("bthk,bhkv->bthv", q, s)
    assert_close(o, expected, torch.float32, "o")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_splitting_the_sequence_and_carrying_the_state_equals_one_call(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, g, beta, s = _inputs(2, 70, 1, 16, 16, torch.float32, device, True, seed=6)
    o_whole, final_whole = chunk_gated_delta_rule(q, k, v, g, beta, None, s, True,
                                                  backend=backend)  # fmt: skip
    pieces, state = [], s
    for start, stop in ((0, 1), (1, 37), (37, 70)):
        piece = [t[:, start:stop] for t in (q, k, v, g, beta)]
        o, state = chunk_gated_delta_rule(*piece, None, state, True, backend=backend)
        pieces.append(o)
    assert_close(torch.cat(pieces, dim=1), o_whole, torch.float32, "o")
    assert_close(state, final_whole, torch.float32, "final_state")


def test_triton_backward_is_deterministic(device):
    # K = 64 in float32 splits the gradient kernel over K blocks; V = 64 splits V.
    q, k, v, g, beta, s = _inputs(1, 70, 2, 64, 64, torch.float32, device, True, seed=10)
    do = torch.randn(1, 70, 2, 64).to(device)
    dfinal = torch.randn(1, 2, 64, 64).to(device)
    runs = [
        _forward_and_grads(
            chunk_gated_delta_rule, q, k, v, g, beta, s, do, dfinal, backend="triton"
        )[2]  # fmt: skip
        for _ in range(2)
    ]
    for name, a, b in zip(GRAD_NAMES, *runs, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("with_init", [True, False])
def test_gradcheck_float64_torch_path(monkeypatch, with_init):
    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 3)  # several chunks, a ragged last one
    gen = torch.Generator().manual_seed(7)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, 7, 2, 3, 2
    q, v = make(B, T, H, K), make(B, T, H, V)
    k = F.normalize(make(B, T, H, K), dim=-1)
    g = F.logsigmoid(make(B, T, H))
    beta = 2 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    init = make(B, H, K, V) if with_init else None
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta) + ((init,) if with_init else ())]

    def fn(q, k, v, g, beta, init=None):
        return chunk_gated_delta_rule(q, k, v, g, beta, 0.7, init, True, True, backend="torch")

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vmap_folds_models_into_heads(backend):
    """Stacked models (mecheval_kernels.stacking): vmap over a model axis equals a loop over models,
    outputs and every gradient."""
    M, B, T, H, K, V = 3, 2, 9, 2, 4, 4
    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(M, B, T, H, K, generator=gen), torch.randn(M, B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(M, B, T, H, K, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(M, B, T, H, generator=gen))
    beta, state = torch.rand(M, B, T, H, generator=gen), torch.randn(M, B, H, K, V, generator=gen)

    def gated(q, k, v, g, beta, state):
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, None, state, True, backend=backend)
        return o.sum() + final

    ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    out = vmap(gated)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v, g, beta, state)]
    ref = torch.stack([gated(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(ins, ref_ins, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_compiles_fullgraph_with_backward():
    class GatedMixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.qkv = torch.nn.Linear(d, 3 * heads * head_dim)
            self.ab = torch.nn.Linear(d, 2 * heads)

        def forward(self, x):  # x (B, T, d)
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)
            a, b = self.ab(x).chunk(2, dim=-1)
            o, _ = chunk_gated_delta_rule(
                q, k, v, -F.softplus(a), b.sigmoid(), use_qk_l2norm_in_kernel=True,
                backend="torch",
            )  # fmt: skip
            return o.flatten(2)

    model, x = GatedMixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = [model.qkv.weight.grad.clone(), model.ab.weight.grad.clone()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(model.qkv.weight.grad, expected[0])
    torch.testing.assert_close(model.ab.weight.grad, expected[1])


def _valid_args() -> dict:
    return dict(
        q=torch.randn(2, 5, 3, 4),
        k=torch.randn(2, 5, 3, 4),
        v=torch.randn(2, 5, 3, 6),
        g=-torch.rand(2, 5, 3),
        beta=torch.rand(2, 5, 3),
        scale=None,
        initial_state=None,
    )


# (arguments as keyword overrides of a valid call, expected error type, words the message names)
BAD_INPUTS = [
    (dict(q=torch.randn(2, 5, 4)), ValueError, ["q", "(B, T, H, K)"]),
    (dict(q="not a tensor"), TypeError, ["q", "Tensor"]),
    (dict(q=torch.randn(2, 0, 3, 4)), ValueError, ["q", "T >= 1"]),
    (dict(k=torch.randn(2, 5, 3, 5)), ValueError, ["k", "(B, T, H, K)", "K: 5 != 4"]),
    (dict(k=torch.randn(2, 5, 3, 4).half()), TypeError, ["k", "float16", "float32"]),
    (dict(v=torch.randn(2, 5, 2, 6)), ValueError, ["v", "HV = 2", "multiple", "H = 3"]),
    (dict(g=torch.rand(2, 5, 3, 1)), ValueError, ["g", "(B, T, HV)"]),
    (dict(g=torch.rand(2, 4, 3)), ValueError, ["g", "T: 4 != 5"]),
    (dict(g=torch.rand(2, 5, 3).long()), TypeError, ["g", "int64"]),
    (dict(g=torch.full((2, 5, 3), float("nan"))), ValueError, ["g", "finite"]),
    (dict(g=torch.full((2, 5, 3), float("-inf"))), ValueError, ["g", "finite"]),
    (dict(g=torch.rand(2, 5, 3) + 0.01), ValueError, ["g", "<= 0", "positive"]),
    (dict(g=torch.zeros(2, 5, 3)), None, []),  # no decay: the delta rule
    (dict(g=-torch.rand(2, 5, 3, dtype=torch.float64)), None, []),
    (dict(beta=torch.rand(3, 5, 3)), ValueError, ["beta", "B: 3 != 2"]),
    (dict(initial_state=torch.randn(2, 3, 4, 5)), ValueError, ["initial_state", "V: 5 != 6"]),
    (dict(v=torch.randn(2, 5, 3, 257)), ValueError, ["V", "between 1 and 256", "257"]),
    (dict(scale="0.5"), TypeError, ["scale", "str"]),
    (dict(scale=float("inf")), ValueError, ["scale", "finite"]),
    (dict(g=-torch.rand(2, 5, 3, device="meta")), ValueError, ["one device", "g on meta"]),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        o, _ = chunk_gated_delta_rule(**args, backend="torch")
        assert torch.isfinite(o).all()
        return
    with pytest.raises(error) as info:
        chunk_gated_delta_rule(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_triton_refuses_float64_by_name(device):
    args = {
        n: t.to(device, torch.float64) if isinstance(t, torch.Tensor) else t
        for n, t in _valid_args().items()
    }
    with pytest.raises(TypeError, match="q has dtype float64"):
        chunk_gated_delta_rule(**args, backend="triton")


def test_second_derivatives_gradgradcheck_float64():
    """Second derivatives (create_graph) as fla's naive gated delta rule gives them, g's
    included."""
    gen = torch.Generator().manual_seed(5)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    B, T, H, K, V = 1, 4, 1, 3, 2
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(make(B, T, H))
    leaves = [make(B, T, H, K), make(B, T, H, K), make(B, T, H, V), g, beta, make(B, H, K, V)]
    leaves = [t.requires_grad_() for t in leaves]

    def fn(q, k, v, g, beta, state):
        return chunk_gated_delta_rule(q, k, v, g, beta, 0.7, state, True, True, backend="torch")

    assert torch.autograd.gradgradcheck(fn, leaves)
