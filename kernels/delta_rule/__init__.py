"""The delta-rule family: the delta rule (DeltaNet) and, with its gate on, the gated delta rule
(kernels.gated_delta_rule). Here: the family's reference, PyTorch path, Triton kernels (the gate
a compile-time flag) and host code, the delta rule's public op and its scan at positions."""

from kernels.delta_rule.at import chunk_delta_rule_at
from kernels.delta_rule.op import chunk_delta_rule
from kernels.delta_rule.reference import delta_rule_ref

__all__ = ["chunk_delta_rule", "chunk_delta_rule_at", "delta_rule_ref"]
