"""Fused Triton kernels with PyTorch fallbacks, drop-in for the functions people already call.

    causal_conv1d_fn        drop-in for causal_conv1d.causal_conv1d_fn
    selective_scan_fn       drop-in for mamba_ssm's selective_scan_fn
    chunk_delta_rule        drop-in for fla.ops.delta_rule.chunk_delta_rule
    chunk_gated_delta_rule  drop-in for fla.ops.gated_delta_rule.chunk_gated_delta_rule
    chunk_kda               drop-in for fla.ops.kda.chunk_kda (a decay per key channel)
    chunk_gated_delta_product  drop-in for fla.ops.gated_delta_product's (n steps a token)
    chunk_comba             drop-in for fla.ops.comba.chunk_comba (a recall key p)
    chunk_dplr_delta_rule   drop-in for fla.ops.generalized_delta_rule.chunk_dplr_delta_rule
    chunk_rwkv7             drop-in for fla.ops.rwkv7.chunk_rwkv7
    mamba2_scan             drop-in for mamba_ssm's mamba_chunk_scan_combined (Mamba-2's scan)
    mamba3_siso_combined    drop-in for mamba_ssm's mamba3_siso_combined (Mamba-3's scan)
    mamba3_mimo             drop-in for mamba_ssm's mamba3_mimo (Mamba-3's MIMO scan)

and, beyond the peers, any of the four scans at positions (the states after given positions,
the output at one position per row, a state patched inside the scan), returning one `ScanAt`
whatever is asked (mecheval_kernels.positions):

    at_positions(scan, *scan's arguments, states_at=, out_at=, state_patch=,
                 return_final_state=)

This package imports torch and triton only, never mecheval. It lives in the folder kernels/ and
imports as `mecheval_kernels`: the name `kernels` belongs to Hugging Face's distribution, which
transformers requires.
"""

if __name__ == "kernels":
    # This folder, found by its name because a checkout's root is on sys.path (pytest, or
    # Python started there): hand the name to the `kernels` installed elsewhere, if any.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        raise ImportError("mecheval's kernel library imports as mecheval_kernels, not kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
else:
    from mecheval_kernels.backend import get_backend, set_backend, use_backend
    from mecheval_kernels.comba import chunk_comba
    from mecheval_kernels.delta_rule import chunk_delta_rule
    from mecheval_kernels.dplr import chunk_dplr_delta_rule
    from mecheval_kernels.gated_delta_product import chunk_gated_delta_product
    from mecheval_kernels.gated_delta_rule import chunk_gated_delta_rule
    from mecheval_kernels.kda import chunk_kda
    from mecheval_kernels.mamba3 import mamba3_mimo, mamba3_siso_combined
    from mecheval_kernels.positions import at_positions
    from mecheval_kernels.rwkv7 import chunk_rwkv7
    from mecheval_kernels.scan_at import ScanAt
    from mecheval_kernels.selective_scan import selective_scan_fn
    from mecheval_kernels.short_conv import causal_conv1d_fn
    from mecheval_kernels.ssd import mamba2_scan

__all__ = [
    "ScanAt",
    "at_positions",
    "causal_conv1d_fn",
    "chunk_comba",
    "chunk_delta_rule",
    "chunk_gated_delta_product",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_dplr_delta_rule",
    "chunk_rwkv7",
    "get_backend",
    "mamba2_scan",
    "mamba3_mimo",
    "mamba3_siso_combined",
    "selective_scan_fn",
    "set_backend",
    "use_backend",
]
