"""The delta-rule family: the delta rule (DeltaNet) and, with its gate on, the gated delta rule
(mecheval_kernels.gated_delta_rule). Here: the family's reference, PyTorch path, Triton kernels (the
gate a compile-time flag) and host code, the delta rule's public op, and the scan at positions of
both ops (at.py)."""

from mecheval_kernels.delta_rule.op import chunk_delta_rule
from mecheval_kernels.delta_rule.reference import delta_rule_ref

__all__ = ["chunk_delta_rule", "delta_rule_ref"]
