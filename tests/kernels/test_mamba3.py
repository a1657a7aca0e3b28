"""mamba3_siso_combined and mamba3_mimo against their reference (the per-step recurrence written
from Mamba-3's equations, mecheval_kernels.mamba3.reference): forward, final states, every
gradient, on the PyTorch path and the Triton core (under the interpreter on CPU); the scan at
positions; determinism, vmap, torch.compile, bad input, the drop-in signatures; and, where a
mamba-ssm checkout is given (MAMBA_SSM_SOURCE), against mamba-ssm's own references in its tests
(`mamba3_siso_step_ref`, `mamba3_siso_fwd_ref`, `mamba3_MIMO_chunk_ref`; mamba-ssm does not
install here, its CUDA build needs a GPU).

In float32 the gradients of the angles (Angles and the input angle state) sum per-position
terms that cancel over the sequence, so float32 rounding of each term shows in their sum at
~1e-5 relative: they are checked in float64 (exactly), the others in float32 too.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap

import mecheval_kernels
from mecheval_kernels import at_positions, mamba3_mimo, mamba3_siso_combined
from mecheval_kernels.mamba3 import launch, mamba3_ref
from tests.kernels.conftest import _NaNFilledEmpty
from tests.kernels.tolerances import assert_close, relative_error

SISO_NAMES = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z",
              "theta", "h", "k", "v")  # fmt: skip
MIMO_NAMES = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
              "MIMO_Out", "Angles", "D", "Z")  # fmt: skip
ANGLES = {"Angles", "theta"}


def _siso(B, L, G, H, N, P, A, dtype=torch.float32, states=True, seed=0, decay=2.0):
    """SISO inputs as mamba-ssm's layer forms them: dt = softplus(.), A dt <= 0."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    Q, K, V, Z = r(B, L, G, N), r(B, L, G, N), r(B, L, H, P), r(B, L, H, P)
    DT = F.softplus(r(B, H, L) - 1)
    ADT = -DT * decay * torch.rand(B, H, L, generator=gen).to(dtype)
    args = [Q, K, V, ADT, DT, r(B, H, L), r(H, N), r(H, N), r(B, L, H, A), r(H), Z]
    if states:
        theta = 6 * torch.rand(B, H, A, generator=gen).to(dtype)
        args += [theta, r(B, H, P, N), r(B, H, N), r(B, H, P)]
    return args


