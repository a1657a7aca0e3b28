"""The gated delta rule (Gated DeltaNet): reference, PyTorch path, Triton kernels, public op,
the scan at positions."""

from kernels.gated_delta_rule.at import chunk_gated_delta_rule_at
from kernels.gated_delta_rule.op import chunk_gated_delta_rule
from kernels.gated_delta_rule.reference import gated_delta_rule_ref

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_at", "gated_delta_rule_ref"]
