"""The code of an architecture, as a run records it: which source its mixers came from, and a
hash of that source, so that a run is never evaluated silently with other code than it was
trained with (mecheval.run_folder.provenance checks it).

    architecture_code(config)    {part: {"factory", "sources", "sha256"}} for a ModelConfig

A part's code is its factory and the mixer classes it builds (each class of their MRO below
`mecheval.layers.Mixer`):
- named by import path (`package.module:Name`): the whole files of their modules, and
  `sources` lists those files;
- named by a registered name (the zoo's included): each object's own source
  (`inspect.getsource`), and `sources` lists their qualified names. A module-level helper
  they call is not covered, nor are the kernels.
`sha256` is None when a source cannot be read (a factory defined in a notebook cell, a C
extension): that part is not checked.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

import torch

from mecheval.layers import Mixer
from mecheval.models.config import ModelConfig


def architecture_code(config: ModelConfig) -> dict[str, dict]:
    """The code of each part of `config`'s architecture (see the module docstring); every
    layer's mixer is built on the meta device to see its class."""
    arch = config.architecture
    record = {}
    for index, name in enumerate(arch.part_names):
        entry = arch.parts[index]
        classes = {
            type(_built(config, layer))
            for layer in range(config.n_layers)
            if layer % len(arch.parts) == index
        }
        objects = [_unwrapped(entry.factory)]
        for cls in sorted(classes, key=_qualified):
            objects += [c for c in cls.__mro__ if _below_mixer(c) and c not in objects]
        sources = _files(objects) if ":" in name else _sources(objects)
        record[name] = {"factory": _qualified(objects[0]), **sources}
    return record


def _built(config: ModelConfig, layer: int) -> Mixer:
    """Layer `layer`'s mixer, on the meta device where its constructor allows (else on the
    CPU, the random state put back after)."""
    try:
        with torch.device("meta"):
            return config.mixer(layer)
    except Exception:  # noqa: BLE001  (an operation the meta device lacks; the CPU says why)
        with torch.random.fork_rng(devices=[]):
            return config.mixer(layer)


def _unwrapped(factory):
    """The function behind a functools.partial (whose own source is none)."""
    while hasattr(factory, "func") and not inspect.isclass(factory):
        factory = factory.func
    return factory


def _below_mixer(cls: type) -> bool:
    return issubclass(cls, Mixer) and cls is not Mixer


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _digest(units: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for label, content in units:
        digest.update(label.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def _files(objects) -> dict:
    """The whole files of the objects' modules."""
    paths = []
    for obj in objects:
        try:
            path = Path(inspect.getsourcefile(obj) or "").resolve()
        except TypeError:  # a built-in: no file
            return {"sources": [], "sha256": None}
        if path.is_file() and path not in paths:
            paths.append(path)
    # Labelled by file name, not path: the same code moved to another folder is the same code.
    units = [(path.name, path.read_bytes()) for path in paths]
    return {"sources": [str(p) for p in paths], "sha256": _digest(units) if units else None}


def _sources(objects) -> dict:
    """Each object's own source."""
    units = []
    for obj in objects:
        try:
            units.append((_qualified(obj), inspect.getsource(obj).encode()))
        except (OSError, TypeError):  # defined where no source is kept
            return {"sources": [_qualified(o) for o in objects], "sha256": None}
    return {"sources": [label for label, _ in units], "sha256": _digest(units)}
