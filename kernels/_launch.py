"""A kernel launch's compile-time parameters, written once: the host code launches with them and
the Hopper compile check (mecheval_kernels.compile_check) compiles exactly them."""

from __future__ import annotations

from typing import Any, NamedTuple


class Launch(NamedTuple):
    """One launch configuration: the `triton.jit` kernel, its constexpr arguments, warps and
    pipeline stages (None: Triton's default)."""

    kernel: Any
    constants: dict
    warps: int
    stages: int | None = None

    def __call__(self, grid: tuple, *args: object) -> None:
        options = {"num_warps": self.warps}
        if self.stages is not None:
            options["num_stages"] = self.stages
        self.kernel[grid](*args, **self.constants, **options)
