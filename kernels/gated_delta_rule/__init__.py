"""The gated delta rule (Gated DeltaNet): the public op. It is the delta-rule family with the gate
on: reference, PyTorch path, Triton kernels and scan at positions are
mecheval_kernels.delta_rule's."""

from mecheval_kernels.delta_rule.reference import gated_delta_rule_ref
from mecheval_kernels.gated_delta_rule.op import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_ref"]
