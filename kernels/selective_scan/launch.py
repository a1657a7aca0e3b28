"""Host side of the selective scan's Triton kernels: block sizes and grid, launches, the
backward's fixed-order reductions, and the launch configurations the Hopper compile check
compiles."""

from __future__ import annotations

import math

import torch
import triton

from mecheval_kernels._launch import Launch
from mecheval_kernels.selective_scan.backward import scan_bwd_kernel
from mecheval_kernels.selective_scan.forward import scan_fwd_kernel
from mecheval_kernels.selective_scan.op import ScanArgs

# A (BLOCK_D, N_PAD, CHUNK) register tile of 4096 elements, chunks of at most 16 positions: at
# N = 16 on sm_90 both kernels then compile without spills, the backward at 8 warps (4 spill).
TILE_ELEMENTS = 4096
MAX_CHUNK = 16  # positions per chunk (and between checkpoints)
WARPS = {"forward": 4, "backward": 8}
KERNELS = {"forward": scan_fwd_kernel, "backward": scan_bwd_kernel}
# The compile-time options of each kernel (HAS_DLAST: the backward only).
OPTIONS = ("B_VAR", "C_VAR", "HAS_D", "HAS_Z", "HAS_BIAS", "HAS_INIT", "HAS_DLAST", "SOFTPLUS")


