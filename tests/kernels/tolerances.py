"""Per-dtype tolerances for kernel parity tests, written once and shared by every kernel test.

Errors are measured as ||actual - expected|| / ||expected|| (relative L2 norm, as a GPU
numerics check would), with the expected value computed by the fp32 (or fp64) reference on the
same, already-rounded inputs. Never loosen these to make a test pass.
"""

from __future__ import annotations

import torch

RELATIVE_L2 = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().double()
    e = expected.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""
) -> None:
    """Same shape, all finite, and relative L2 error within the tolerance of `dtype`."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if expected.numel() == 0:
        return
    err = relative_error(actual, expected)
    tol = RELATIVE_L2[dtype]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} ({dtype})"
