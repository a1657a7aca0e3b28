"""The scaffold every op is built on: backend choice, dtype rules, the validation entry, custom-op
and autograd registration. An op supplies the rest (see `Op`).

An op's inputs travel as one named tuple (its `Args`), from the public function through the
custom ops to each implementation:

    forward(a: Args) -> tuple of outputs (None for an absent one)
    backward(a: Args, grads, saved) -> one gradient per tensor field of Args (None: absent)

where `grads` are the gradients of the differentiable outputs and `saved` the outputs kept for
the backward. An op's implementations are modules of the package it names (its own, or the
one its family shares): `torch_path` (the PyTorch path) and `launch` (the Triton kernels' host
code), imported on first use, so `triton` is imported only when it runs.
"""

from __future__ import annotations

import importlib
import types
import typing
from collections.abc import Callable

import torch

from mecheval_kernels.backend import resolve_backend
from mecheval_kernels.layout import match_layout
from mecheval_kernels.stacking import is_batched
from mecheval_kernels.validation import allowed_dtypes, check_same_device, check_tensor

_SCHEMA_TYPES = {
    torch.Tensor: "Tensor",
    torch.Tensor | None: "Tensor?",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
}
MODULES = {"torch": "torch_path", "triton": "launch"}


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype an op computes and keeps its states in: float32, or float64 for float64 inputs
    (the PyTorch path accepts them, for gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def needs_grad(a: tuple) -> bool:
    """Whether autograd will ask for a backward of a call on these arguments."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in a
    )


def _custom_op(name: str, fn: Callable, fake: Callable, inputs: list[str], outputs: int):
    returns = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    op = torch.library.custom_op(
        name, fn, mutates_args=(), schema=f"({', '.join(inputs)}) -> {returns}"
    )
    op.register_fake(fake)
    return op


class Op:
    """One op: its forward and backward custom ops (`mecheval_kernels::<name>_fwd`, `_bwd`) and the
    autograd glue between them.

    Args:
        package: the package whose modules implement the op (`torch_path`, `launch`).
        public: the public function's name, which error messages start with.
        args: the op's `Args` named tuple; its annotations (torch.Tensor, torch.Tensor | None,
            bool, int, float, str) give the custom ops' schemas.
        first: the layout of the public function's first argument ("B D L"): it is checked
            first, so that a call whose first argument is not a tensor is refused by name.
        validate: validate(dtypes, **arguments) raises on bad input; `dtypes` are those the
            chosen backend takes.
        fake: fake(a, backend) -> the forward's outputs as empty tensors (for torch.compile).
        outputs: how many outputs the forward returns, of which the last `saved` are buffers
            for the backward (not differentiable).
        fold: how the op runs under `torch.vmap` (stacked models): see mecheval_kernels.stacking.
        name: the custom ops' name (`mecheval_kernels::<name>_fwd`); None: the package's last part
            (ops that share their implementations, as the delta-rule family's, name theirs apart).
        twice: twice(a) -> the differentiable outputs, recomputed in plain PyTorch (the op's
            reference form) for second derivatives: when a backward is itself differentiated
            (create_graph), the gradients come from autograd through it. None: second
            derivatives are refused by name.
    """

    def __init__(
        self, package, public, args, first, validate, fake, outputs, saved, fold, name=None,
        twice=None,
    ):  # fmt: skip
        self.package, self.public, self.args, self.first = package, public, args, first
        self.validate, self.fake_forward, self.fold, self.twice = validate, fake, fold, twice
        self.outputs, self.saved = outputs, saved
        hints = typing.get_type_hints(args)
        fields = [f"{_SCHEMA_TYPES[hints[f]]} {f}" for f in args._fields] + ["str backend"]
        self.tensors = [f for f in args._fields if hints[f] in (torch.Tensor, torch.Tensor | None)]
        grads = [f"Tensor? grad{i}" for i in range(outputs - saved)]
        kept = [f"Tensor saved{i}" for i in range(saved)]
        name = f"mecheval_kernels::{name or package.rsplit('.', 1)[-1]}"
        self._fwd = _custom_op(f"{name}_fwd", self._forward, self._fake_forward, fields, outputs)
        self._bwd = _custom_op(
            f"{name}_bwd",
            self._backward,
            self._fake_backward,
            grads + kept + fields,
            len(self.tensors),
        )
        self._fwd.register_autograd(self._autograd_backward, setup_context=self._setup_context)
        self._fwd.register_vmap(self._vmap)

    def implementation(self, backend: str) -> types.ModuleType:
        return importlib.import_module(f"{self.package}.{MODULES[backend]}")

    def check(self, backend: str | None, **arguments: object) -> str:
        """The validation entry of the public function: its first argument is a tensor of layout
        `first`, every tensor lies on one device, and `validate` accepts the arguments for the
        backend that runs them; returns that backend ("triton" or "torch")."""
        name, value = next(iter(arguments.items()))
        check_tensor(self.public, name, value, self.first, {})
        tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
        chosen = resolve_backend(self.public, backend, check_same_device(self.public, **tensors))
        self.validate(allowed_dtypes(chosen), **arguments)
        return chosen

    def __call__(self, a: tuple, backend: str) -> tuple[torch.Tensor, ...]:
        """The forward's outputs (placeholders for absent ones): through the custom op under
        torch.compile, else straight from the implementation, with the same autograd glue when
        a backward will run (the custom ops' dispatch costs tens of microseconds a call, their
        backward hundreds). Under `torch.vmap` the custom op's vmap rule runs it (`_vmap`)."""
        if torch.compiler.is_compiling() or any(is_batched(t) for t in a):
            outputs = self._fwd(*a, backend)
        elif needs_grad(a):
            outputs = _Eager.apply(self, backend, *a)
        else:
            outputs = self._forward(*a, backend)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    def runs_plain(self, a: tuple) -> bool:
        """Whether a call on `a` runs eagerly with no backward to come (not compiled, not under
        `torch.vmap`, no gradient): an implementation may then skip its saved buffers."""
        return self.eager(a) and not needs_grad(a)

    @staticmethod
    def eager(a: tuple) -> bool:
        """Whether a call on `a` runs eagerly: not compiled, not under `torch.vmap`."""
        return not (torch.compiler.is_compiling() or any(is_batched(t) for t in a))

    def _vmap(self, info, in_dims, *inputs):
        """The vmap rule: one call on the inputs with the model axis folded in (see
        mecheval_kernels.stacking), its outputs unfolded."""
        a = self.args(*inputs[:-1])
        folded, unfold = self.fold(a, self.args(*in_dims[:-1]), info.batch_size)
        outputs = self._fwd(*folded, inputs[-1])
        pairs = [unfold(i, t) for i, t in enumerate(outputs)]
        return tuple(t for t, _ in pairs), tuple(d for _, d in pairs)

    def _placeholders(self, a: tuple, outputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # Custom ops return tensors only: an absent output is an empty placeholder (one each:
        # outputs may not alias).
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        dtype = compute_dtype(a[0])
        outputs = tuple(a[0].new_empty(0, dtype=dtype) if t is None else t for t in outputs)
        return outputs[0] if self.outputs == 1 else outputs

    def _forward(self, *inputs):
        a = self.args(*inputs[:-1])
        return self._placeholders(a, self.implementation(inputs[-1]).forward(a))

    def _fake_forward(self, *inputs):
        a = self.args(*inputs[:-1])
        return self._placeholders(a, self.fake_forward(a, inputs[-1]))

    def _split(self, inputs: tuple) -> tuple[tuple, tuple, tuple, str]:
        """The backward op's inputs: (output gradients, saved outputs, Args, backend)."""
        n, kept = self.outputs, self.saved
        return inputs[: n - kept], inputs[n - kept : n], self.args(*inputs[n:-1]), inputs[-1]

    def _backward(self, *inputs):
        grads, saved, a, backend = self._split(inputs)
        result = self.implementation(backend).backward(a, grads, saved)
        out = []
        for name, grad in zip(self.tensors, result, strict=True):
            t = getattr(a, name)
            # Each gradient in its input's dtype and in the strides of torch.empty_like(input),
            # as the fake declares; an absent input gets a distinct empty placeholder.
            out.append(a[0].new_empty(0) if grad is None else match_layout(grad, t, t.dtype))
        return tuple(out)

    def _fake_backward(self, *inputs):
        a = self._split(inputs)[2]
        ts = [getattr(a, name) for name in self.tensors]
        return tuple(a[0].new_empty(0) if t is None else torch.empty_like(t) for t in ts)

    def _setup_context(self, ctx, inputs, output):
        saved = output[self.outputs - self.saved :] if self.saved else ()
        ctx.mark_non_differentiable(*saved)
        a = self.args(*inputs[:-1])
        ctx.save_for_backward(*[getattr(a, name) for name in self.tensors], *saved)
        ctx.others = {f: v for f, v in a._asdict().items() if f not in self.tensors}
        ctx.backend = inputs[-1]

    def _autograd_backward(self, ctx, *grads, eager: bool = False):
        n = len(self.tensors)
        tensors, saved = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        a = self.args(**dict(zip(self.tensors, tensors, strict=True)), **ctx.others)
        if torch.is_grad_enabled():  # create_graph: this backward will be differentiated
            return self._differentiable_backward(a, grads[: self.outputs - self.saved])
        backward = self._backward if eager else self._bwd
        result = backward(*grads[: self.outputs - self.saved], *saved, *a, ctx.backend)
        by_name = {
            f: g for f, t, g in zip(self.tensors, tensors, result, strict=True) if t is not None
        }
        # Absent inputs, non-tensor arguments and the backend get no gradient.
        return (*(by_name.get(f) for f in a._fields), None)

    def _differentiable_backward(self, a: tuple, grads: tuple) -> tuple:
        """The gradients as autograd gives them through `twice` (the reference form), with a
        graph of their own: second derivatives."""
        if self.twice is None:
            raise RuntimeError(
                f"{self.public}: second derivatives (a backward with create_graph=True) are "
                "not supported"
            )
        wanted = [f for f in self.tensors if getattr(a, f) is not None]
        wanted = [f for f in wanted if getattr(a, f).requires_grad]
        pairs = [
            (out, grad)
            for out, grad in zip(self.twice(a), grads, strict=True)
            if out is not None and grad is not None and out.requires_grad
        ]
        if not wanted or not pairs:
            return (None,) * (len(a._fields) + 1)
        result = torch.autograd.grad(
            [out for out, _ in pairs],
            [getattr(a, f) for f in wanted],
            [grad for _, grad in pairs],
            create_graph=True,
            allow_unused=True,
        )
        by_name = dict(zip(wanted, result, strict=True))
        return (*(by_name.get(f) for f in a._fields), None)


class _Eager(torch.autograd.Function):
    """An op's autograd in eager mode: the custom ops' glue, calling the implementation
    directly (its context set up apart from the forward, as functorch's vmap requires)."""

    @staticmethod
    def forward(op: Op, backend: str, *inputs):
        return op._forward(*inputs, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, backend, *rest = inputs
        op._setup_context(ctx, (*rest, backend), output)
        ctx.op = op

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.op._autograd_backward(ctx, *grads, eager=True)[:-1])
