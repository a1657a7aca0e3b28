"""Mamba-2's scan (SSD): reference, chunked PyTorch path, public op, the scan at positions."""

from mecheval_kernels.ssd.op import mamba2_scan
from mecheval_kernels.ssd.reference import mamba2_scan_ref

__all__ = ["mamba2_scan", "mamba2_scan_ref"]
