"""Architectures by name: one table from a name to the factory of its mixer.

    register_mixer("retnet", RetNet)                  a mixer of your own, by name
    architecture("retnet")                            -> Architecture
    architecture("mypackage.mixers:RetNet")           a mixer named by import path
    architecture("mamba+attention")                   a hybrid: the parts by layer, repeating

A factory (a `Mixer` subclass or a function returning a `Mixer`) is called as
`factory(d_model, **options)`, plus, when it takes them by name, `layer_idx` (the layer's index
in the model), `n_layers` and `l_max` (the model's sizing length). Its other keyword parameters
are the architecture's options, their defaults the factory's; an option the factory does not
take is refused by name (unless it takes **kwargs). Each entry also says which block wraps the
mixer ("transformer": norm, mixer, norm, MLP; "mamba": RMSNorm and mixer, no MLP, with
mamba-ssm's initialisation) and whether models of it get position embeddings by default.

An import path `module:attribute` names a factory (registered on the fly with the defaults:
a transformer block, no position embeddings) or the entry `register_mixer` returned (so a
module of yours can register with other settings and be named by path). The current directory
is searched too, as `python -m` would. Names are what configs, run folders and reports record:
a run trained on a registered name needs that registration in the process that loads it again;
an import path needs nothing.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

import mecheval
from mecheval.config import ConfigError
from mecheval.layers import Mixer

BLOCKS = ("transformer", "mamba")
# Arguments a factory may take besides its options, filled in by the model.
CONTEXT = ("layer_idx", "n_layers", "l_max")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class ArchitectureError(ConfigError):
    """An architecture that cannot be had in this process: a registered name unknown here, or
    the user's code behind it failing (UserCodeError); the message says what to do."""


class UserCodeError(ArchitectureError):
    """The user's code behind an architecture (an import path's module, a factory) raised: the
    message names their file and line, and the error."""


def _user_code_error(arch: str, what: str, error: BaseException) -> UserCodeError:
    """`error`, raised by `what` of arch `arch`, as the user's: at the innermost place of its
    traceback outside torch and mecheval (a SyntaxError: where the syntax is wrong)."""
    if isinstance(error, SyntaxError):
        place = f"{error.filename}, line {error.lineno}"
        reason = f"SyntaxError: {error.msg}"
    else:
        frames = traceback.extract_tb(error.__traceback__)
        ours = (Path(mecheval.__file__).parent, Path(torch.__file__).parent)
        theirs = [f for f in frames if not any(Path(f.filename).is_relative_to(d) for d in ours)]
        frame = (theirs or frames)[-1]
        place = f"{frame.filename}, line {frame.lineno}"
        reason = f"{type(error).__name__}: {error}"
    return UserCodeError(f"arch {arch!r}: {what} failed at {place}: {reason}")


@dataclass(frozen=True)
class MixerEntry:
    """One architecture's mixer: see the module docstring.

    Attributes:
        name: the name it is registered (or imported) under.
        factory: builds the mixer of one layer.
        block: "transformer" or "mamba".
        position_embeddings: whether its models get learned position embeddings by default.
        options: option -> default, from the factory's keyword parameters.
        open_options: the factory takes **kwargs (any option passes through).
        context: which of CONTEXT the factory takes.
    """

    name: str
    factory: Callable[..., Mixer]
    block: str
    position_embeddings: bool
    options: Mapping[str, object]
    open_options: bool
    context: frozenset[str]

    def build(self, d_model: int, layer_idx: int, n_layers: int, l_max: int, options) -> Mixer:
        """The mixer of layer `layer_idx`, with `options` (those it takes)."""
        context = {"layer_idx": layer_idx, "n_layers": n_layers, "l_max": l_max}
        kwargs = {k: v for k, v in context.items() if k in self.context}
        try:
            mixer = self.factory(d_model, **kwargs, **options)
        except (ValueError, TypeError):  # a factory's refusal of its options: a config error
            raise
        except Exception as error:  # noqa: BLE001  (whatever the user's code raises)
            raise _user_code_error(self.name, "its factory", error) from error
        if not isinstance(mixer, Mixer):
            raise TypeError(
                f"architecture {self.name!r}: its factory returned a {type(mixer).__name__}, "
                "not a mecheval.layers.Mixer (derive from it: a forward(x) is enough)"
            )
        return mixer

    def takes(self, option: str) -> bool:
        return self.open_options or option in self.options


