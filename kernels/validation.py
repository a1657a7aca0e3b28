"""Input checks shared by every kernel: the one place that validates kernel inputs.

Each check raises before any kernel launches, with a message that names the op, the
argument and the expected shape, e.g.

    causal_conv1d_fn: weight must have shape (D, W) = (64, W), got (32, 4) (D: 32 != 64)
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# float64 runs on the PyTorch path only (used by gradcheck); Triton kernels take the three above.
TORCH_DTYPES = (torch.float64, *FLOAT_DTYPES)


def allowed_dtypes(backend: str) -> tuple[torch.dtype, ...]:
    return FLOAT_DTYPES if backend == "triton" else TORCH_DTYPES


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t: object,
    dims: str,
    sizes: dict[str, int],
    dtypes: tuple[torch.dtype, ...] = TORCH_DTYPES,
    optional: bool = False,
) -> None:
    """Check that `t` is a tensor of shape `dims` (space-separated names, e.g. "B D L"), or
    None when the argument is `optional`.

    `sizes` maps dimension names to sizes already known from other arguments; sizes of names
    not yet in `sizes` are read off `t` and added, so later checks can compare against them.
    """
    if optional and t is None:
        return
    names = dims.split()
    layout = "(" + ", ".join(names) + ")"
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{op}: {name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}"
        )
    if t.dtype not in dtypes:
        raise TypeError(
            f"{op}: {name} has dtype {str(t.dtype).removeprefix('torch.')}; "
            f"expected one of {_dtype_names(dtypes)}"
        )
    if t.dim() != len(names):
        raise ValueError(
            f"{op}: {name} must have shape {layout}, "
            f"got a {t.dim()}-d tensor of shape {tuple(t.shape)}"
        )
    mismatches = [
        f"{n}: {got} != {sizes[n]}"
        for n, got in zip(names, t.shape, strict=True)
        if n in sizes and sizes[n] != got
    ]
    if mismatches:
        expected = "(" + ", ".join(str(sizes.get(n, n)) for n in names) + ")"
        raise ValueError(
            f"{op}: {name} must have shape {layout} = {expected}, got {tuple(t.shape)} "
            f"({'; '.join(mismatches)})"
        )
    for n, got in zip(names, t.shape, strict=True):
        sizes.setdefault(n, got)


def check_tensor_layouts(
    op: str,
    name: str,
    t: object,
    layouts: tuple[str, ...],
    sizes: dict[str, int],
    dtypes: tuple[torch.dtype, ...] = TORCH_DTYPES,
) -> str:
    """Check `t` against whichever of several layouts (of distinct ranks) its rank selects.

    E.g. layouts ("D N", "B N L", "B G N L") for Mamba's B; returns the layout that matched.
    """
    by_rank = {len(dims.split()): dims for dims in layouts}
    if isinstance(t, torch.Tensor) and t.dim() not in by_rank:
        listed = " or ".join("(" + ", ".join(dims.split()) + ")" for dims in layouts)
        raise ValueError(
            f"{op}: {name} must have shape {listed}, "
            f"got a {t.dim()}-d tensor of shape {tuple(t.shape)}"
        )
    dims = by_rank[t.dim()] if isinstance(t, torch.Tensor) else layouts[0]
    check_tensor(op, name, t, dims, sizes, dtypes)
    return dims


def check_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (None skipped) live on one device; return it."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {listed}")
    return first


def check_batch(op: str, name: str, batch: int) -> None:
    """Every op refuses an empty batch alike (docs/kernels.md, "Inputs every op refuses")."""
    if batch < 1:
        raise ValueError(f"{op}: {name} must have at least one sequence (batch B >= 1), got B = 0")


def refuse_complex(op: str, **tensors: object) -> None:
    """mamba-ssm's complex A (and complex B, C) is refused by name: docs/kernels.md says why."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_complex():
            dtype = str(t.dtype).removeprefix("torch.")
            raise TypeError(
                f"{op}: {name} is complex ({dtype}); complex A, B and C (mamba-ssm's complex "
                "SSMs) are not supported: every state here is real (docs/kernels.md)"
            )


def check_choice(op: str, name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {choices}, got {value!r}")


def check_range(op: str, name: str, value: int, low: int, high: int) -> None:
    if not (low <= value <= high):
        raise ValueError(f"{op}: {name} must be between {low} and {high}, got {value}")


def check_positions(
    op: str,
    positions: object,
    batch: int,
    length: int,
    device: torch.device,
    name: str = "states_at",
) -> torch.Tensor:
    """`states_at` (or `name`): a (B, P) integer tensor of positions in [0, length), returned
    on `device` as int64."""
    bad_type = not isinstance(positions, torch.Tensor) or (
        positions.dtype == torch.bool or positions.dtype.is_floating_point
    )
    if bad_type or positions.dim() != 2 or positions.shape[0] != batch:
        raise ValueError(
            f"{op}: {name} must be a (B, P) = ({batch}, P) integer tensor of positions, "
            f"got {getattr(positions, 'dtype', type(positions).__name__)} of shape "
            f"{tuple(getattr(positions, 'shape', ()))}"
        )
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= length):
        raise ValueError(
            f"{op}: {name} must lie in [0, {length - 1}], got values in "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    return positions.to(device=device, dtype=torch.long)


def one_per_row(
    op: str, name: str, positions: object, batch: int, length: int, device: torch.device
) -> torch.Tensor:
    """A (B,) integer tensor of positions in [0, length) (one per batch row), returned on
    `device` as int64."""
    integer = isinstance(positions, torch.Tensor) and not (
        positions.dtype == torch.bool or positions.dtype.is_floating_point
    )
    if not integer or positions.dim() != 1 or positions.shape[0] != batch:
        raise ValueError(
            f"{op}: {name} must be a (B,) = ({batch},) integer tensor of positions, got "
            f"{getattr(positions, 'dtype', type(positions).__name__)} of shape "
            f"{tuple(getattr(positions, 'shape', ()))}"
        )
    return check_positions(op, positions[:, None], batch, length, device, name)[:, 0]


def check_state_patch(
    op: str, state_patch: object, state_shape: tuple[int, ...], length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`state_patch`: a (positions (B,), values (B, *state)) tuple; returns the positions on
    `device` as int64, and the values."""
    if not isinstance(state_patch, tuple) or len(state_patch) != 2:
        raise ValueError(f"{op}: state_patch must be a (positions, values) tuple")
    positions, values = state_patch
    batch = state_shape[0]
    at = one_per_row(op, "state_patch positions", positions, batch, length, device)
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(state_shape):
        raise ValueError(
            f"{op}: state_patch values must have shape {tuple(state_shape)}, got "
            f"{tuple(getattr(values, 'shape', ()))}"
        )
    return at, values


def refuse_unsupported(op: str, **arguments: tuple[object, object]) -> None:
    """Peer arguments mecheval accepts by name but does not implement: name -> (value, the
    value that works). Anything else is refused by name."""
    for name, (value, default) in arguments.items():
        if value is default or (not isinstance(value, torch.Tensor) and value == default):
            continue
        shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(
            f"{op}: {name}={shown} is not supported (pass {default!r}): mecheval's ops run "
            "equal-length sequences in the (batch, ...) layout"
        )
