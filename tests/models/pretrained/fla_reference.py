"""The oracle of the fla models' tests on CPU, where fla's own layers (Triton kernels) do not
run: `naive_forwards(hf_model)` swaps the forward of each block's DeltaNet / GatedDeltaNet layer
and MLP for one written in torch from fla's layer definitions, with fla's naive recurrences for
the delta rules (`fla.ops.delta_rule.naive.delta_rule_recurrence`,
`fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule`); fla's model, blocks and norms
(built with fuse_norm False) run as they are, and pyvene hooks their modules. No mecheval code."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


def rms(norm, x: torch.Tensor) -> torch.Tensor:
    """An fla or torch RMSNorm: x / sqrt(mean(x^2) + eps) * weight, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * norm.weight.float()


def l2(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def short_conv(conv, x: torch.Tensor, silu: bool) -> torch.Tensor:
    """fla's ShortConvolution on x (B, T, C): a causal depthwise convolution, then SiLU."""
    width = conv.weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=width - 1, groups=x.shape[-1])
    y = y[..., : x.shape[1]].transpose(1, 2)
    return F.silu(y) if silu else y


def _qkv(attn, h: torch.Tensor, qk_silu: bool):
    if attn.use_short_conv:
        q = short_conv(attn.q_conv1d, attn.q_proj(h), qk_silu)
        k = short_conv(attn.k_conv1d, attn.k_proj(h), qk_silu)
        v = short_conv(attn.v_conv1d, attn.v_proj(h), True)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), F.silu(attn.v_proj(h))
        if qk_silu:
            q, k = F.silu(q), F.silu(k)
    heads = lambda x, d: x.unflatten(-1, (-1, d))  # noqa: E731
    return heads(q, attn.head_k_dim), heads(k, attn.head_k_dim), heads(v, attn.head_v_dim)


def delta_net(attn, h: torch.Tensor) -> torch.Tensor:
    """fla's DeltaNet layer (use_gate False) on h (B, T, d)."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    q, k, v = _qkv(attn, h, attn.qk_activation == "silu")
    if attn.qk_activation == "relu":
        q, k = q.relu(), k.relu()
    elif attn.qk_activation == "elu":
        q, k = F.elu(q) + 1, F.elu(k) + 1
    if attn.qk_norm == "sum":
        q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
    else:
        q, k = l2(q), l2(k)
    beta = attn.b_proj(h).sigmoid() if attn.use_beta else h.new_ones(*h.shape[:2], attn.num_heads)
    beta = beta * 2 if attn.allow_neg_eigval else beta
    o, _ = delta_rule_recurrence(*(t.transpose(1, 2) for t in (q, k, v, beta)))
    o = rms(attn.o_norm, o.transpose(1, 2))
    return attn.o_proj(o.flatten(-2))


def gated_delta_net(attn, h: torch.Tensor) -> torch.Tensor:
    """fla's GatedDeltaNet layer on h (B, T, d)."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v = _qkv(attn, h, True)
    g = -attn.A_log.float().exp() * F.softplus(attn.a_proj(h).float() + attn.dt_bias.float())
    beta = attn.b_proj(h).sigmoid()
    beta = beta * 2 if attn.allow_neg_eigval else beta
    o, _ = naive_recurrent_gated_delta_rule(l2(q), l2(k), v, beta, g)
    if attn.use_gate:
        gate = attn.g_proj(h).unflatten(-1, (-1, attn.head_v_dim))
        o = rms(attn.o_norm, o) * F.silu(gate.float())
    else:
        o = rms(attn.o_norm, o)
    return attn.o_proj(o.flatten(-2))


def mlp(module, x: torch.Tensor) -> torch.Tensor:
    """fla's GatedMLP (swish): down(silu(gate(x)) * up(x))."""
    return module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))


@contextlib.contextmanager
def naive_forwards(hf_model):
    """Within: the fla causal LM's layers and MLPs run the torch forwards above (see the module
    docstring); their own forwards are put back after."""
    layer = delta_net if hf_model.config.model_type == "delta_net" else gated_delta_net

    def attn_forward(self, hidden_states, attention_mask=None, past_key_values=None, **_):
        return layer(self, hidden_states), None, past_key_values

    def mlp_forward(self, x, **_):
        return mlp(self, x)

    blocks = hf_model.model.layers
    for block in blocks:
        block.attn.forward = types.MethodType(attn_forward, block.attn)
        block.mlp.forward = types.MethodType(mlp_forward, block.mlp)
    try:
        yield hf_model
    finally:
        for block in blocks:
            del block.attn.forward, block.mlp.forward


@torch.no_grad()
def fla_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) logits of an fla DeltaNet or Gated DeltaNet causal LM on CPU."""
    with naive_forwards(hf_model):
        return hf_model(tokens, use_cache=False).logits
