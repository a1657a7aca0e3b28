"""Every architecture: output shape, forward_from, causality, a training step that reaches
every parameter, and the Triton backend (under the interpreter on CPU) against the torch one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mecheval_kernels
from mecheval.models import ARCHITECTURES, build_model

V, D, L, B = 40, 16, 8, 2


# Parameters the study's models have but never use: Hyena's long-conv skip D (zoology multiplies
# it by 0 when the model is built with bias=False, as the study's are).
UNUSED = {"hyena": ("mixer.D",)}


def used_parameters(arch: str, model):
    return [(n, p) for n, p in model.named_parameters() if not n.endswith(UNUSED.get(arch, ()))]


def make(arch: str, device="cpu", **options):
    torch.manual_seed(0)
    return build_model(arch, V, D, max_len=L, **options).to(device)


def tokens_for(batch=B, length=L, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, length), generator=g).to(device)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_output_shape_and_forward_from(arch):
    model = make(arch)
    tokens = tokens_for()
    logits = model(tokens)
    assert logits.shape == (B, L, V) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, model.forward_from(0, model.embed(tokens)))
    for layer in range(len(model.layers) + 1):
        name = f"layers.{layer}.block_input" if layer < len(model.layers) else None
        if name is None:
            with model.intervene(reads={"layers.1.block_output": None}) as record:
                model(tokens)
            residual = record["layers.1.block_output"]
        else:
            with model.intervene(reads={name: None}) as record:
                model(tokens)
            residual = record[name]
        torch.testing.assert_close(model.forward_from(layer, residual), logits)
    # A shorter sequence works too (lengths up to max_len).
    assert model(tokens[:, :5]).shape == (B, 5, V)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("n_layers", [1, 3])
def test_other_depths(arch, n_layers):
    torch.manual_seed(0)
    model = build_model(arch, V, D, n_layers=n_layers, max_len=L)
    assert len(model.layers) == n_layers
    assert model(tokens_for()).shape == (B, L, V)
    assert {n.split(".")[1] for n in model.site_names()} == {str(i) for i in range(n_layers)}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_causality(arch):
    """Changing token t changes no output before t (and does change the output at t)."""
    model = make(arch)
    tokens = tokens_for()
    with torch.no_grad():
        clean = model(tokens)
        for t in (0, 3, L - 1):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.arange(B)) % V
            out = model(changed)
            # Chunked scans solve a chunk's positions together: "unchanged" up to rounding.
            torch.testing.assert_close(out[:, :t], clean[:, :t], atol=1e-5, rtol=0)
            assert (out[:, t] - clean[:, t]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_training_step_reaches_every_parameter(arch):
    model = make(arch)
    tokens = tokens_for(batch=4)
    targets = tokens_for(batch=4, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    used = used_parameters(arch, model)
    missing = [n for n, p in used if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(p.grad is None for n, p in model.named_parameters() if (n, p) not in used)
    before = {n: p.detach().clone() for n, p in used}
    optimizer.step()
    unchanged = [n for n, p in used if torch.equal(p, before[n])]
    assert not unchanged
    assert torch.isfinite(loss)


def test_tied_head_and_parameter_count():
    model = make("attention")
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    tokens = tokens_for()
    logits = model(tokens)
    with model.intervene(reads={"layers.1.block_output": None}) as record:
        model(tokens)
    expected = model.norm_f(record["layers.1.block_output"]) @ model.embedding.weight.T
    torch.testing.assert_close(logits, expected)
    # d=16, L=8, V=40: embedding + positions + 2 blocks x (Wqkv, out_proj + bias, fc1 + bias,
    # fc2 + bias, 2 norms with biases) + final norm with bias.
    per_block = 3 * D * D + (D * D + D) + (4 * D * D + 4 * D) + (4 * D * D + D) + 4 * D
    assert model.num_params() == V * D + L * D + 2 * per_block + 2 * D


def test_state_sizes():
    d, n = 16, L
    assert make("attention").state_size() == 2 * (2 * d * n)
    assert make("attention").state_size(sequence_length=100) == 2 * (2 * d * 100)
    assert make("mamba").state_size() == 2 * (2 * d) * (16 + 3)
    assert make("mamba_noconv").state_size() == 2 * (2 * d) * 16
    # Mamba-2: d_inner x d_state, plus the conv window over x, B and C (d_state 64 each).
    assert make("mamba2").state_size() == 2 * ((2 * d) * 64 + (2 * d + 2 * 64) * 3)
    assert make("mamba2_noconv").state_size() == 2 * (2 * d) * 64
    assert make("deltanet").state_size() == 2 * (d * d + 3 * (3 * d))
    assert make("deltanet_noconv").state_size() == 2 * d * d
    assert make("gated_deltanet").state_size() == 2 * (d * d + 3 * (3 * d))
    assert make("gated_deltanet_noconv").state_size() == 2 * d * d
    assert make("base_conv").state_size() == d * 2 + d * n
    based_features = 1 + 8 + 8 * 9 // 2
    assert make("based").state_size() == d * 2 + (d + 1) * based_features
    assert make("base_conv_long").state_size() == 2 * d * n
    assert make("based_long").state_size() == d * n + (d + 1) * based_features
    N = 1024  # H3's state size: the sizing length l_max
    assert make("h3").state_size() == 2 * (d * N + (d // 2) * 4 * 2 * (N // 2))
    assert make("hyena").state_size() == 2 * (d * n + 3 * d * 2)


# attention, H3 and the long-conv-only Based ablations call no kernel (softmax attention; H3's
# SSMs are FFT convolutions; long convolutions and Based linear attention run in PyTorch).
NO_KERNEL_ARCHS = ("attention", "h3", "base_conv_long", "based_long")
KERNEL_ARCHS = [a for a in ARCHITECTURES if a not in NO_KERNEL_ARCHS]


@pytest.mark.parametrize("arch", KERNEL_ARCHS)
def test_triton_backend_matches_torch_backend(arch, device):
    """Whole model, forward and every gradient, Triton kernels (interpreted on CPU) vs the
    PyTorch paths. Tiny sizes: the interpreter is slow."""
    model = make(arch, device=device)
    tokens = tokens_for(device=device)
    targets = tokens_for(seed=2, device=device)

    def run():
        model.zero_grad()
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in used_parameters(arch, model)}

    with mecheval_kernels.use_backend("torch"):
        ref_logits, ref_grads = run()
    with mecheval_kernels.use_backend("triton"):
        logits, grads = run()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("arch", ["attention", "mamba"])
def test_logits_at_one_position_per_row(arch):
    model = make(arch)
    tokens = tokens_for(batch=3)
    positions = torch.tensor([0, 4, 7])
    full = model(tokens)
    at = model(tokens, at=positions)
    assert at.shape == (3, V)
    torch.testing.assert_close(at, full[torch.arange(3), positions])
    torch.testing.assert_close(model.forward_from(0, model.embed(tokens), positions), at)
    with pytest.raises(ValueError, match="at must have shape"):
        model(tokens, at=positions[:2])
    with pytest.raises(ValueError, match="at must have shape"):
        model(tokens, at=positions.float())
