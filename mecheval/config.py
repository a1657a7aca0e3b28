"""Typed configs: dataclasses loaded from YAML and overridden by `key=value` arguments.

The one config system of the package. A config is a (nested) dataclass; `load_config` fills it
from a YAML file and a list of overrides such as `optim.lr=3e-3` (dotted keys reach nested
fields, values are parsed as YAML scalars: `3e-3`, `true`, `null`, `[1, 2]`), checks every
value against the field's type and refuses unknown keys by name, with a suggestion:

    ValueError: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)

Fields typed `dict` are free-form (their contents are validated by whoever consumes them, e.g.
`make_task` for task options).

Layers, each over the one before: the dataclass's defaults, `base`, the YAML file, the
overrides. A section that is a dataclass merges key by key at every layer. A free-form dict
given in a file (or `base`) is taken as written, replacing the default dict: a file's sweep
is that sweep, not the default one with keys swapped. Dotted overrides reach inside whatever
dict the layers below left, defaults included (`sweep.base.steps=5` changes one key of the
default sweep and keeps the rest); a dotted key also names a key that itself holds dots
(`sweep.grid.model.arch=[mamba]` sets the grid's `model.arch`). A file may use the short
aliases of the overrides for scalars (`task: atr` for `task: {name: atr}`). An override inside a
value that is not a mapping (`model: mamba` in the file, `model.d_model=16` given) is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it."""


def parse_value(text: str) -> Any:
    """A command-line value as YAML would read it ("3e-3" is a float, "null" is None)."""
    value = yaml.safe_load(text) if text.strip() else ""
    if isinstance(value, str):
        # YAML 1.1 reads "1e-3" as a string; numbers written that way are meant as floats.
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_overrides(overrides: Sequence[str], aliases: Mapping[str, str] | None = None) -> dict:
    """["a.b=1", "lr=3e-3"] -> {"a": {"b": 1}, ...}, with short aliases expanded to dotted keys."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        key = (aliases or {}).get(key, key)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a key inside a non-mapping value")
        node[leaf] = parse_value(text)
    return nested


def merge(base: dict, update: Mapping, prefix: str = "") -> dict:
    """Deep merge of plain dicts (update wins); nested mappings merge key by key. A mapping
    merged onto a value that is set but is not a mapping is refused, naming the key: it would
    silently drop that value."""
    out = dict(base)
    for key, value in update.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        current = out.get(key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            out[key] = merge(dict(current), value, path)
        elif isinstance(value, Mapping) and current is not None:
            raise ConfigError(
                f"'{path}' is {current!r}, not a mapping, but keys inside it are set: "
                f"{sorted(value)}"
            )
        else:
            out[key] = value
    return out


def set_dotted(data: dict, key: str, value: Any, item: str | None = None) -> dict:
    """`data` with the dotted `key` set to `value`, nested dicts created as needed; a part of
    the key may itself hold dots when `data` already has such a key (a sweep grid's
    `model.arch`). `item` (the override as written) names the error when a parent is set but
    is not a mapping."""
    out = dict(data)
    parts = key.split(".")
    for split in range(len(parts), 0, -1):  # the longest existing key first
        head, rest = ".".join(parts[:split]), parts[split:]
        if split == 1 or head in out:
            break
    if not rest:
        out[head] = value
        return out
    child = out.get(head)
    if child is None:
        child = {}
    if not isinstance(child, Mapping):
        raise ConfigError(
            f"override {item or key!r} sets a key inside '{head}', which is {child!r}, "
            "not a mapping"
        )
    out[head] = set_dotted(dict(child), ".".join(rest), value, item or key)
    return out


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    """`value` converted to `annotation` where that is lossless (int -> float), else an error."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(annotation):
            try:
                return _check_type(path, value, option)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(f"{path}: {value!r} is not a valid {_type_name(annotation)}")
    if origin is typing.Literal:
        if value in typing.get_args(annotation):
            return value
        raise ConfigError(f"{path}: {value!r} is not one of {list(typing.get_args(annotation))}")
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {value!r}")
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, prefix=path)
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(annotation)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _check_type(f"{path}[{i}]", v, a)
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item = args[0] if args else Any
        items = [_check_type(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
        return tuple(items) if (origin or annotation) is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {annotation.__name__}, got {value!r}")
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise ConfigError(
            f"{path}: expected {annotation.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def from_dict(cls: type[C], data: Mapping[str, Any], prefix: str = "") -> C:
    """Build dataclass `cls` from a plain mapping, checking keys and value types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        full = f"{prefix}.{key}" if prefix else key
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{full}'{hint}; valid keys: {sorted(fields)}")
    values = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        values[name] = _check_type(path, value, hints[name])
    try:
        return cls(**values)
    except TypeError as error:  # a required field is missing
        raise ConfigError(f"{prefix or cls.__name__}: {error}") from None


def to_dict(config: Any) -> dict:
    """A config as plain dicts/lists (tuples become lists), ready for YAML or JSON."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def _unwrap_dataclass(annotation: Any) -> Any:
    """The dataclass type of a field typed `X` or `X | None`, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _overlay(cls: Any, data: dict, layer: Mapping) -> dict:
    """`layer` over `data`: dataclass sections merge key by key, anything else (scalars,
    lists, free-form dicts) is replaced as written."""
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = dict(data)
    for key, value in layer.items():
        section = _unwrap_dataclass(hints.get(key))
        if section is not None and isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _overlay(section, out[key], value)
        else:
            out[key] = value
    return out


def _defaults(cls: type) -> dict:
    """The defaults of `cls` as plain dicts (its init fields), or {} when a field is required."""
    try:
        instance = cls()
    except TypeError:
        return {}
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in to_dict(instance).items() if k in names}


def _expand_aliases(data: Mapping, aliases: Mapping[str, str] | None) -> dict:
    """A file's top-level `alias: scalar` entries (`task: atr`) as their dotted keys."""
    out: dict = {}
    for key, value in data.items():
        if aliases and key in aliases and aliases[key] != key and not isinstance(value, Mapping):
            out = set_dotted(out, aliases[key], value)
        else:
            out = merge(out, {key: value})
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last silently, dropping the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """A YAML file's content; an unreadable file (not UTF-8, bad YAML, a key given twice)
    raises ConfigError naming it."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: the {what} is not UTF-8 text ({error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: the {what} is not valid YAML ({error})") from None


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    aliases: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> C:
    """Config `cls` from defaults, then `base`, then a YAML file, then `key=value` overrides
    (see the module docstring for how the layers merge)."""
    data = _defaults(cls)
    if base:
        data = _overlay(cls, data, base)
    if path is not None:
        loaded = read_yaml(path) or {}
        if not isinstance(loaded, Mapping):
            raise ConfigError(
                f"{path}: the config file must hold a mapping, got {type(loaded).__name__}"
            )
        data = _overlay(cls, data, _expand_aliases(loaded, aliases))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        key = (aliases or {}).get(key.strip(), key.strip())
        data = set_dotted(data, key, parse_value(text), item)
    return from_dict(cls, data)


def flatten(data: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level of dotted keys ({"optim": {"lr": 1}} -> {"optim.lr": 1});
    an empty mapping stays a value."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def dump_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
