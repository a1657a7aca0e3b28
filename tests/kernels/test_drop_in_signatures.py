"""Each drop-in takes exactly its peer's parameters, in the peer's order and with the peer's
defaults, plus `backend` (keyword-only) and, for the selective scan, `initial_state` (ours) at
the end; it has **kwargs where its peer has them; it returns what the peer returns; the peer
arguments it does not implement are refused by name, never ignored.

The peers' parameters come from the installed peer when it imports, else from the pinned copies
below, taken from the releases' sources: causal-conv1d 1.7.0
(causal_conv1d/causal_conv1d_interface.py), mamba-ssm 2.3.2.post1
(mamba_ssm/ops/selective_scan_interface.py, mamba_ssm/ops/triton/ssd_combined.py) and
flash-linear-attention 0.6.0 (fla/ops/delta_rule/chunk.py, fla/ops/gated_delta_rule/chunk.py,
fla/ops/kda/chunk.py, fla/ops/gated_delta_product/chunk.py, fla/ops/comba/chunk.py). Where the
installed release is the pinned one, the pinned copy is checked against it."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import math

import pytest
import torch

import mecheval_kernels

REQUIRED = inspect.Parameter.empty
# drop-in -> (peer distribution, its version, module, function, ((parameter, default), ...),
# whether the peer takes **kwargs)
PEERS = {
    "causal_conv1d_fn": (
        "causal-conv1d", "1.7.0", "causal_conv1d", "causal_conv1d_fn",
        (("x", REQUIRED), ("weight", REQUIRED), ("bias", None), ("seq_idx", None),
         ("initial_states", None), ("return_final_states", False), ("final_states_out", None),
         ("activation", None)),
        False,
    ),
    "selective_scan_fn": (
        "mamba-ssm", "2.3.2.post1", "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn",
        (("u", REQUIRED), ("delta", REQUIRED), ("A", REQUIRED), ("B", REQUIRED), ("C", REQUIRED),
         ("D", None), ("z", None), ("delta_bias", None), ("delta_softplus", False),
         ("return_last_state", False)),
        False,
    ),
    "mamba2_scan": (
        "mamba-ssm", "2.3.2.post1", "mamba_ssm.ops.triton.ssd_combined",
        "mamba_chunk_scan_combined",
        (("x", REQUIRED), ("dt", REQUIRED), ("A", REQUIRED), ("B", REQUIRED), ("C", REQUIRED),
         ("chunk_size", REQUIRED), ("D", None), ("z", None), ("dt_bias", None),
         ("initial_states", None), ("seq_idx", None), ("cu_seqlens", None),
         ("dt_softplus", False), ("dt_limit", (0.0, math.inf)), ("return_final_states", False),
         ("return_varlen_states", False)),
        False,
    ),
    "chunk_delta_rule": (
        "flash-linear-attention", "0.6.0", "fla.ops.delta_rule", "chunk_delta_rule",
        (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("beta", REQUIRED), ("scale", None),
         ("initial_state", None), ("output_final_state", False),
         ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None)),
        True,
    ),
    "chunk_gated_delta_rule": (
        "flash-linear-attention", "0.6.0", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
        (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED),
         ("scale", None), ("initial_state", None), ("output_final_state", False),
         ("use_qk_l2norm_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
         ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None),
         ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None)),
        True,
    ),
    "chunk_kda": (
        "flash-linear-attention", "0.6.0", "fla.ops.kda", "chunk_kda",
        (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED),
         ("scale", None), ("initial_state", None), ("output_final_state", False),
         ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
         ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
         ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
         ("return_intermediate_states", False), ("state_v_first", False), ("cu_seqlens", None),
         ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False),
         ("max_num_seqs", None)),
        True,
    ),
    "chunk_gated_delta_product": (
        "flash-linear-attention", "0.6.0", "fla.ops.gated_delta_product",
        "chunk_gated_delta_product",
        (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED),
         ("num_householder", REQUIRED), ("scale", None), ("initial_state", None),
         ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None),
         ("cu_seqlens_cpu", None), ("cp_context", None)),
        False,
    ),
    "chunk_comba": (
        "flash-linear-attention", "0.6.0", "fla.ops.comba", "chunk_comba",
        (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("p", REQUIRED), ("g", REQUIRED),
         ("beta", None), ("scale", None), ("initial_state", None), ("output_final_state", False),
         ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None)),
        False,
    ),
}  # fmt: skip
OURS = {"selective_scan_fn": (("initial_state", None),)}
# Defaults that differ from the peer's, on purpose (docs/kernels.md says why).
OUR_DEFAULTS = {("mamba2_scan", "chunk_size"): None}


def _installed(name: str):
    """The installed peer function and its distribution's version, or (None, None)."""
    distribution, _, module, function, _, _ = PEERS[name]
    try:
        peer = getattr(importlib.import_module(module), function)
    except Exception:  # not installed, or its CUDA parts missing: the pinned copy stands in
        return None, None
    return peer, importlib.metadata.version(distribution)


