"""The delta-rule family: the delta rule (DeltaNet) and, with their flags on, the gated delta rule
(mecheval_kernels.gated_delta_rule), KDA (mecheval_kernels.kda) and Comba (mecheval_kernels.comba);
Gated DeltaProduct (mecheval_kernels.gated_delta_product) runs the gated delta rule. Here: the
family's reference, PyTorch path, Triton kernels (gate, per-key gate and recall key compile-time
flags) and host code, the drop-in options (dropin.py), the delta rule's public op, and the scan
at positions of every op (at.py)."""

from mecheval_kernels.delta_rule.op import chunk_delta_rule
from mecheval_kernels.delta_rule.reference import delta_rule_ref

__all__ = ["chunk_delta_rule", "delta_rule_ref"]