def _entry(name: str, factory, block: str, position_embeddings: bool) -> MixerEntry:
    if not callable(factory):
        raise TypeError(f"the factory of mixer {name!r} must be callable, got {factory!r}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
    target = factory.__init__ if inspect.isclass(factory) else factory
    parameters = list(inspect.signature(target).parameters.values())
    if inspect.isclass(factory):
        parameters = parameters[1:]  # self
    kinds = inspect.Parameter
    positional = [
        p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    if not positional:
        raise TypeError(f"the factory of mixer {name!r} must take d_model as its first argument")
    options, context = {}, set()
    for p in parameters[1:]:
        if p.name in CONTEXT:
            context.add(p.name)
        elif p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY):
            if p.default is kinds.empty:
                raise TypeError(
                    f"the factory of mixer {name!r} takes {p.name!r} without a default: "
                    f"options need defaults (the model fills in only d_model and {CONTEXT})"
                )
            options[p.name] = p.default
    open_options = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    return MixerEntry(
        name,
        factory,
        block,
        bool(position_embeddings),
        MappingProxyType(options),
        open_options,
        frozenset(context),
    )


_REGISTRY: dict[str, MixerEntry] = {}


def register_mixer(
    name: str,
    factory: Callable[..., Mixer],
    *,
    block: str = "transformer",
    position_embeddings: bool = False,
    replace: bool = False,
) -> MixerEntry:
    """Register a mixer under `name` (see the module docstring) and return its entry.

    Args:
        name: letters, digits, "_", "." and "-" ("+" joins hybrids, ":" marks import paths).
        factory: a `Mixer` subclass or a function returning one, called as
            factory(d_model, [layer_idx, n_layers, l_max,] **options).
        block: "transformer" or "mamba".
        position_embeddings: give its models learned position embeddings by default.
        replace: allow replacing an entry of that name (else a second registration is an error).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"mixer name {name!r} must be letters, digits, '_', '.' or '-'")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a mixer named {name!r} is already registered (pass replace=True)")
    entry = _entry(name, factory, block, position_embeddings)
    _REGISTRY[name] = entry
    return entry


def unregister_mixer(name: str) -> None:
    """Remove a registered mixer (mecheval.testing registers factories for a check's time)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_REGISTRY)


def mixer_entry(name: str) -> MixerEntry:
    """The entry of one mixer: a registered name or an import path `module:attribute`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"arch must be a non-empty string, got {name!r}")
    if ":" in name:
        return _imported(name)
    if name not in _REGISTRY:
        raise ArchitectureError(
            f"unknown arch {name!r}: not registered in this process (registered: "
            f"{', '.join(_REGISTRY)}). A name given to mecheval.models.register_mixer is known "
            "only to the process that registers it: name the mixer by import path instead "
            "(arch=package.module:Name, which any process imports, the current directory "
            "included), or call mecheval from Python after importing the module that registers it"
        )
    return _REGISTRY[name]


def _imported(path: str) -> MixerEntry:
    module_name, _, attribute = path.partition(":")
    try:
        module = _import(module_name)
    except ImportError as error:
        if not isinstance(error, ModuleNotFoundError) or not module_name.startswith(
            error.name or "\0"
        ):  # the module exists, and its own code failed to import something
            raise _user_code_error(path, f"importing {module_name!r}", error) from error
        raise ArchitectureError(
            f"arch {path!r}: cannot import {module_name!r} ({error}): run from the folder that "
            "holds it, or put that folder on PYTHONPATH"
        ) from None
    except Exception as error:  # noqa: BLE001  (the module's own code: SyntaxError, ...)
        raise _user_code_error(path, f"importing {module_name!r}", error) from error
    target = getattr(module, attribute, None)
    if target is None:
        raise ValueError(f"arch {path!r}: module {module_name!r} has no {attribute!r}")
    if isinstance(target, MixerEntry):
        return target
    return _entry(path, target, "transformer", False)


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = str(Path.cwd())
        if here in sys.path or not module_name.startswith(error.name or "\0"):
            raise
        sys.path.append(here)  # as `python -m` would: the current directory's packages
        return importlib.import_module(module_name)


@dataclass(frozen=True)
class Architecture:
    """An architecture: its mixers by layer. A hybrid's parts repeat over the layers, whose
    number they must divide (one part per layer is the explicit per-layer list).

    Options (`check_options`, `options_of`): a key naming an option goes to every part that
    takes it; a key naming one of the parts holds a mapping of that part's own options
    (`{"mamba": {"d_conv": 2}, "attention": {"num_heads": 2}}`), which win over shared ones.
    """

    name: str
    parts: tuple[MixerEntry, ...]

    def part(self, layer_idx: int) -> MixerEntry:
        return self.parts[layer_idx % len(self.parts)]

    def check_layers(self, n_layers: int) -> None:
        """ValueError naming both counts when the parts do not divide the layers."""
        if n_layers % len(self.parts):
            raise ValueError(
                f"arch {self.name!r} has {len(self.parts)} parts, which do not divide its "
                f"{n_layers} layer(s): give n_layers a multiple of {len(self.parts)}, or one "
                "part per layer"
            )

    def position_embeddings(self, n_layers: int) -> bool:
        """Whether a part of some layer gives its models position embeddings by default."""
        return any(self.part(i).position_embeddings for i in range(n_layers))

    def option_defaults(self) -> dict[str, object]:
        """Every option some part takes, with the first such part's default."""
        defaults: dict[str, object] = {}
        for part in self.parts:
            for option, default in part.options.items():
                defaults.setdefault(option, default)
        return defaults

    @property
    def part_names(self) -> tuple[str, ...]:
        """The parts as `name` writes them (a registered name or an import path each)."""
        return tuple(self.name.split("+"))

    def _own(self, options: Mapping[str, object]) -> dict[str, Mapping]:
        """The per-part entries of `options`: part name -> that part's options."""
        names = set(self.part_names)
        return {k: v for k, v in options.items() if k in names and isinstance(v, Mapping)}

    def check_options(self, options: Mapping[str, object]) -> None:
        own = self._own(options)
        shared = [o for o in options if o not in own]
        unknown = [o for o in shared if not any(p.takes(o) for p in self.parts)]
        if unknown:
            known = ", ".join(self.option_defaults()) or "none"
            raise ValueError(
                f"option(s) {', '.join(unknown)} do not apply to arch {self.name!r} "
                f"(its options: {known}; a part's own options go under its name)"
            )
        for name, mapping in own.items():
            part = self.parts[self.part_names.index(name)]
            wrong = [o for o in mapping if not part.takes(o)]
            if wrong:
                raise ValueError(
                    f"option(s) {', '.join(map(str, wrong))} do not apply to part {name!r} of "
                    f"arch {self.name!r} (its options: {', '.join(part.options) or 'none'})"
                )

    def options_of(self, layer_idx: int, options: Mapping[str, object]) -> dict[str, object]:
        """The options that the mixer of layer `layer_idx` takes: the shared ones it takes,
        then its part's own."""
        part, own = self.part(layer_idx), self._own(options)
        shared = {k: v for k, v in options.items() if k not in own and part.takes(k)}
        return {**shared, **own.get(self.part_names[layer_idx % len(self.parts)], {})}


def architecture(name: str) -> Architecture:
    """The architecture `name` names: a registered name, an import path, or parts joined by
    "+" (a hybrid, repeating over the layers)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"arch must be a non-empty string, got {name!r}")
    return Architecture(name, tuple(mixer_entry(part) for part in name.split("+")))
