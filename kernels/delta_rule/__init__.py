"""The delta rule (DeltaNet): reference, PyTorch path, Triton kernels, public op, the scan at
positions."""

from kernels.delta_rule.at import chunk_delta_rule_at
from kernels.delta_rule.op import chunk_delta_rule
from kernels.delta_rule.reference import delta_rule_ref

__all__ = ["chunk_delta_rule", "chunk_delta_rule_at", "delta_rule_ref"]