def _parameters(fn) -> tuple[tuple, bool]:
    """((name, default), ...) of the positional-or-keyword parameters, and whether fn takes
    **kwargs."""
    parameters = inspect.signature(fn).parameters.values()
    kinds = inspect.Parameter
    named = tuple((p.name, p.default) for p in parameters if p.kind is kinds.POSITIONAL_OR_KEYWORD)
    return named, any(p.kind is kinds.VAR_KEYWORD for p in parameters)


def _peer(name: str) -> tuple[tuple, bool]:
    _, version, _, _, pinned, var_keyword = PEERS[name]
    peer, installed = _installed(name)
    if peer is None:
        return pinned, var_keyword
    named, has_kwargs = _parameters(peer)
    if installed == version:  # the pinned copy is what that release has
        assert (named, has_kwargs) == (pinned, var_keyword), f"pinned {name} is stale"
    return named, has_kwargs


@pytest.mark.parametrize("name", list(PEERS))
def test_parameters_are_the_peers(name):
    ours, our_kwargs = _parameters(getattr(mecheval_kernels, name))
    peer, peer_kwargs = _peer(name)
    expected = tuple((p, OUR_DEFAULTS.get((name, p), default)) for p, default in peer) + OURS.get(
        name, ()
    )
    assert ours == expected
    assert our_kwargs == peer_kwargs
    parameters = inspect.signature(getattr(mecheval_kernels, name)).parameters.values()
    keyword_only = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["backend"]


def test_flash_linear_attention_is_the_pinned_release():
    """The test extra installs flash-linear-attention 0.6.0: its naive references are the
    oracles of the delta-rule family's new ops."""
    pytest.importorskip("fla")
    assert importlib.metadata.version("flash-linear-attention") == "0.6.0"


def _conv():
    return torch.randn(2, 4, 7), torch.randn(4, 3)


def _scan():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, 7, generator=g),
        torch.randn(2, 4, 7, generator=g),
        -torch.rand(4, 3, generator=g),
        torch.randn(2, 3, 7, generator=g),
        torch.randn(2, 3, 7, generator=g),
    )


