"""The delta rule (DeltaNet): reference, PyTorch path, Triton kernels, public op."""

from kernels.delta_rule.op import chunk_delta_rule
from kernels.delta_rule.reference import delta_rule_ref

__all__ = ["chunk_delta_rule", "delta_rule_ref"]
