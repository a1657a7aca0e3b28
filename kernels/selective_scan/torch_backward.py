"""The backward of the selective scan's PyTorch path for one tile of rows (torch_path.backward
runs the tiles and gathers their gradients).

It walks the chunks in reverse: it recomputes each chunk's states from the checkpoint the forward
saved, runs the adjoint recurrence backwards (dh_t = g_t C_t + exp(dt_{t+1} A) dh_{t+1}) and
forms every gradient from the two.
"""

from __future__ import annotations

import torch

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.selective_scan.op import ScanArgs
from mecheval_kernels.selective_scan.torch_chunk import (
    LOG2E,
    chunk_buffers,
    chunk_inputs,
    chunk_of,
    from_time_major_bdl,
    inner,
    outer,
    scan_chunk,
    sum_last,
    time_major,
)


def _grad(w: torch.Tensor, states: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Gradient of X's chunk when the (T, B, D, N) product was w * X * (adjoint) = w * states:
    summed over the channels that share it (and over T and B for a fixed X), in chunk_of's layout.
    """
    if X.dim() == 2:
        return (states * w[..., None]).sum((0, 1))
    T, batch, channels, N = states.shape
    groups = 1 if X.dim() == 3 else X.shape[1]
    per_group = w.reshape(T, batch, groups, 1, channels // groups) @ states.reshape(
        T, batch, groups, channels // groups, N
    )  # (T, B, G, 1, N)
    per_group = per_group.squeeze(3)
    return per_group[:, :, 0] if X.dim() == 3 else per_group


def _grad_buffer(Xt: torch.Tensor) -> torch.Tensor:
    """Where the gradient of a time-major B or C is gathered: (D, N) zeros, or (L, B, ...)."""
    return torch.zeros_like(Xt) if Xt.dim() == 2 else torch.empty_like(Xt)


def _add_grad(buffer: torch.Tensor, chunk_grad: torch.Tensor, t0: int, t1: int) -> None:
    if chunk_grad.dim() == 2:  # a fixed (D, N): summed over every chunk
        buffer += chunk_grad
    else:  # time-dependent: each chunk writes its own positions
        buffer[t0:t1] = chunk_grad


def backward_rows(args: ScanArgs, dout, dlast, checkpoints, T: int) -> list:
    """`backward` for one tile of rows, in chunks of T positions: the gradients in the compute
    dtype (those of B and C time-major), None for absent inputs."""
    compute = compute_dtype(args.u)
    u, B, C, D, z = args.u, args.B, args.C, args.D, args.z
    batch, channels, length = u.shape
    N = args.A.shape[1]
    x = chunk_inputs(args, compute)
    dt_t, u_t, A_c, B_c, C_c, u_c = x.dt_t, x.u_t, x.A, x.B_t, x.C_t, x.u
    A_log2 = A_c * LOG2E

    # g: the gradient of y = <h, C>, through the gate when there is one.
    g = dout.to(compute)
    if z is not None:
        z_c = z.to(compute)
        sig_z = torch.sigmoid(z_c)
        g = g * z_c * sig_z
        y_t = u.new_empty(length, batch, channels, dtype=compute)
    g_t = time_major(g)

    dA = torch.zeros_like(A_c)
    dB_t, dC_t = _grad_buffer(B_c), _grad_buffer(C_c)
    du_t = u.new_empty(length, batch, channels, dtype=compute)
    ddt_t = torch.empty_like(du_t)
    # The adjoint carried into each chunk from the one after it; the last state's gradient first.
    carry = u.new_zeros(batch, channels, N, dtype=compute) if dlast is None else dlast.to(compute)

    n_chunks = checkpoints.shape[0]
    a_buf, h_buf, dh_buf = chunk_buffers(3, T, u, N, compute)
    for c in reversed(range(n_chunks)):
        t0, t1 = c * T, min(length, (c + 1) * T)
        h0 = checkpoints[c]
        dt_c, u_c_t, g_c = dt_t[t0:t1], u_t[t0:t1], g_t[t0:t1]
        Bc, Cc = chunk_of(B_c, t0, t1), chunk_of(C_c, t0, t1)
        a, hs, dh = a_buf[: t1 - t0], h_buf[: t1 - t0], dh_buf[: t1 - t0]
        scan_chunk(dt_c, u_c_t, A_log2, Bc, B, h0, a, hs)
        if z is not None:
            y_t[t0:t1] = inner(hs, Cc, C)
        _add_grad(dC_t, _grad(g_c, hs, C), t0, t1)

        # The adjoint of the states, backwards through the chunk, from the later chunk's carry.
        outer(g_c, Cc, C, dh)
        dh[-1] += carry
        for i in range(dh.shape[0] - 2, -1, -1):
            dh[i].addcmul_(a[i + 1], dh[i + 1])
        carry = a[0] * dh[0]
        S = inner(dh, Bc, B)  # sum_n dh * B
        du_t[t0:t1] = dt_c * S
        _add_grad(dB_t, _grad(dt_c * u_c_t, dh, B), t0, t1)

        # P = dh_t * a_t * h_{t-1} (= dh_t * dh_t/d(dt_t A)), built in place in a.
        P = a
        P[1:].mul_(hs[:-1])
        P[0].mul_(h0)
        P.mul_(dh)
        ddt_t[t0:t1] = sum_last(torch.mul(P, A_c, out=hs)) + u_c_t * S  # hs is done with
        dA += P.mul_(dt_c[..., None]).sum((0, 1))

    du = from_time_major_bdl(du_t, u)
    dD = None
    if D is not None:
        du.addcmul_(D.to(compute)[:, None], g)
        dD = (g * u_c).sum((0, 2))
    ddt = from_time_major_bdl(ddt_t, args.delta)
    if args.softplus:
        ddt.mul_(torch.sigmoid(x.pre))
    ddelta_bias = ddt.sum((0, 2)) if args.delta_bias is not None else None
    dz = None
    if z is not None:
        gated = from_time_major_bdl(y_t, z)
        if D is not None:
            gated.addcmul_(D.to(compute)[:, None], u_c)
        dz = dout.to(compute) * gated * sig_z * (1 + z_c * (1 - sig_z))
    dinit = carry if args.initial_state is not None else None
    return [du, ddt, dA, dB_t, dC_t, dD, dz, ddelta_bias, dinit]
