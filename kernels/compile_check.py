"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter accepts code that a GPU compiler rejects, and says nothing about
registers, spills or shared memory. This compiles every specialisation the host code launches
(each op's `hopper_specialisations()` in its host code, see `SPECIALISATIONS`, built from the
same launch configurations the host code launches with) to a cubin with the ptxas that ships
with Triton, and reports registers, spilled bytes, shared memory and wgmma instructions; a
kernel over one block's shared-memory limit would fail to launch on the GPU, and a kernel that
must not use wgmma (see Specialisation.allow_wgmma) fails the check if it does.

    python -m mecheval_kernels.compile_check [--ops short_conv selective_scan delta_rule
    gated_delta_rule kda comba dplr_delta_rule mamba3]

Run with TRITON_INTERPRET unset (under the interpreter `triton.jit` builds no compilable
kernel). Exits non-zero if anything fails to compile or exceeds the limit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

from mecheval_kernels._launch import Launch

# Largest shared memory one block may use on sm_90 (H100/H200): 227 KiB.
SM90_MAX_SHARED = 232448
TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Each op's host-code module and the arguments of its `hopper_specialisations` (the gated delta
# rule's, KDA's and Comba's kernels are the delta rule's, with their flags on; Gated DeltaProduct
# runs the gated delta rule's; RWKV-7's are the DPLR delta rule's).
SPECIALISATIONS = {
    "short_conv": ("mecheval_kernels.short_conv.launch", {}),
    "selective_scan": ("mecheval_kernels.selective_scan.launch", {}),
    "delta_rule": ("mecheval_kernels.delta_rule.launch", {}),
    "gated_delta_rule": ("mecheval_kernels.delta_rule.launch", {"gated": True}),
    "kda": ("mecheval_kernels.delta_rule.launch", {"per_key": True}),
    "comba": ("mecheval_kernels.delta_rule.launch", {"gated": True, "recall_key": True}),
    "dplr_delta_rule": ("mecheval_kernels.dplr.launch", {}),
    "mamba3": ("mecheval_kernels.mamba3.launch", {}),
}
OPS = tuple(SPECIALISATIONS)


@dataclass(frozen=True)
class Specialisation:
    """One launch configuration of a kernel, for inputs of one dtype.

    Attributes:
        launch: the kernel, its constexprs, warps and stages, as the host code launches it.
        dtype: the dtype of the op's inputs (pointer arguments default to it).
        float32_pointers: pointer arguments that are float32 whatever the input dtype
            (states, partial sums); other `*_ptr` arguments take `dtype`.
        float_scalars: scalar arguments that are floats (others are int32).
        allow_wgmma: whether the kernel may use Hopper's wgmma instructions (the delta rule's
            may not: see mecheval_kernels.delta_rule.common.CHUNK).
    """

    launch: Launch
    dtype: torch.dtype
    float32_pointers: frozenset = field(default_factory=frozenset)
    float_scalars: frozenset = field(default_factory=frozenset)
    allow_wgmma: bool = True

    @property
    def name(self) -> str:
        return self.launch.kernel.__name__

    def signature(self) -> dict[str, str]:
        elem = TRITON_DTYPE[self.dtype]
        signature = {}
        for name in self.launch.kernel.arg_names:
            if name in self.launch.constants:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*fp32" if name in self.float32_pointers else f"*{elem}"
            elif name in self.float_scalars:
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        return signature


@dataclass
class Compiled:
    spec: Specialisation
    registers: int | None
    spilled_bytes: int | None
    shared_bytes: int
    wgmma: int  # wgmma instructions in the PTX

    @property
    def ok(self) -> bool:
        return self.shared_bytes <= SM90_MAX_SHARED and (self.spec.allow_wgmma or not self.wgmma)

    def line(self) -> str:
        dtype = TRITON_DTYPE[self.spec.dtype]
        over = "  OVER THE SM_90 SHARED-MEMORY LIMIT" if self.shared_bytes > SM90_MAX_SHARED else ""
        if self.wgmma and not self.spec.allow_wgmma:
            over += "  USES WGMMA"
        return (
            f"{self.spec.name:28s} {dtype} warps={self.spec.launch.warps} regs={self.registers} "
            f"spilled={self.spilled_bytes}B shared={self.shared_bytes}B wgmma={self.wgmma}{over}"
        )


def _ptxas() -> str:
    import triton

    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):  # the newest reads the PTX this Triton emits
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError("no ptxas bundled with triton")


def compile_for_hopper(spec: Specialisation) -> Compiled:
    """Compile one specialisation for sm_90 and read its resource use from ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = spec.launch
    options = {"num_warps": launch.warps}
    if launch.stages is not None:
        options["num_stages"] = launch.stages
    source = ASTSource(launch.kernel, signature=spec.signature(), constexprs=launch.constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return Compiled(
        spec,
        int(registers.group(1)) if registers else None,
        int(spilled.group(1)) if spilled else None,
        compiled.metadata.shared,
        compiled.asm["ptx"].count("wgmma.mma_async"),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    failures = 0
    for op in args.ops:
        module, arguments = SPECIALISATIONS[op]
        for spec in importlib.import_module(module).hopper_specialisations(**arguments):
            try:
                compiled = compile_for_hopper(spec)
            except Exception as error:  # report every failure, not just the first
                failures += 1
                print(f"{op:15s} {spec.name:28s} FAILED: {error!r:.300}", flush=True)
                continue
            failures += not compiled.ok
            print(f"{op:15s} {compiled.line()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
