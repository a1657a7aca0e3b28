"""Gated DeltaProduct: n Householder steps a token. The public op runs the gated delta rule over
the token's steps (mecheval_kernels.delta_rule); its reference is its own (reference.py)."""

from mecheval_kernels.gated_delta_product.op import chunk_gated_delta_product
from mecheval_kernels.gated_delta_product.reference import gated_delta_product_ref

__all__ = ["chunk_gated_delta_product", "gated_delta_product_ref"]
