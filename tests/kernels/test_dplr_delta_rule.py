"""chunk_dplr_delta_rule and chunk_rwkv7 against their reference (the per-step recurrence) and
against flash-linear-attention 0.6.0's own naive reference (`dplr_recurrence`), in float32 and
float64: forward, final state, every gradient; the scan at positions; determinism, vmap,
torch.compile, bad input, the drop-in signatures.

The Triton kernels run under Triton's interpreter on CPU (tests/conftest.py); shapes are small.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import mecheval_kernels
from mecheval_kernels import at_positions, chunk_dplr_delta_rule, chunk_rwkv7
from mecheval_kernels.dplr import dplr_delta_rule_ref, launch, torch_path
from tests.kernels.conftest import _NaNFilledEmpty
from tests.kernels.tolerances import assert_close, relative_error

GRAD_NAMES = ("dq", "dk", "dv", "da", "db", "dgk", "dinitial_state")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _inputs(B, T, H, K, V, dtype, device="cpu", init=False, seed=0, decay=0.6065):
    """RWKV-7's operands: a = -kappa_hat, b = kappa_hat * a_gate (kappa_hat unit, a_gate in
    (0, 1)), gk = -decay * sigmoid(.) in (-decay, 0), as fla's layer forms them; gk and the
    state stay float32."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(B, T, H, K), 0.5 * rand(B, T, H, K), rand(B, T, H, V)
    kappa = F.normalize(rand(B, T, H, K), dim=-1)
    gate = torch.rand(B, T, H, K, generator=gen)
    gk = -decay * torch.sigmoid(rand(B, T, H, K))
    s = rand(B, H, K, V) if init else None
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    f32 = torch.float64 if dtype == torch.float64 else torch.float32
    return (
        *(to(t) for t in (q, k, v, -kappa, kappa * gate)),
        gk.to(device, f32),
        None if s is None else s.to(device, f32),
    )


def _forward_and_grads(fn, inputs, do, dfinal, **kw):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    o, final = fn(*leaves[:6], initial_state=leaves[6], output_final_state=dfinal is not None, **kw)
    outs, cots = [o], [do]
    if dfinal is not None:
        outs.append(final)
        cots.append(dfinal)
    torch.autograd.backward(outs, cots)
    return o, final, [None if t is None else t.grad for t in leaves]


def _check(inputs, dtype, backend, final_grad, scale=None):
    B, T, H, K = inputs[0].shape
    V = inputs[2].shape[-1]
    gen = torch.Generator().manual_seed(1)
    device = inputs[0].device
    do = torch.randn(B, T, H, V, generator=gen).to(device=device, dtype=dtype)
    dfinal = torch.randn(B, H, K, V, generator=gen).to(device) if final_grad else None
    o, final, grads = _forward_and_grads(
        chunk_dplr_delta_rule, inputs, do, dfinal, scale=scale, backend=backend
    )
    up = lambda t: None if t is None else t.float()  # noqa: E731
    o_ref, final_ref, grads_ref = _forward_and_grads(
        dplr_delta_rule_ref, [up(t) for t in inputs], up(do), up(dfinal), scale=scale
    )
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert_close(o, o_ref, dtype, "o")
    if final_grad:
        assert final.dtype == torch.float32
        assert_close(final, final_ref, dtype, "final_state")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            assert_close(grad, grad_ref, dtype, name)


# (B, T, H, K, V, initial_state, final-state gradient): one step, within a checkpoint chunk
# (16 steps), ragged chunks; K, V not powers of two.
CASES = [
    (2, 1, 2, 16, 16, True, True),
    (1, 20, 1, 20, 36, False, True),
    (2, 16, 1, 16, 20, True, False),
    (1, 37, 2, 20, 16, True, True),
    (1, 45, 1, 64, 64, False, False),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}" for c in CASES]


@pytest.mark.parametrize("B,T,H,K,V,init,final_grad", CASES, ids=CASE_IDS)
def test_torch_path_matches_reference(monkeypatch, B, T, H, K, V, init, final_grad):
    monkeypatch.setattr(torch_path, "CHUNK_SIZES", (16, 8))  # several chunks at these lengths
    inputs = _inputs(B, T, H, K, V, torch.float32, init=init, seed=T)
    _check(inputs, torch.float32, "torch", final_grad)


