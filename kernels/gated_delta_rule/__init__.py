"""The gated delta rule (Gated DeltaNet): the public op and its scan at positions. It is the
delta-rule family with the gate on: reference, PyTorch path and Triton kernels are
kernels.delta_rule's."""

from kernels.delta_rule.reference import gated_delta_rule_ref
from kernels.gated_delta_rule.at import chunk_gated_delta_rule_at
from kernels.gated_delta_rule.op import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_at", "gated_delta_rule_ref"]
