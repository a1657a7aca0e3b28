"""Mamba-3's scan: the drop-ins `mamba3_siso_combined` and `mamba3_mimo` (op.py), the
elementwise parts around the core recurrence (prepare.py), the core and its PyTorch path and
Triton kernels (core.py, torch_path.py, recurrent.py, launch.py), the reference (reference.py)
and the scan at positions (at.py)."""

from mecheval_kernels.mamba3.op import mamba3_mimo, mamba3_siso_combined
from mecheval_kernels.mamba3.reference import mamba3_ref

__all__ = ["mamba3_mimo", "mamba3_ref", "mamba3_siso_combined"]
