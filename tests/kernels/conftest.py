"""Fixtures of the Triton kernel tests: buffers that start as NaN and bounds-checked accesses
under the interpreter (what a parity check alone does not see)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch


class _NaNFilledEmpty:
    """`torch` as Triton host code sees it, except that torch.empty / empty_like /
    empty_strided return floating-point tensors filled with NaN (integer ones untouched)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args, **kwargs):
        return self._nan(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._nan(torch.empty_like(*args, **kwargs))

    def empty_strided(self, *args, **kwargs):
        return self._nan(torch.empty_strided(*args, **kwargs))


@pytest.fixture
def nan_fresh_buffers(monkeypatch):
    """Every buffer the delta-rule family's Triton host code (mecheval_kernels.delta_rule.launch,
    both ops) allocates starts as NaN: a kernel that reads memory nothing wrote (an unfilled tail, a
    V or K block never stored) then returns NaN, which the parity checks refuse. Under the
    interpreter torch.empty often holds zeros, which hide it."""
    from mecheval_kernels.delta_rule import launch

    monkeypatch.setattr(launch, "torch", _NaNFilledEmpty())


@pytest.fixture
def bounds_checked_interpreter(monkeypatch):
    """Under Triton's interpreter, every lane a kernel loads or stores (mask on) must lie inside
    one of the tensors passed to that launch. An access past a tensor's end that only feeds
    lanes the kernel later discards changes no result (so no parity check sees it), reads
    whatever is there on CPU, and is an illegal address on a GPU: this makes it fail on CPU.
    The check covers the union of the launch's tensors, not which tensor a pointer came from."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # compiled kernels: compute-sanitizer's job
    import numpy as np
    from triton.runtime import interpreter

    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    if not all(
        hasattr(builder, n) for n in ("create_masked_load", "create_masked_store")
    ) or not hasattr(interpreter, "_get_np_dtype"):
        warnings.warn(
            "this Triton's interpreter has other internals: accesses unchecked", stacklevel=2
        )
        return
    extents: list[tuple[int, int]] = []
    real_call = executor.__call__
    real_load, real_store = builder.create_masked_load, builder.create_masked_store

    def call(self, *args, **kwargs):
        extents.clear()
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
                extents.append((t.data_ptr(), t.data_ptr() + span * t.element_size()))
        return real_call(self, *args, **kwargs)

    def check(ptrs, mask, what):
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in extents:
            inside |= (addr >= lo) & (addr + size <= hi)
        assert inside.all(), f"{what} outside the launch's tensors: {int((~inside).sum())} lanes"

    def load(self, ptrs, mask, *args, **kwargs):
        check(ptrs, mask, "load")
        return real_load(self, ptrs, mask, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        check(ptrs, mask, "store")
        return real_store(self, ptrs, value, mask, *args, **kwargs)

    monkeypatch.setattr(executor, "__call__", call)
    monkeypatch.setattr(builder, "create_masked_load", load)
    monkeypatch.setattr(builder, "create_masked_store", store)
