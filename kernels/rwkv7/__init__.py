"""RWKV-7's state update: the public op `chunk_rwkv7`, the DPLR delta rule
(mecheval_kernels.dplr) in RWKV-7's names; reference, PyTorch path, Triton kernels and scan at
positions are mecheval_kernels.dplr's."""

from mecheval_kernels.rwkv7.op import chunk_rwkv7

__all__ = ["chunk_rwkv7"]