def _delta(gate: str | None):
    """q, k, v, [g,] beta: g None, "head" (B, T, H) or "key" (B, T, H, K)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 7, 1, 4, generator=g) for _ in range(3))
    beta = torch.rand(2, 7, 1, generator=g)
    if gate is None:
        return q, k, v, beta
    decays = -torch.rand(2, 7, 1, *((4,) if gate == "key" else ()), generator=g)
    return q, k, v, decays, beta


def _mamba2():
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(2, 7, 2, 3, generator=g),
        torch.randn(2, 7, 2, generator=g),
        -torch.rand(2, generator=g),
        torch.randn(2, 7, 1, 4, generator=g),
        torch.randn(2, 7, 1, 4, generator=g),
    )


def test_returns_are_the_peers():
    x, weight = _conv()
    assert isinstance(mecheval_kernels.causal_conv1d_fn(x, weight), torch.Tensor)
    y, final = mecheval_kernels.causal_conv1d_fn(x, weight, return_final_states=True)
    assert final.shape == (2, 4, 2)
    assert isinstance(mecheval_kernels.selective_scan_fn(*_scan()), torch.Tensor)
    out, last = mecheval_kernels.selective_scan_fn(*_scan(), return_last_state=True)
    assert last.shape == (2, 4, 3)
    o, final = mecheval_kernels.chunk_delta_rule(*_delta(None))
    assert o.shape == (2, 7, 1, 4) and final is None
    o, final = mecheval_kernels.chunk_gated_delta_rule(*_delta("head"), output_final_state=True)
    assert final.shape == (2, 1, 4, 4)
    o, final = mecheval_kernels.chunk_kda(*_delta("key"), output_final_state=True)
    assert o.shape == (2, 7, 1, 4) and final.shape == (2, 1, 4, 4)
    q, k, v, g, beta = _delta("head")
    o, final = mecheval_kernels.chunk_comba(q, k, v, k, g, beta)
    assert o.shape == (2, 7, 1, 4) and final is None
    k2, v2, beta2 = (t.repeat_interleave(2, dim=1) for t in (k, v, beta))  # 2 steps a token
    o, final = mecheval_kernels.chunk_gated_delta_product(
        q, k2, v2, g, beta2, 2, output_final_state=True
    )
    assert o.shape == (2, 7, 1, 4) and final.shape == (2, 1, 4, 4)
    assert isinstance(mecheval_kernels.mamba2_scan(*_mamba2(), 4), torch.Tensor)
    out, final = mecheval_kernels.mamba2_scan(*_mamba2(), 4, return_final_states=True)
    assert final.shape == (2, 2, 3, 4)


def test_final_states_out_is_written_and_returned():
    x, weight = _conv()
    into = torch.full((2, 4, 2), float("nan"))
    _, final = mecheval_kernels.causal_conv1d_fn(
        x, weight, return_final_states=True, final_states_out=into
    )
    assert final is into
    torch.testing.assert_close(into, x[:, :, -2:])
    with pytest.raises(ValueError, match=r"final_states_out must be a tensor of shape \(2, 4, 2\)"):
        mecheval_kernels.causal_conv1d_fn(
            x, weight, return_final_states=True, final_states_out=torch.zeros(2, 4, 3)
        )


def _comba():
    q, k, v, g, beta = _delta("head")
    return q, k, v, k, g, beta


def _product():
    q, k, v, g, beta = _delta("head")
    return q, k, v, g, beta, 1


PACKED = torch.tensor([0, 7])
UNSUPPORTED = [
    (mecheval_kernels.causal_conv1d_fn, _conv(), "seq_idx", torch.zeros(2, 7)),
    (mecheval_kernels.mamba2_scan, _mamba2(), "seq_idx", torch.zeros(2, 7)),
    (mecheval_kernels.chunk_delta_rule, _delta(None), "cu_seqlens", PACKED),
    (mecheval_kernels.chunk_delta_rule, _delta(None), "cu_seqlens_cpu", PACKED),
    (mecheval_kernels.chunk_gated_delta_rule, _delta("head"), "cu_seqlens", PACKED),
    (mecheval_kernels.chunk_gated_delta_rule, _delta("head"), "cu_seqlens_cpu", PACKED),
    (mecheval_kernels.chunk_gated_delta_rule, _delta("head"), "chunk_indices", PACKED),
    (mecheval_kernels.chunk_gated_delta_rule, _delta("head"), "cp_context", object()),
    (mecheval_kernels.chunk_kda, _delta("key"), "cu_seqlens", PACKED),
    (mecheval_kernels.chunk_kda, _delta("key"), "return_intermediate_states", True),
    (mecheval_kernels.chunk_kda, _delta("key"), "use_graph", True),
    (mecheval_kernels.chunk_kda, _delta("key"), "max_num_seqs", 4),
    (mecheval_kernels.chunk_comba, _comba(), "cu_seqlens", PACKED),
    (mecheval_kernels.chunk_comba, _comba(), "cu_seqlens_cpu", PACKED),
    (mecheval_kernels.chunk_gated_delta_product, _product(), "cu_seqlens", PACKED),
    (mecheval_kernels.chunk_gated_delta_product, _product(), "cp_context", object()),
]


@pytest.mark.parametrize(
    "fn, args, argument, value", UNSUPPORTED, ids=[f"{u[0].__name__}-{u[2]}" for u in UNSUPPORTED]
)
def test_unsupported_peer_arguments_are_refused_by_name(fn, args, argument, value):
    with pytest.raises(ValueError, match=f"{argument}=.* is not supported"):
        fn(*args, **{argument: value})


@pytest.mark.parametrize(
    "fn, args",
    [
        (mecheval_kernels.chunk_delta_rule, _delta(None)),
        (mecheval_kernels.chunk_gated_delta_rule, _delta("head")),
        (mecheval_kernels.chunk_kda, _delta("key")),
    ],
)
def test_removed_and_unknown_keywords_are_refused(fn, args):
    """fla 0.6 removed head_first; a keyword fla's op would silently drop is refused here."""
    with pytest.raises(ValueError, match="head_first was removed in flash-linear-attention 0.6"):
        fn(*args, head_first=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'headfirst'"):
        fn(*args, headfirst=True)
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        fn(*args, chunk_size=48)


def test_gated_delta_rule_options_of_flash_linear_attention_0_6():
    """use_beta_sigmoid_in_kernel (allow_neg_eigval), state_v_first, use_gate_in_kernel (with
    A_log, dt_bias) and GVA, against the same call with those applied by hand."""
    q, k, v, raw, logits = _delta("head")
    v, raw, logits = v.repeat(1, 1, 2, 1), raw.repeat(1, 1, 2), 4 * logits.repeat(1, 1, 2) - 2
    state = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    A_log, dt_bias = torch.tensor([0.3, -0.2]), torch.tensor([0.1, 0.5])
    o, final = mecheval_kernels.chunk_gated_delta_rule(
        q, k, v, raw, logits, None, state.transpose(-1, -2), True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    g = -A_log.exp() * torch.nn.functional.softplus(raw + dt_bias)
    q2, k2 = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)
    o_ref, final_ref = mecheval_kernels.chunk_gated_delta_rule(
        q2, k2, v, g, 2 * logits.sigmoid(), None, state, True
    )
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(final, final_ref.transpose(-1, -2))
