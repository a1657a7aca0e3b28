"""Short causal depthwise convolution: reference, PyTorch path, Triton kernels, public op."""

from mecheval_kernels.short_conv.op import causal_conv1d_fn
from mecheval_kernels.short_conv.reference import causal_conv1d_ref

__all__ = ["causal_conv1d_fn", "causal_conv1d_ref"]
