"""Which implementation runs a kernel call: the one place that decides.

Backends:
  "triton"  the fused Triton kernels: compiled on CUDA tensors, or run by Triton's interpreter
            on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported.
  "torch"   the PyTorch path (the CPU fast path; also runs on any device PyTorch supports).
  "auto"    "triton" on CUDA tensors and on CPU tensors under the interpreter, else "torch".

A call's `backend=` argument wins; without it the process default applies, which is "auto"
unless changed with `set_backend(...)` or, for a block of code, `use_backend(...)`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

BACKENDS = ("auto", "triton", "torch")

# Read once: triton itself reads the variable when it is first imported, so a later change
# would not take effect anyway.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

_default_backend = "auto"


def _check_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def set_backend(backend: str) -> None:
    """Set the process-wide default backend used when a call passes no `backend=`."""
    global _default_backend
    _check_name(backend)
    _default_backend = backend


def get_backend() -> str:
    """The process-wide default backend."""
    return _default_backend


@contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Run a block with a different default backend, e.g. a whole model on the Triton path."""
    previous = get_backend()
    set_backend(backend)
    try:
        yield
    finally:
        set_backend(previous)


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of this device in this process."""
    if not TRITON_AVAILABLE:
        return False
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def resolve_backend(op: str, backend: str | None, device: torch.device) -> str:
    """The concrete backend ("triton" or "torch") for a call of `op` on `device`."""
    name = _default_backend if backend is None else backend
    _check_name(name)
    if name == "auto":
        return "triton" if triton_runs_on(device) else "torch"
    if name == "triton" and not triton_runs_on(device):
        if not TRITON_AVAILABLE:
            why = "triton is not installed"
        elif device.type == "cpu":
            why = "CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        else:
            why = f"Triton does not run on {device.type} tensors"
        raise ValueError(f"{op}: backend='triton' cannot run here: {why}")
    return name