def _mimo(B, L, R, H, N, P, divisor=4, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    DT = F.softplus(r(B, H, L) - 1)
    ADT = -DT * 2 * torch.rand(B, H, L, generator=gen).to(dtype)
    return [r(B, L, R, 1, N), r(B, L, R, 1, N), r(B, L, H, P), ADT, DT, r(B, H, L), r(H, R, N),
            r(H, R, N), r(H, R, P), r(H, R, P), r(H, R, P), r(B, L, H, N // divisor), r(H),
            r(B, L, H, P)]  # fmt: skip


def _ref_siso(args):
    Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z, *st = args
    states = None if not st else (st[0], st[1], st[2][:, None], st[3][:, None])
    out, (theta, h, k, v) = mamba3_ref(Q[:, :, None], K[:, :, None], V, ADT, DT, Trap,
                                       Qb[:, None], Kb[:, None], Ang, D, Z, states)  # fmt: skip
    return out[:, :, 0], theta, h, k[:, 0], v[:, 0]


def _ours_siso(args, backend):
    (*main,) = args[:11]
    states = tuple(args[11:]) or None
    return mamba3_siso_combined(*main, states, return_final_states=True, backend=backend)


def _grads(fn, args, cotangents):
    leaves = [t.detach().clone().requires_grad_() for t in args]
    outs = fn(leaves)
    torch.autograd.backward(
        list(outs), [c.to(o.dtype) for o, c in zip(outs, cotangents, strict=True)]
    )
    return outs, [t.grad for t in leaves]


def _check_siso(args, backend, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    shapes = [t.shape for t in _ref_siso(args)]
    cots = [torch.randn(s, generator=gen) for s in shapes]
    cots[1] = torch.zeros(shapes[1])  # the final angle is a remainder: no gradient through it
    ours, g = _grads(lambda x: _ours_siso(x, backend), args, cots)
    ref_args = [t.double() for t in args]
    ref, g_ref = _grads(_ref_siso, ref_args, [c.double() for c in cots])
    for name, o, e in zip(("out", "theta", "h", "k", "v"), ours, ref, strict=True):
        assert_close(o, e, dtype, name)
    for name, x, e in zip(SISO_NAMES[: len(g)], g, g_ref, strict=True):
        if dtype == torch.float64 or name not in ANGLES:
            assert_close(x, e, dtype, f"d{name}")


# (B, L, G, H, N, P, A, input states): one step, a checkpoint chunk (16) and ragged ones, grouped
# heads, N and P not powers of two.
SISO_CASES = [
    (2, 1, 1, 2, 8, 8, 2, True),
    (1, 20, 1, 2, 12, 10, 3, False),
    (2, 37, 2, 4, 16, 8, 8, True),
]
SISO_IDS = [f"B{c[0]}-L{c[1]}-G{c[2]}-H{c[3]}-N{c[4]}-P{c[5]}" for c in SISO_CASES]


@pytest.mark.parametrize("B,L,G,H,N,P,A,states", SISO_CASES, ids=SISO_IDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_siso_matches_reference(device, backend, B, L, G, H, N, P, A, states):
    args = _siso(B, L, G, H, N, P, A, states=states, seed=L)
    device = device if backend == "triton" else torch.device("cpu")
    _check_siso([t.to(device) for t in args], backend)


def test_siso_float64_and_long_sequences_match_reference(monkeypatch):
    from mecheval_kernels.mamba3 import torch_path

    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 16)  # several chunks
    _check_siso(_siso(2, 50, 1, 2, 8, 6, 4, torch.float64, seed=3), "torch", torch.float64)


def _ref_mimo(args, divisor, fused=False, weight=None):
    Q, K, V, ADT, DT, Trap, Qb, Kb, mv, mz, mo, Ang, D, Z = args
    out, _ = mamba3_ref(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z, None, mv, mz, mo, "halves",
                        fused, weight)  # fmt: skip
    return (out,)


@pytest.mark.parametrize("divisor,fused", [(4, False), (2, True)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mimo_matches_reference(device, backend, divisor, fused):
    device = device if backend == "triton" else torch.device("cpu")
    args = [t.to(device) for t in _mimo(2, 21, 3, 2, 8, 6, divisor, seed=divisor)]
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 6, generator=gen).to(device) if fused else None
    cot = [torch.randn(2, 21, 2, 6, generator=gen).to(device)]

    def ours(x):
        return (mamba3_mimo(*x, 8, divisor, torch.float32, False, None, fused, weight,
                            backend=backend),)  # fmt: skip

    (o,), g = _grads(ours, args, cot)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    (e,), g_ref = _grads(lambda x: _ref_mimo(x, divisor, fused, d(weight)),
                         [t.double() for t in args], [c.double() for c in cot])  # fmt: skip
    assert_close(o, e, torch.float32, "out")
    for name, x, y in zip(MIMO_NAMES, g, g_ref, strict=True):
        if name not in ANGLES:
            assert_close(x, y, torch.float32, f"d{name}")


def test_mimo_without_output_projection_keeps_ranks():
    args = _mimo(1, 9, 2, 2, 8, 4)
    args[10] = None  # MIMO_Out
    out = mamba3_mimo(*args, 8, 4, torch.float64, backend="torch")
    expected = mamba3_ref(*args[:8], args[11], args[12], args[13], None, args[8], args[9],
                          None, "halves")[0]  # fmt: skip
    assert out.shape == (1, 9, 2, 2, 4) and out.dtype == torch.float64
    assert_close(out, expected, torch.float32, "out")


def test_mimo_resumes_from_its_returned_states():
    """Input_States (ours): a MIMO scan cut in two, the second part from the states the first
    returned, equals one scan."""
    args = _mimo(2, 20, 2, 2, 8, 4, seed=8)
    whole = mamba3_mimo(*args, 8, 4, torch.float32, backend="torch")
    first = [t[:, :9] for t in args[:3]] + [t[..., :9] for t in args[3:6]] + args[6:11]
    first += [args[11][:, :9], args[12], args[13][:, :9]]
    second = [t[:, 9:] for t in args[:3]] + [t[..., 9:] for t in args[3:6]] + args[6:11]
    second += [args[11][:, 9:], args[12], args[13][:, 9:]]
    out1, *states = mamba3_mimo(*first, 8, 4, torch.float32, True, backend="torch")
    out2 = mamba3_mimo(*second, 8, 4, torch.float32, Input_States=tuple(states), backend="torch")
    assert_close(torch.cat([out1, out2], dim=1), whole, torch.float32, "out")


def test_gradcheck_float64_torch_path(monkeypatch):
    from mecheval_kernels.mamba3 import torch_path

    monkeypatch.setattr(torch_path, "CHUNK_SIZE", 3)
    args = [t.requires_grad_() for t in _siso(1, 7, 1, 2, 4, 2, 2, torch.float64, seed=5)]

    def fn(*x):
        out, _, h, k, v = mamba3_siso_combined(*x[:11], tuple(x[11:]), return_final_states=True,
                                               backend="torch")  # fmt: skip
        return out, h, k, v

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.usefixtures("bounds_checked_interpreter")
def test_triton_reads_only_what_it_wrote(device, monkeypatch):
    monkeypatch.setattr(launch, "torch", _NaNFilledEmpty())
    args = [t.to(device) for t in _siso(2, 37, 1, 2, 20, 36, 4, seed=21)]
    _check_siso(args, "triton")


def test_triton_backward_is_deterministic(device):
    args = [t.to(device) for t in _siso(1, 40, 1, 2, 32, 64, 8, seed=10)]
    cots = [torch.randn(t.shape).to(device) for t in _ref_siso(args)]
    cots[1] = torch.zeros_like(cots[1])
    runs = [_grads(lambda x: _ours_siso(x, "triton"), args, cots)[1] for _ in range(2)]
    for name, x, y in zip(SISO_NAMES, *runs, strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strong_decay_and_long_sequence_stay_finite_and_exact(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    args = _siso(1, 100, 1, 2, 8, 8, 2, seed=6, decay=60.0)
    _check_siso([t.to(device) for t in args], backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_splitting_the_sequence_and_carrying_the_states_equals_one_call(device, backend):
    device = device if backend == "triton" else torch.device("cpu")
    args = [t.to(device) for t in _siso(2, 40, 1, 2, 8, 6, 2, seed=7)]
    whole = _ours_siso(args, backend)
    outs, states = [], tuple(args[11:])
    for start, stop in ((0, 1), (1, 17), (17, 40)):
        cut = [t[:, start:stop] for t in args[:3]] + [t[..., start:stop] for t in args[3:6]]
        cut += args[6:8] + [args[8][:, start:stop], args[9], args[10][:, start:stop]]
        out, *states = mamba3_siso_combined(*cut, tuple(states), return_final_states=True,
                                            backend=backend)  # fmt: skip
        outs.append(out)
    assert_close(torch.cat(outs, dim=1), whole[0], torch.float32, "out")
    for name, x, y in zip(("theta", "h", "k", "v"), states, whole[1:], strict=True):
        assert_close(x, y, torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vmap_folds_models_into_heads(backend):
    M = 3
    stacked = [torch.stack(ts) for ts in zip(*(_siso(2, 9, 1, 2, 4, 4, 2, seed=m)
                                               for m in range(M)), strict=True)]  # fmt: skip

    def op(*x):
        out, _, h, _, _ = mamba3_siso_combined(*x[:11], tuple(x[11:]), return_final_states=True,
                                               backend=backend)  # fmt: skip
        return out.sum() + h

    ins = [t.clone().requires_grad_() for t in stacked]
    out = vmap(op)(*ins)
    out.square().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in stacked]
    ref = torch.stack([op(*[t[m] for t in ref_ins]) for m in range(M)])
    ref.square().sum().backward()
    assert_close(out, ref, torch.float32, "out")
    for name, x, y in zip(SISO_NAMES, ins, ref_ins, strict=True):
        assert_close(x.grad, y.grad, torch.float32, name)


def test_compiles_fullgraph_with_backward():
    args = _siso(2, 9, 1, 2, 8, 4, 2, states=False)
    leaves = [t.clone().requires_grad_() for t in args]

    def fn(*x):
        return mamba3_siso_combined(*x, backend="torch").square().sum()

    eager = fn(*leaves)
    eager.backward()
    expected = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    compiled = torch.compile(fn, fullgraph=True)(*leaves)
    compiled.backward()
    # Inductor fuses the elementwise parts around the core: float32 rounding apart, the same.
    assert_close(compiled, eager, torch.float32, "loss")
    for name, t, e in zip(SISO_NAMES, leaves, expected, strict=False):
        assert_close(t.grad, e, torch.float32, f"d{name}")


def _valid() -> dict:
    names = SISO_NAMES[:11]
    return dict(zip(names, _siso(2, 5, 1, 2, 8, 4, 2, states=False), strict=True))


BAD_INPUTS = [
    (dict(Q=torch.randn(2, 5, 8)), ValueError, ["Q", "(B, L, G, N)"]),
    (dict(Q="not a tensor"), TypeError, ["Q", "Tensor"]),
    (dict(K=torch.randn(2, 5, 1, 8).double()), TypeError, ["K", "float64"]),
    (dict(Q=torch.randn(2, 5, 3, 8), K=torch.randn(2, 5, 3, 8)), ValueError, ["heads", "multiple"]),
    (dict(ADT=-torch.rand(2, 2, 4)), ValueError, ["ADT", "L: 4 != 5"]),
    (dict(ADT=torch.rand(2, 2, 5) + 0.1), ValueError, ["ADT", "<= 0"]),
    (dict(ADT=torch.full((2, 2, 5), float("nan"))), ValueError, ["ADT", "finite"]),
    (dict(Angles=torch.randn(2, 5, 2, 5)), ValueError, ["Angles", "1..N/2"]),
    (dict(Q_bias=torch.randn(2, 7)), ValueError, ["Q_bias", "N: 7 != 8"]),
    (dict(D=torch.randn(3)), ValueError, ["D", "H: 3 != 2"]),
    (dict(Input_States=(torch.zeros(2, 2, 2),)), ValueError, ["Input_States", "tuple"]),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, ["cu_seqlens=", "not supported"]),
    (dict(chunk_size=0), ValueError, ["chunk_size"]),
]


@pytest.mark.parametrize("overrides,error,words", BAD_INPUTS)
def test_bad_input_is_refused_by_name(overrides, error, words):
    args = _valid()
    args.update(overrides)
    with pytest.raises(error) as info:
        mamba3_siso_combined(**args, backend="torch")
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_mimo_bad_input_is_refused_by_name():
    args = _mimo(1, 5, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="rotary_dim_divisor"):
        mamba3_mimo(*args, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="Angles must have N / rotary_dim_divisor = 4"):
        mamba3_mimo(*args, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="needs Z"):
        mamba3_mimo(*args[:13], None, 8, 4, torch.float32, False, None, True)


# mamba-ssm's parameter lists (mamba_ssm/ops/triton/mamba3/mamba3_siso_combined.py,
# mamba_ssm/ops/tilelang/mamba3/mamba3_mimo.py at state-spaces/mamba e9594ce); mamba-ssm does
# not install here.
PEERS = {
    "mamba3_siso_combined": ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles",
                             "D", "Z", "Input_States", "chunk_size", "return_final_states",
                             "cu_seqlens"),
    "mamba3_mimo": ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z",
                    "MIMO_Out", "Angles", "D", "Z", "chunk_size", "rotary_dim_divisor", "dtype",
                    "return_state", "cu_seqlens", "fuse_pregate_headwise_rms_norm",
                    "outproj_norm_weight", "outproj_norm_eps"),
}  # fmt: skip
OURS = {"mamba3_mimo": ("Input_States",)}


@pytest.mark.parametrize("name", list(PEERS))
def test_parameters_are_mamba_ssms(name):
    parameters = inspect.signature(getattr(mecheval_kernels, name)).parameters
    assert tuple(n for n in parameters if n != "backend") == PEERS[name] + OURS.get(name, ())
    assert parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY


def test_at_positions_matches_the_reference():
    """States (the SSM state h) after positions, the output at one position per row, and a
    patched h, against the reference (resumed from the patch with the head's angle, k and v)."""
    args = _siso(2, 23, 1, 2, 8, 6, 2, torch.float64, seed=12)
    main, states = args[:11], tuple(args[11:])
    ref_states = (states[0], states[1], states[2][:, None], states[3][:, None])
    q1 = lambda t: t[:, :, None]  # noqa: E731
    rank = lambda x: [q1(x[0]), q1(x[1]), *x[2:6], x[6][:, None], x[7][:, None], *x[8:11]]  # noqa: E731
    states_at = torch.tensor([[0, 7, 22], [16, 3, 3]])
    o_ref, final_ref, h_ref = mamba3_ref(*rank(main), ref_states, states_at=states_at)
    got = at_positions(mamba3_siso_combined, *main, states, states_at=states_at,
                       return_final_state=True)  # fmt: skip
    assert relative_error(got.out, o_ref[:, :, 0]) < 1e-12
    assert relative_error(got.states, h_ref) < 1e-12
    assert relative_error(got.final_state, final_ref[1]) < 1e-12
    out_at = torch.tensor([5, 20])
    one = at_positions(mamba3_siso_combined, *main, states, out_at=out_at)
    assert relative_error(one.out[:, 0], o_ref[torch.arange(2), out_at, 0]) < 1e-12
    positions, values = torch.tensor([4, 17]), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    patched = at_positions(mamba3_siso_combined, *main, states, state_patch=(positions, values),
                           return_final_state=True)  # fmt: skip

    def cut(x, row, a, b):
        one = lambda t: t[row : row + 1, a:b]  # noqa: E731
        steps = [one(t) for t in x[:3]] + [t[row : row + 1, :, a:b] for t in x[3:6]]
        return steps + list(x[6:8]) + [one(x[8]), x[9], one(x[10])]

    for row in range(2):
        p = int(positions[row])
        head_states = tuple(t[row : row + 1] for t in ref_states)
        o_head, (theta, _, k, v) = mamba3_ref(*rank(cut(main, row, 0, p + 1)), head_states)
        tail_states = (theta, values[row : row + 1], k, v)
        o_tail, tail = mamba3_ref(*rank(cut(main, row, p + 1, 23)), tail_states)
        torch.testing.assert_close(patched.out[row], torch.cat([o_head, o_tail], 1)[0, :, 0])
        torch.testing.assert_close(patched.final_state[row], tail[1][0])


def _peer_tests():
    """mamba-ssm's test modules from the checkout at MAMBA_SSM_SOURCE (their references run on
    CPU; the SISO module's kernel imports are stubbed: its references do not call them)."""
    root = os.environ.get("MAMBA_SSM_SOURCE")
    if not root:
        pytest.skip("MAMBA_SSM_SOURCE (a state-spaces/mamba checkout) is not set")
    stubs = {"mamba_ssm.ops.triton.mamba3.mamba3_siso_combined": "mamba3_siso_combined",
             "mamba_ssm.ops.triton.mamba3.mamba3_siso_step": "mamba3_siso_step"}  # fmt: skip
    for name in (
        "mamba_ssm",
        "mamba_ssm.ops",
        "mamba_ssm.ops.triton",
        "mamba_ssm.ops.triton.mamba3",
    ):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name, attribute in stubs.items():
        module = sys.modules.setdefault(name, types.ModuleType(name))
        setattr(module, attribute, getattr(module, attribute, None))
    loaded = []
    for path in ("tests/ops/triton/test_mamba3_siso.py", "tests/ops/tilelang/test_mamba3_mimo.py"):
        spec = importlib.util.spec_from_file_location(
            f"peer_{len(loaded)}", os.path.join(root, path)
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded.append(module)
    return loaded


def test_matches_mamba_ssms_own_references():
    siso, mimo = _peer_tests()
    args = _siso(2, 23, 1, 4, 16, 8, 4, seed=30)
    out, theta, h, k, v = _ours_siso(args, "torch")
    for ref in (siso.mamba3_siso_step_ref, siso.mamba3_siso_fwd_ref):
        o_ref, (theta_ref, h_ref, k_ref, v_ref) = ref(*args[:11], tuple(args[11:]))
        for name, x, y in zip(("out", "h", "k", "v"), (out, h, k, v), (o_ref, h_ref, k_ref, v_ref),
                              strict=True):  # fmt: skip
            assert_close(x, y.float(), torch.float32, f"{ref.__name__} {name}")
    args = _mimo(2, 24, 4, 4, 16, 8, 4, seed=31)
    Q, K, V, ADT, DT, Trap, Qb, Kb, mv, mz, mo, Ang, D, Z = args
    chunks = ADT.view(2, 4, 3, 8)
    cs = chunks.cumsum(-1).view(2, 4, 24)
    rev = (chunks.flip(-1).cumsum(-1).flip(-1) - chunks).view(2, 4, 24)
    angles = mimo.apply_angle_dt_reference(Ang, DT.permute(0, 2, 1))
    o_ref, h_ref, k_ref = mimo.mamba3_MIMO_chunk_ref(
        Q, K, V, Qb, Kb, mv, mo, Z, mz, angles, cs, rev, DT, Trap, D, chunk_size=8,
        rotary_dim_divisor=4, return_final_state=True,
    )  # fmt: skip
    out, _, h, k, _ = mamba3_mimo(*args, 8, 4, torch.float32, True, backend="torch")
    assert_close(out, o_ref, torch.float32, "MIMO out")
    assert_close(h, h_ref.transpose(-1, -2), torch.float32, "MIMO h")
    assert_close(k, k_ref, torch.float32, "MIMO k")
