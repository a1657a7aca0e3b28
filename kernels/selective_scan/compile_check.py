"""Compile the selective-scan Triton kernels for a Hopper GPU (sm_90) on a machine without one,
and report registers, spilled bytes and shared memory (ptxas -v).

The kernels hold (BLOCK_D, N_PAD, CHUNK) float32 tiles in registers; a change that adds a tile
or an exponential can push the backward (8 warps, at most 255 registers a thread) into
spilling. This compiles the tile sizes the host code picks for each state size N at a long
sequence and many channels, every option on (or, with --all-options, every combination of
options, 256 compiles per kernel and tile), with the ptxas that ships with Triton.

    python -m kernels.selective_scan.compile_check [--states 16 64 ...] [--dtypes ...]

Run it with TRITON_INTERPRET unset (under the interpreter `triton.jit` builds no compilable
kernels).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.selective_scan import triton_kernels as tk

OPTIONS = ("B_VAR", "C_VAR", "HAS_D", "HAS_Z", "HAS_BIAS", "HAS_INIT", "HAS_DLAST", "SOFTPLUS")


def tile(state: int, length: int = 1 << 16, channels: int = 1 << 12) -> dict:
    """The (BLOCK_D, N_PAD, CHUNK) the host code picks for this state size."""
    n_pad = max(2, triton.next_power_of_2(state))
    chunk = tk._chunk(state, length)
    block_d = max(2, min(triton.next_power_of_2(channels), tk.TILE_ELEMENTS // (n_pad * chunk)))
    return dict(BLOCK_D=block_d, N_PAD=n_pad, CHUNK=chunk)


def _ptxas() -> str:
    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(nvidia, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError("no ptxas bundled with triton")


def compile_sm90(kernel, constants: dict, dtype: str, warps: int) -> dict:
    """Compile one specialisation for sm_90; its registers, spilled bytes and shared memory."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in tk.FLOAT32_POINTERS else f"*{dtype}"
        else:
            signature[name] = "i32"
    compiled = triton.compile(
        ASTSource(kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run(
            [_ptxas(), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    found = {
        key: re.search(pattern, report)
        for key, pattern in (
            ("registers", r"Used (\d+) registers"),
            ("spill_stores", r"(\d+) bytes spill stores"),
            ("spill_loads", r"(\d+) bytes spill loads"),
        )
    }
    result = {k: int(m.group(1)) if m else None for k, m in found.items()}
    result["shared"] = compiled.metadata.shared
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", nargs="*", type=int, default=[16, 32, 64, 256])
    parser.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"])
    parser.add_argument("--all-options", action="store_true")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter builds no compilable kernels")
    spilling = 0
    kernels = ((tk._scan_fwd_kernel, tk.FORWARD_WARPS), (tk._scan_bwd_kernel, tk.BACKWARD_WARPS))
    for state, dtype, (kernel, warps) in itertools.product(args.states, args.dtypes, kernels):
        options = [o for o in OPTIONS if o in kernel.arg_names]
        combos = itertools.product((1, 0), repeat=len(options)) if args.all_options else [None]
        for values in combos:
            on = dict(zip(options, values or [1] * len(options), strict=True))
            c = compile_sm90(kernel, {**tile(state), **on}, dtype, warps)
            spilling += bool(c["spill_stores"] or c["spill_loads"])
            off = [o for o, v in on.items() if not v]
            print(
                f"N={state:3d} {dtype} {kernel.__name__:16s} {tile(state)} warps={warps} "
                f"regs={c['registers']} spilled={c['spill_stores']}/{c['spill_loads']}B "
                f"shared={c['shared']}B" + (f" off: {','.join(off)}" if off else ""),
                flush=True,
            )
    print(f"{spilling} specialisation(s) spill")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
