"""Initialisations the state-space mixers share (Mamba, Mamba-2, Gated DeltaNet, H3): step
sizes drawn log-uniform, the bias whose softplus is such a step, and mamba-ssm's mark on the
parameters that weight decay leaves alone."""

from __future__ import annotations

import math

import torch
from torch import nn


def log_uniform_log(n: int, low: float, high: float, **factory) -> torch.Tensor:
    """log(x) for n draws of x log-uniform in [low, high], (n,): uniform in [log low, log high]
    (`factory`: torch.rand's device and dtype)."""
    return torch.rand(n, **factory) * (math.log(high) - math.log(low)) + math.log(low)


def dt_bias(n: int, dt_min: float, dt_max: float, dt_init_floor: float, **factory) -> torch.Tensor:
    """mamba-ssm's (and fla's) step-size bias, (n,): b with softplus(b) = dt, for n step sizes
    dt log-uniform in [dt_min, dt_max], clamped below at dt_init_floor."""
    dt = torch.exp(log_uniform_log(n, dt_min, dt_max, **factory)).clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus


def no_weight_decay(value: torch.Tensor) -> nn.Parameter:
    """A parameter of `value` with mamba-ssm's `_no_weight_decay` mark (its SSM parameters:
    A_log, D, dt_bias)."""
    parameter = nn.Parameter(value)
    parameter._no_weight_decay = True
    return parameter