def test_torch_path_exact_decays_match_reference(monkeypatch):
    """Chunks whose total decay passes SAFE_DECAY run the exact form (every decay its own
    segment sum): decays down to exp(-30) a step, and -1e4 steps (a wiped memory) among slow
    ones."""
    monkeypatch.setattr(torch_path, "CHUNK_SIZES", (16, 8))
    q, k, v, a, b, gk, s = _inputs(1, 40, 2, 12, 10, torch.float32, init=True, seed=5)
    gen = torch.Generator().manual_seed(5)
    strong = -30 * torch.rand(gk.shape, generator=gen)
    _check((q, k, v, a, b, strong, s), torch.float32, "torch", True)
    wipe = torch.rand(gk.shape, generator=gen) < 0.1
    mixed = torch.where(wipe, -1e4, -0.01 * torch.rand(gk.shape, generator=gen))
    _check((q, k, v, a, b, mixed, s), torch.float32, "torch", True)


def test_torch_path_fp16_matches_reference():
    inputs = _inputs(2, 60, 2, 20, 36, torch.float16, init=True, seed=3)
    _check(inputs, torch.float16, "torch", True, scale=1.0)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("B,T,H,K,V,init,final_grad", CASES[:4], ids=CASE_IDS[:4])
def test_triton_matches_reference(device, dtype, B, T, H, K, V, init, final_grad):
    dt = DTYPES[dtype]
    inputs = _inputs(B, T, H, K, V, dt, device, init, seed=T + K)
    _check(inputs, dt, "triton", final_grad)


@pytest.fixture
def nan_fresh_dplr_buffers(monkeypatch):
    """Every buffer the DPLR host code allocates starts as NaN (see tests/kernels/conftest.py)."""
    monkeypatch.setattr(launch, "torch", _NaNFilledEmpty())


@pytest.mark.usefixtures("nan_fresh_dplr_buffers", "bounds_checked_interpreter")
def test_triton_reads_only_what_it_wrote(device):
    """K = 20 pads to 32, V = 36 over three V blocks, 37 steps: three checkpoint chunks, the
    last ragged."""
    inputs = _inputs(2, 37, 2, 20, 36, torch.float32, device, True, seed=21)
    _check(inputs, torch.float32, "triton", True)


@pytest.mark.gpu
def test_triton_bf16_large_heads(device):
    inputs = _inputs(2, 1000, 4, 64, 64, torch.bfloat16, device, True, seed=11)
    _check(inputs, torch.bfloat16, "triton", True)


def _fla_naive():
    return pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive").dplr_recurrence


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("triton", torch.float32),
                                           ("torch", torch.float64)])  # fmt: skip
def test_matches_fla_naive_reference(monkeypatch, device, backend, dtype):
    """fla 0.6.0's `dplr_recurrence` (head-first, scale K ** -0.5) on the same inputs: outputs,
    final state and every gradient (through its autograd). It casts q, k, v, b, gk with
    .float(); for the float64 check that cast keeps float64 (patched for the call), so it
    computes in float64."""
    naive = _fla_naive()
    device = device if backend == "triton" else torch.device("cpu")
    inputs = _inputs(2, 37, 2, 16, 12, dtype, device, True, seed=4)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(2, 37, 2, 12, generator=gen).to(device, dtype)
    dfinal = torch.randn(2, 2, 16, 12, generator=gen).to(device, dtype)
    o, final, grads = _forward_and_grads(chunk_dplr_delta_rule, inputs, do, dfinal,
                                         backend=backend)  # fmt: skip
    if dtype == torch.float64:
        real = torch.Tensor.float
        monkeypatch.setattr(
            torch.Tensor, "float", lambda t: t if t.dtype == torch.float64 else real(t)
        )
    first = lambda t: t.transpose(1, 2)  # noqa: E731

    def fla(q, k, v, a, b, gk, initial_state, output_final_state):
        o, s = naive(*(first(t) for t in (q, k, v, a, b, gk)), initial_state, output_final_state)
        return first(o), s

    o_fla, final_fla, grads_fla = _forward_and_grads(fla, inputs, do, dfinal)
    assert o_fla.dtype == dtype
    assert_close(o, o_fla, dtype, "o")
    assert_close(final, final_fla, dtype, "final_state")
    for name, grad, grad_fla in zip(GRAD_NAMES, grads, grads_fla, strict=True):
        assert_close(grad, grad_fla, dtype, name)


