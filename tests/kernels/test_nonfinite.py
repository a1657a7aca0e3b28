"""Probes: a NaN at one position of the chunked PyTorch paths (`chunk_delta_rule`,
`chunk_gated_delta_rule`, `mamba2_scan`) leaves the positions before it as the step-by-step
references give them, finite, across chunk boundaries; outputs and states are non-finite exactly
where the references' are. Positive log decays are refused by name."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import mecheval_kernels
from mecheval_kernels.delta_rule.reference import delta_rule_ref, gated_delta_rule_ref
from mecheval_kernels.ssd.reference import mamba2_scan_ref

pytestmark = pytest.mark.reliability

NAN = float("nan")
T = 150  # three chunks of the delta rules (64), five of the SSD (32)
AT = torch.tensor([[3, 66, 149], [0, 70, 120]])  # states read back (delta rules)
# (the op, its reference, whether it takes log decays g)
DELTA_RULES = {
    "delta_rule": (mecheval_kernels.chunk_delta_rule, delta_rule_ref, False),
    "gated_delta_rule": (mecheval_kernels.chunk_gated_delta_rule, gated_delta_rule_ref, True),
}


def _check(got: torch.Tensor, expected: torch.Tensor, before: int) -> None:
    """Equal (to float rounding) where the reference is finite, non-finite where it is not, and
    finite at every position before `before` (axis 1)."""
    finite = torch.isfinite(expected)
    assert finite[:, :before].all()
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-4, rtol=1e-4)


def _gated_inputs(gated: bool = True) -> dict[str, torch.Tensor]:
    """The inputs of the gated delta rule, or (not `gated`) of the delta rule: the same but g."""
    gen = torch.Generator().manual_seed(0)
    B, H, K, V = 2, 2, 4, 3
    inputs = dict(
        q=torch.randn(B, T, H, K, generator=gen),
        k=F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        v=torch.randn(B, T, H, V, generator=gen),
        g=F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2),
        beta=torch.rand(B, T, H, generator=gen),
        initial_state=torch.randn(B, H, K, V, generator=gen),
    )
    if not gated:
        del inputs["g"]
    return inputs


@pytest.mark.parametrize("rule", list(DELTA_RULES))
@pytest.mark.parametrize(
    "name,index",
    [
        ("q", (0, 70, 1, 2)),  # only the output at 70
        ("k", (1, 70, 0, 1)),  # the whole state from 70 on (64..69 share its chunk)
        ("v", (0, 100, 1, 2)),  # one column of the state
        ("beta", (1, 66, 0)),
        ("k", (0, 64, 1, 0)),  # the first position of a chunk
    ],
)
def test_a_nan_in_a_delta_rule_stays_causal(rule, name, index):
    op, reference, gated = DELTA_RULES[rule]
    op_at = functools.partial(mecheval_kernels.at_positions, op)
    inputs = _gated_inputs(gated)
    inputs[name][index] = NAN
    o, final, states = op_at(**inputs, states_at=AT, return_final_state=True, backend="torch")
    o_ref, final_ref, states_ref = reference(**inputs, output_final_state=True, states_at=AT)
    _check(o, o_ref, before=index[1])
    assert torch.equal(torch.isfinite(final), torch.isfinite(final_ref))
    _check(states, states_ref, before=0)
    o_plain, _ = op(**inputs, backend="torch")  # without states_at
    _check(o_plain, o_ref, before=index[1])
    every = torch.arange(T).expand(2, T)  # every state (formed as one running sum)
    states = op_at(**inputs, states_at=every, backend="torch").states
    _check(states, reference(**inputs, states_at=every)[2], before=index[1])
    for step in (index[1] - 1, T - 1):  # the output at one step: just before the NaN, the last
        o_at = op_at(**inputs, out_at=torch.full((2,), step), backend="torch").out
        _check(o_at, o_ref[:, step : step + 1], before=0)


def test_positive_log_decays_are_refused_by_name():
    inputs = _gated_inputs()
    inputs["g"][0, 5, 1] = 0.25
    with pytest.raises(ValueError, match=r"g \(the log decays\) must be <= 0.*largest 0\.25"):
        mecheval_kernels.chunk_gated_delta_rule(**inputs, backend="torch")


def _ssd_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    B, H, P, G, N = 2, 4, 3, 2, 5
    return dict(
        x=torch.randn(B, T, H, P, generator=gen),
        dt=torch.randn(B, T, H, generator=gen),
        A=-torch.rand(H, generator=gen),
        B=torch.randn(B, T, G, N, generator=gen),
        C=torch.randn(B, T, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        z=torch.randn(B, T, H, P, generator=gen),
        dt_bias=torch.randn(H, generator=gen),
        initial_states=torch.randn(B, H, P, N, generator=gen),
    )


@pytest.mark.parametrize(
    "name,index",
    [
        ("x", (0, 70, 1, 2)),  # one channel of the head from 70 on (64..69 share its chunk)
        ("dt", (1, 45, 0)),  # the whole head
        ("B", (0, 100, 1, 2)),  # every head of the group; one column of the final state
        ("C", (1, 64, 0, 3)),  # the group's heads at 64 only
        ("z", (0, 5, 3, 1)),  # one output
    ],
)
def test_a_nan_in_mamba2_scan_stays_causal(name, index):
    inputs = _ssd_inputs()
    inputs[name][index] = NAN
    out, final = mecheval_kernels.mamba2_scan(
        **inputs, dt_softplus=True, return_final_states=True, backend="torch"
    )
    out_ref, final_ref = mamba2_scan_ref(**inputs, dt_softplus=True, return_final_states=True)
    _check(out, out_ref, before=index[1])
    assert torch.equal(torch.isfinite(final), torch.isfinite(final_ref))


def test_finite_inputs_give_the_same_outputs_down_the_masking_path(monkeypatch):
    """On a GPU, and under torch.compile, the PyTorch paths always take the masking path (no
    read of the inputs' finiteness): with finite inputs it gives what the plain path gives."""
    from mecheval_kernels.delta_rule import nonfinite
    from mecheval_kernels.ssd import chunked

    delta, gated, ssd = _gated_inputs(False), _gated_inputs(), _ssd_inputs()

    def run() -> tuple:
        return (
            mecheval_kernels.chunk_delta_rule(**delta, output_final_state=True, backend="torch"),
            mecheval_kernels.chunk_gated_delta_rule(
                **gated, output_final_state=True, backend="torch"
            ),
            mecheval_kernels.mamba2_scan(
                **ssd, dt_softplus=True, return_final_states=True, backend="torch"
            ),
        )

    plain = run()
    monkeypatch.setattr(nonfinite, "all_finite", lambda args: False)
    monkeypatch.setattr(chunked, "_all_finite", lambda *tensors: False)
    masked = run()
    for got, expected in zip(masked, plain, strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


def test_a_nan_in_one_stacked_model_stays_in_that_model_and_causal():
    """Stacked models run mamba2_scan under torch.vmap: a NaN in one model's x leaves the other
    model's outputs finite, and the first model's causal."""
    models = [_ssd_inputs(), _ssd_inputs()]
    models[1]["x"][0, 70, 1, 2] = NAN
    names = ("x", "dt", "A", "B", "C", "z")
    stacked = [torch.stack([m[name] for m in models]) for name in names]

    def scan(x, dt, A, B, C, z):
        return mecheval_kernels.mamba2_scan(x, dt, A, B, C, z=z, dt_softplus=True, backend="torch")

    out = torch.vmap(scan)(*stacked)
    for m, inputs in enumerate(models):
        expected = mamba2_scan_ref(*(inputs[n] for n in names[:5]), z=inputs["z"], dt_softplus=True)
        _check(out[m], expected, before=70)
