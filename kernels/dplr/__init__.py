"""The generalised delta rule with a diagonal-plus-low-rank transition (DPLR), RWKV-7's state
update: its reference, PyTorch path, Triton kernels and host code, the public op
`chunk_dplr_delta_rule`, and the scan at positions of it and of `chunk_rwkv7`
(mecheval_kernels.rwkv7, the same op in RWKV-7's names) (at.py)."""

from mecheval_kernels.dplr.op import chunk_dplr_delta_rule
from mecheval_kernels.dplr.reference import dplr_delta_rule_ref

__all__ = ["chunk_dplr_delta_rule", "dplr_delta_rule_ref"]