def test_rwkv7_is_the_dplr_delta_rule_in_rwkv7s_names():
    q, k, v, a, b, gk, s = _inputs(2, 21, 2, 8, 8, torch.float32, init=True, seed=6)
    o, final = chunk_rwkv7(q, gk, k, v, a, b, initial_state=s, output_final_state=True)
    o2, final2 = chunk_dplr_delta_rule(q, k, v, a, b, gk, 1.0, s, True)
    assert torch.equal(o, o2) and torch.equal(final, final2)
    with pytest.raises(ValueError, match="chunk_rwkv7: w .*must be <= 0"):
        chunk_rwkv7(q, -gk, k, v, a, b)
    with pytest.raises(TypeError, match="chunk_rwkv7: r must be a torch.Tensor"):
        chunk_rwkv7("r", gk, k, v, a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_splitting_the_sequence_and_carrying_the_state_equals_one_call(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    q, k, v, a, b, gk, s = _inputs(2, 40, 1, 16, 16, torch.float32, device, True, seed=7)
    o_whole, final_whole = chunk_dplr_delta_rule(q, k, v, a, b, gk, None, s, True,
                                                 backend=backend)  # fmt: skip
    pieces, state = [], s
    for start, stop in ((0, 1), (1, 17), (17, 40)):
        piece = [t[:, start:stop] for t in (q, k, v, a, b, gk)]
        o, state = chunk_dplr_delta_rule(*piece, None, state, True, backend=backend)
        pieces.append(o)
    assert_close(torch.cat(pieces, dim=1), o_whole, torch.float32, "o")
    assert_close(state, final_whole, torch.float32, "final_state")


def test_triton_backward_is_deterministic(device):
    inputs = _inputs(1, 40, 2, 32, 64, torch.float32, device, True, seed=10)
    do = torch.randn(1, 40, 2, 64).to(device)
    dfinal = torch.randn(1, 2, 32, 64).to(device)
    runs = [
        _forward_and_grads(chunk_dplr_delta_rule, inputs, do, dfinal, backend="triton")[2]
        for _ in range(2)
    ]
    for name, x, y in zip(GRAD_NAMES, *runs, strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("chunks", [(3,), (64,)])  # factored over ragged chunks; one chunk
def test_gradcheck_float64_torch_path(monkeypatch, chunks):
    monkeypatch.setattr(torch_path, "CHUNK_SIZES", chunks)
    q, k, v, a, b, gk, s = _inputs(1, 7, 2, 3, 2, torch.float64, init=True, seed=7)
    leaves = [t.requires_grad_() for t in (q, k, v, a, b, gk, s)]

    def fn(q, k, v, a, b, gk, s):
        return chunk_dplr_delta_rule(q, k, v, a, b, gk, 0.7, s, True, backend="torch")

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vmap_folds_models_into_heads(backend):
    M = 3
    stacked = [
        torch.stack(ts) for ts in zip(*(_inputs(2, 9, 2, 4, 4, torch.float32, init=True, seed=m)
                                        for m in range(M)), strict=True)
    ]  # fmt: skip

    def op(q, k, v, a, b, gk, s):
        o, final = chunk_dplr_delta_rule(q, k, v, a, b, gk, None, s, True, backend=backend)
        return o.sum() + final

    ins = [t.clone().requires_grad_() for t in stacked]
    out = vmap(op)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in stacked]
    ref = torch.stack([op(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    # The folded call may pick other chunks than each model's own (they depend on the decays):
    # float32 rounding apart, they agree.
    assert_close(out, ref, torch.float32, "out")
    for name, ours, theirs in zip(GRAD_NAMES, ins, ref_ins, strict=True):
        assert_close(ours.grad, theirs.grad, torch.float32, name)


def test_compiles_fullgraph_with_backward():
    class Mixer(torch.nn.Module):
        def __init__(self, d=16, heads=2, head_dim=8):
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.proj = torch.nn.Linear(d, 6 * heads * head_dim)

        def forward(self, x):
            B, T, _ = x.shape
            r, w, k, v, kk, gate = self.proj(x).view(B, T, 6, self.heads, self.head_dim).unbind(2)
            kk = F.normalize(kk, dim=-1)
            o, _ = chunk_rwkv7(r, -0.6 * w.sigmoid(), k, v, -kk, kk * gate.sigmoid(),
                               backend="torch")  # fmt: skip
            return o.flatten(2)

    torch.manual_seed(0)
    model, x = Mixer(), torch.randn(2, 9, 16)
    eager = model(x)
    eager.square().sum().backward()
    expected = model.proj.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.square().sum().backward()
    # Inductor fuses the elementwise parts around the op: float32 rounding apart, the same.
    assert_close(compiled, eager, torch.float32, "o")
    assert_close(model.proj.weight.grad, expected, torch.float32, "d proj.weight")


def _valid_args() -> dict:
    q, k, v, a, b, gk, _ = _inputs(2, 5, 3, 4, 6, torch.float32)
    return dict(q=q, k=k, v=v, a=a, b=b, gk=gk, scale=None, initial_state=None)


BAD_INPUTS = [
    (dict(q=torch.randn(2, 5, 4)), ValueError, ["q", "(B, T, H, K)"]),
    (dict(q="not a tensor"), TypeError, ["q", "Tensor"]),
    (dict(q=torch.randn(2, 0, 3, 4)), ValueError, ["q", "T >= 1"]),
    (dict(a=torch.randn(2, 5, 3, 5)), ValueError, ["a", "K: 5 != 4"]),
    (dict(b=torch.randn(2, 5, 3, 4).half()), TypeError, ["b", "float16", "float32"]),
    (dict(v=torch.randn(2, 5, 2, 6)), ValueError, ["v", "H: 2 != 3"]),
    (dict(gk=-torch.rand(2, 5, 3)), ValueError, ["gk", "(B, T, H, K)"]),
    (dict(gk=torch.full((2, 5, 3, 4), float("nan"))), ValueError, ["gk", "finite"]),
    (dict(gk=torch.rand(2, 5, 3, 4) + 0.01), ValueError, ["gk", "<= 0", "positive"]),
    (dict(gk=torch.zeros(2, 5, 3, 4)), None, []),
    (dict(initial_state=torch.randn(2, 3, 4, 5)), ValueError, ["initial_state", "V: 5 != 6"]),
    (dict(scale="0.5"), TypeError, ["scale", "str"]),
    (dict(lower_bound=-0.1), ValueError, ["gk", "lower_bound = -0.1"]),
    (dict(lower_bound=0.5), ValueError, ["lower_bound", "negative"]),
    (dict(lower_bound=-1.0), None, []),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens=", "not supported"]),
    (dict(cu_seqlens_cpu=torch.tensor([0, 5])), ValueError, ["cu_seqlens_cpu=", "not supported"]),
    (dict(cp_context=object()), ValueError, ["cp_context=", "not supported"]),
    (dict(head_first=True), TypeError, ["head_first", "removed"]),
    (dict(chunk_size=0), ValueError, ["chunk_size", "positive"]),
    (dict(safe_gate=True, chunk_size=64, disable_recompute=True), None, []),  # hints
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid_args()
    args.update(overrides)
    if error is None:
        o, _ = chunk_dplr_delta_rule(**args, backend="torch")
        assert torch.isfinite(o).all()
        return
    with pytest.raises(error) as info:
        chunk_dplr_delta_rule(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# fla 0.6.0's parameter lists (ops/generalized_delta_rule/dplr/chunk.py, ops/rwkv7/chunk.py),
# for when fla is not importable.
FLA_PARAMETERS = {
    "chunk_dplr_delta_rule": (
        "q", "k", "v", "a", "b", "gk", "scale", "initial_state", "output_final_state",
        "cu_seqlens", "cu_seqlens_cpu", "safe_gate", "chunk_size", "disable_recompute",
        "cp_context", "lower_bound", "kwargs",
    ),
    "chunk_rwkv7": (
        "r", "w", "k", "v", "a", "b", "scale", "initial_state", "output_final_state",
        "cu_seqlens", "cu_seqlens_cpu", "safe_gate", "chunk_size", "disable_recompute",
        "cp_context", "lower_bound",
    ),
}  # fmt: skip


def _peer(name: str):
    try:
        if name == "chunk_rwkv7":
            from fla.ops.rwkv7 import chunk_rwkv7 as peer
        else:
            from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule as peer
    except ImportError:
        return None
    return peer


@pytest.mark.parametrize("name", list(FLA_PARAMETERS))
def test_parameters_are_fla_060s(name):
    """Exactly the peer's parameters, in its order, with its defaults, plus `backend`
    (keyword-only)."""
    ours = inspect.signature(getattr(mecheval_kernels, name)).parameters
    peer = _peer(name)
    expected = FLA_PARAMETERS[name] if peer is None else tuple(inspect.signature(peer).parameters)
    assert expected == FLA_PARAMETERS[name]
    assert tuple(n for n in ours if n != "backend") == expected
    assert ours["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    if peer is not None:
        for n, p in inspect.signature(peer).parameters.items():
            assert ours[n].default == p.default and ours[n].kind == p.kind, n


@pytest.mark.parametrize("scan", [chunk_dplr_delta_rule, chunk_rwkv7])
def test_at_positions_matches_the_reference(scan):
    """States after positions, the output at one position per row, a patched state (against the
    reference resumed from the patch on each row's suffix), with and without gradients."""
    q, k, v, a, b, gk, s = _inputs(2, 23, 2, 6, 5, torch.float64, init=True, seed=12)
    scale = 1.0 if scan is chunk_rwkv7 else None
    args = (q, gk, k, v, a, b) if scan is chunk_rwkv7 else (q, k, v, a, b, gk)
    states_at = torch.tensor([[0, 7, 22], [16, 3, 3]])
    o_ref, final_ref, states_ref = dplr_delta_rule_ref(q, k, v, a, b, gk, scale, s, True, states_at)
    got = at_positions(scan, *args, initial_state=s, states_at=states_at, return_final_state=True)
    assert relative_error(got.out, o_ref) < 1e-12
    assert relative_error(got.states, states_ref) < 1e-12
    assert relative_error(got.final_state, final_ref) < 1e-12
    out_at = torch.tensor([5, 20])
    one = at_positions(scan, *args, initial_state=s, out_at=out_at)
    assert relative_error(one.out, o_ref[torch.arange(2), out_at][:, None]) < 1e-12
    positions = torch.tensor([4, 17])
    values = torch.randn(2, 2, 6, 5, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (*args, values)]
    patched = at_positions(
        scan, *leaves[:6], initial_state=s, state_patch=(positions, leaves[6]), out_at=out_at,
        states_at=states_at, return_final_state=True,
    )  # fmt: skip
    fields = (q, k, v, a, b, gk)
    for row in range(2):
        p = int(positions[row])
        o_head, _, st_head = dplr_delta_rule_ref(
            *(t[row : row + 1, : p + 1] for t in fields), scale, s[row : row + 1], False,
            states_at[row : row + 1].clamp_max(p),
        )  # fmt: skip
        o_tail, final_tail, st_tail = dplr_delta_rule_ref(
            *(t[row : row + 1, p + 1 :] for t in fields), scale, values[row : row + 1], True,
            (states_at[row : row + 1] - p - 1).clamp_min(0),
        )  # fmt: skip
        o_row = torch.cat([o_head, o_tail], dim=1)[0, out_at[row]]
        torch.testing.assert_close(patched.out[row, 0], o_row)
        torch.testing.assert_close(patched.final_state[row], final_tail[0])
        for i, t in enumerate(states_at[row]):
            expected = st_head[0, i] if t <= p else st_tail[0, i]
            expected = values[row] if t == p else expected
            torch.testing.assert_close(patched.states[row, i], expected)
    patched.out.sum().backward()
    assert all(t.grad is not None for t in leaves)
