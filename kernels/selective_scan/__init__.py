"""Selective scan (Mamba): reference, PyTorch path, Triton kernels, public op, the scan at
positions."""

from mecheval_kernels.selective_scan.op import selective_scan_fn
from mecheval_kernels.selective_scan.reference import selective_scan_ref

__all__ = ["selective_scan_fn", "selective_scan_ref"]
