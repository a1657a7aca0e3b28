"""Comba: the gated delta rule whose recall key p reads the memory before the step's decay. The
public op; reference, PyTorch path, Triton kernels (the recall key the compile-time flag USE_P)
and scan at positions are mecheval_kernels.delta_rule's."""

from mecheval_kernels.comba.op import chunk_comba, comba_ref

__all__ = ["chunk_comba", "comba_ref"]
