"""KDA (Kimi Delta Attention): the gated delta rule with one decay per key channel. The public op;
reference, PyTorch path, Triton kernels (the gate the compile-time flag USE_GK) and scan at
positions are mecheval_kernels.delta_rule's."""

from mecheval_kernels.delta_rule.reference import gated_delta_rule_ref as kda_ref
from mecheval_kernels.kda.op import chunk_kda

__all__ = ["chunk_kda", "kda_ref"]