def _chunk(state: int, length: int) -> int:
    n_pad = max(2, triton.next_power_of_2(state))
    chunk = min(MAX_CHUNK, max(2, triton.next_power_of_2(length)))
    return max(2, min(chunk, TILE_ELEMENTS // (2 * n_pad)))


def num_checkpoints(batch: int, channels: int, state: int, length: int) -> int:
    """Number of chunk-start states the forward saves for the backward."""
    return triton.cdiv(length, _chunk(state, length))


def _groups(X: torch.Tensor) -> int:
    return X.shape[1] if X.dim() == 4 else 1


class Plan:
    """Block sizes and grid of one call: channels in segments that share one group of B and
    one of C, each in blocks of BLOCK_D channels."""

    def __init__(self, batch: int, channels: int, state: int, length: int, gb: int, gc: int):
        self.chunk = _chunk(state, length)
        self.n_pad = max(2, triton.next_power_of_2(state))
        self.num_chunks = triton.cdiv(length, self.chunk)
        segments = math.lcm(gb, gc)
        self.seg = channels // segments
        block = TILE_ELEMENTS // (self.n_pad * self.chunk)
        self.block_d = max(2, min(triton.next_power_of_2(self.seg), block))
        self.blocks_per_seg = triton.cdiv(self.seg, self.block_d)
        self.grid = (segments * self.blocks_per_seg, batch)

    def launch(self, kernel_pass: str, on: set[str]) -> Launch:
        """The launch of one pass ("forward" or "backward") with the options in `on`."""
        kernel = KERNELS[kernel_pass]
        constants = dict(BLOCK_D=self.block_d, N_PAD=self.n_pad, CHUNK=self.chunk)
        constants.update({o: o in on for o in OPTIONS if o in kernel.arg_names})
        return Launch(kernel, constants, WARPS[kernel_pass])


def _bc_args(X: torch.Tensor, channels: int) -> tuple[int, ...]:
    """(channels per group, stride of batch, of group, then the two the kernel walks)."""
    if X.dim() == 2:  # (D, N): walked along (d, n)
        return (channels, 0, 0, X.stride(0), X.stride(1))
    if X.dim() == 3:  # (B, N, L): one group
        return (channels, X.stride(0), 0, X.stride(1), X.stride(2))
    return (channels // X.shape[1], X.stride(0), X.stride(1), X.stride(2), X.stride(3))


def _strides(t: torch.Tensor | None, n: int = 3) -> tuple[int, ...]:
    return (0,) * n if t is None else t.stride()


def _plan(a: ScanArgs) -> Plan:
    return Plan(*a.u.shape[:2], a.A.shape[1], a.u.shape[2], _groups(a.B), _groups(a.C))


def _options(a: ScanArgs) -> set[str]:
    present = dict(HAS_D=a.D, HAS_Z=a.z, HAS_BIAS=a.delta_bias, HAS_INIT=a.initial_state)
    on = {name for name, t in present.items() if t is not None}
    on |= {name for name, X in (("B_VAR", a.B), ("C_VAR", a.C)) if X.dim() > 2}
    return on | ({"SOFTPLUS"} if a.softplus else set())


def _inputs(a: ScanArgs, plan: Plan) -> tuple:
    """The kernels' leading arguments: inputs, sizes, strides (absent tensors: any valid
    pointer, never read: the flags are compile-time)."""
    batch, channels, length = a.u.shape
    gb_per, *b_strides = _bc_args(a.B, channels)
    gc_per, *c_strides = _bc_args(a.C, channels)
    return (
        *(a.u, a.delta, a.A, a.B, a.C),
        a.A if a.D is None else a.D,
        a.u if a.z is None else a.z,
        a.A if a.delta_bias is None else a.delta_bias,
        *(channels, a.A.shape[1], length, plan.num_chunks, plan.seg, plan.blocks_per_seg),
        *(gb_per, gc_per, *a.u.stride(), *a.delta.stride(), *a.A.stride()),
        *(*b_strides, *c_strides, *_strides(a.D, 1), *_strides(a.z), *_strides(a.delta_bias, 1)),
    )


def forward(a: ScanArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, D, L) in u's dtype and layout, last_state (B, D, N), checkpoints (K, B, D, N));
    K = 0 when not `save_checkpoints` (the kernel writes them regardless)."""
    batch, channels, length = a.u.shape
    N = a.A.shape[1]
    plan = _plan(a)
    f32 = dict(dtype=torch.float32, device=a.u.device)
    out = torch.empty_like(a.u)
    last = torch.empty(batch, channels, N, **f32)
    ckpt = torch.empty(plan.num_chunks, batch, channels, N, **f32)
    init = a.initial_state
    plan.launch("forward", _options(a))(
        plan.grid,
        *_inputs(a, plan),
        last if init is None else init,
        out,
        last,
        ckpt,
        *_strides(init),
        *out.stride(),
    )
    if not a.save_checkpoints:
        ckpt = ckpt.new_empty(0, *ckpt.shape[1:])
    return out, last, ckpt


def _reduce_bc(part: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A B or C gradient from its per-program partials, summed in a fixed order."""
    if X.dim() == 2:  # (batch, D, N) partials
        return part.sum(0)
    batch, programs, N, L = part.shape  # programs ordered by group
    grad = part.view(batch, _groups(X), programs // _groups(X), N, L).sum(2)
    return grad[:, 0] if X.dim() == 3 else grad


def backward(a: ScanArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); None for absent
    inputs."""
    (dout, dlast), (checkpoints,) = grads, saved
    batch, channels, length = a.u.shape
    N = a.A.shape[1]
    plan = _plan(a)
    f32 = dict(dtype=torch.float32, device=a.u.device)
    du = torch.empty_like(a.u)
    ddelta = torch.empty_like(a.delta)
    dz = None if a.z is None else torch.empty_like(a.z)
    dinit = None if a.initial_state is None else torch.empty(batch, channels, N, **f32)
    dA_part = torch.empty(batch, channels, N, **f32)
    dD_part = None if a.D is None else torch.empty(batch, channels, **f32)
    dbias_part = None if a.delta_bias is None else torch.empty(batch, channels, **f32)

    def bc_part(X):
        if X.dim() == 2:
            return torch.empty(batch, channels, N, **f32)
        return torch.empty(batch, plan.grid[0], N, length, **f32)

    dB_part, dC_part = bc_part(a.B), bc_part(a.C)
    on = _options(a) | ({"HAS_DLAST"} if dlast is not None else set())
    plan.launch("backward", on)(
        plan.grid,
        *_inputs(a, plan),
        checkpoints,
        dout,
        dA_part if dlast is None else dlast,
        du,
        ddelta,
        du if dz is None else dz,
        *(dA_part if t is None else t for t in (dinit, dA_part, dD_part, dbias_part)),
        dB_part,
        dC_part,
        *dout.stride(),
        *_strides(dlast),
        *du.stride(),
        *ddelta.stride(),
        *_strides(dz),
    )
    return [
        du,
        ddelta,
        dA_part.sum(0),
        _reduce_bc(dB_part, a.B),
        _reduce_bc(dC_part, a.C),
        None if dD_part is None else dD_part.sum(0),
        dz,
        None if dbias_part is None else dbias_part.sum(0),
        dinit,
    ]


# Pointer arguments that are float32 whatever the input dtype (A, D and delta_bias as Mamba
# keeps them, states, checkpoints, partial sums).
FLOAT32_POINTERS = frozenset(
    {
        "A_ptr",
        "Dv_ptr",
        "bias_ptr",
        "init_ptr",
        "last_ptr",
        "ckpt_ptr",
        "dlast_ptr",
        "dinit_ptr",
        "dA_part_ptr",
        "dD_part_ptr",
        "dbias_part_ptr",
        "dB_part_ptr",
        "dC_part_ptr",
    }
)


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see mecheval_kernels.compile_check):
    both kernels at the plans of N = 16, 64 and 256 and of the smallest call, every option on, off
    and mixed, all three dtypes."""
    from mecheval_kernels.compile_check import Specialisation

    specs = []
    for dtype, (channels, state, length), on in (
        (torch.bfloat16, (1024, 16, 4096), OPTIONS),
        (torch.float32, (1024, 16, 4096), ("HAS_D", "HAS_BIAS", "SOFTPLUS")),
        (torch.float16, (1024, 64, 4096), ("B_VAR", "HAS_Z", "HAS_INIT", "HAS_DLAST")),
        (torch.float32, (1024, 256, 4096), OPTIONS),
        (torch.bfloat16, (1, 1, 1), ()),
    ):
        plan = Plan(1, channels, state, length, 1, 1)
        for kernel_pass in KERNELS:
            launch = plan.launch(kernel_pass, set(on))
            specs.append(Specialisation(launch, dtype, float32_pointers=FLOAT32_POINTERS))
    return specs
