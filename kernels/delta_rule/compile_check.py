"""Compile the delta-rule Triton kernels for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter accepts code that the GPU compiler rejects, and says nothing about
registers or shared memory. This compiles every kernel specialisation that the host code
launches for a given head size and dtype (the same launch configurations) down to a cubin
with the ptxas that ships with Triton, and reports registers, spilled bytes and shared
memory. A kernel whose shared memory exceeds what one Hopper block may use would fail to
launch on the GPU. It also counts the wgmma instructions in each kernel and fails if there are
any: with Triton 3.6 on an H200 these kernels' wgmma lowerings read shared memory out of bounds
(see `triton_kernels.chunk_size`), so every product must stay on mma.sync (at most 32 rows).

    python -m kernels.delta_rule.compile_check [--heads 64x64 128x128 ...] [--dtypes ...]

Run it with TRITON_INTERPRET unset (under the interpreter `triton.jit` builds no compilable
kernels).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.delta_rule import triton_kernels as tk

# Largest shared memory one block may use on sm_90 (H100/H200): 227 KiB.
SM90_MAX_SHARED = 232448
TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Pointers to float32 buffers whatever the input dtype (states, u rows, partial sums).
FLOAT32_POINTERS = {
    "init_ptr",
    "final_ptr",
    "h_ptr",
    "u_ptr",
    "dfinal_ptr",
    "dinit_ptr",
    "dh_ptr",
    "dr_ptr",
    "du_ptr",
    "dq_part_ptr",
    "dk_part_ptr",
    "dbeta_part_ptr",
}


@dataclass
class Compiled:
    kernel: str
    constants: dict
    warps: int
    registers: int | None
    spilled_bytes: int | None
    shared_bytes: int
    wgmma: int  # wgmma instructions in the PTX (must be 0, see the module docstring)


def specialisations(K: int, V: int, dtype: torch.dtype, programs: int = 64) -> list[tuple]:
    """(kernel, constexprs, num_warps, num_stages) for every launch of forward/backward."""
    C = tk.chunk_size(K, dtype)
    ieee = dtype == torch.float32
    rec = tk.recurrent_launch(K, V, programs)
    state = tk.state_launch(K, V, dtype, programs)
    out = tk.output_launch(K, V, dtype)
    grad = tk.grad_launch(K, V, dtype)
    both = dict(HAS_INIT=True, STORE_FINAL=True)
    return [
        (
            tk._chunk_inverse_kernel,
            dict(C=C, SB=tk.SUB_BLOCK, BK=min(tk._pow2(K), 64), IEEE=ieee),
            tk.INVERSE_WARPS,
            None,
        ),
        (
            tk._chunk_state_fwd_kernel,
            dict(C=C, BK=state.BK, BV=state.BV, **both, IEEE=ieee),
            state.warps,
            None,
        ),
        (
            tk._chunk_output_kernel,
            dict(C=C, BK=out.BK, BV=out.BV, IEEE=ieee),
            out.warps,
            None,
        ),
        (
            tk._chunk_state_bwd_kernel,
            dict(C=C, BK=state.BK, BV=state.BV, HAS_DFINAL=True, STORE_DINIT=True, IEEE=ieee),
            state.warps,
            None,
        ),
        (
            tk._chunk_grad_kernel,
            dict(C=C, BK=grad.BK, BV=grad.BV, IEEE=ieee),
            grad.warps,
            1,
        ),
        (tk._recurrent_fwd_kernel, dict(BK=rec.BK, BV=rec.BV, **both), rec.warps, None),
        (
            tk._recurrent_bwd_kernel,
            dict(BK=rec.BK, BV=rec.BV, HAS_INIT=True, HAS_DFINAL=True, STORE_DINIT=True),
            rec.warps,
            None,
        ),
    ]


def _signature(fn, constants: dict, dtype: torch.dtype) -> dict[str, str]:
    elem = TRITON_DTYPE[dtype]
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in FLOAT32_POINTERS else f"*{elem}"
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return signature


def _ptxas() -> str:
    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The newest bundled ptxas reads the PTX version this Triton emits.
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(nvidia, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError("no ptxas bundled with triton")


def compile_sm90(fn, constants: dict, dtype: torch.dtype, warps: int, stages=None) -> Compiled:
    """Compile one specialisation for sm_90 and read its resource use."""
    options = {"num_warps": warps}
    if stages is not None:
        options["num_stages"] = stages
    source = ASTSource(fn, signature=_signature(fn, constants, dtype), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    registers = spilled = None
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    if found := re.search(r"Used (\d+) registers", report):
        registers = int(found.group(1))
    if found := re.search(r"(\d+) bytes spill stores", report):
        spilled = int(found.group(1))
    wgmma = compiled.asm["ptx"].count("wgmma.mma_async")
    return Compiled(
        fn.__name__, constants, warps, registers, spilled, compiled.metadata.shared, wgmma
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="*", default=["16x16", "64x64", "128x128", "256x256"])
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "fp16", "bf16"])
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    by_name = {v: k for k, v in TRITON_DTYPE.items()}
    bad = 0
    for head in args.heads:
        K, V = (int(x) for x in head.split("x"))
        for name in args.dtypes:
            dtype = by_name[name]
            for fn, constants, warps, stages in specialisations(K, V, dtype):
                c = compile_sm90(fn, constants, dtype, warps, stages)
                over = c.shared_bytes > SM90_MAX_SHARED
                bad += over or c.wgmma > 0
                print(
                    f"K={K:3d} V={V:3d} {name} {c.kernel:26s} warps={warps} "
                    f"regs={c.registers} spilled={c.spilled_bytes}B shared={c.shared_bytes}B "
                    f"wgmma={c.wgmma}"
                    + ("  OVER THE SM_90 LIMIT" if over else "")
                    + ("  USES WGMMA" if c.wgmma else ""),
                    flush=True,
                )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
