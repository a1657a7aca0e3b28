"""The run folder of a pretrained model: what `mecheval evaluate --model hf:... --task FILE
--out DIR` writes, beside the evaluation files every run folder may hold.

    pretrained.yaml     the run: the checkpoint (`model.source`, a folder or hub id, and the
                        dtype it is read in) and the task (name, options, documents evaluated)
    result.json         as a trained run's (files.RESULT_KEYS), for the report: `config` the
                        run's identity (the checkpoint's family as `arch`, its width and depth,
                        lr 0 and steps 0: not trained here), the model's accuracy on the dev and
                        test documents, its parameters, the seconds its load and accuracies
                        took, and its provenance (`checkpoint`, `checkpoint_sha256`, `files`)
    interventions.*, examples.parquet, das.*    as a trained run's

A pretrained run has no checkpoints/ and no config.yaml: it is known by pretrained.yaml.
Provenance: the checkpoint as given (a folder's path, a hub id), the folder read (the hub's
snapshot, whose name is the revision's commit), and the sha256 of its config.json and weight
files each and of all of them (`checkpoint_sha256`), which every evaluation stamp names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mecheval.config import ConfigError, from_dict, read_yaml, to_dict
from mecheval.io import DamagedFileError, atomic_write_text
from mecheval.train.config import TaskSection

PRETRAINED = "pretrained.yaml"
# A pretrained run's code status (mecheval.run_folder.provenance): it is converted from the
# checkpoint by today's code at each evaluation, whose stamps record it.
PRETRAINED_CODE = "pretrained"
# What a checkpoint's provenance hashes: its config and weights (a sharded index names more).
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class ModelSource:
    """The checkpoint: `source` a folder or hub id as `from_pretrained` takes it (an "hf:"
    prefix allowed), read in `dtype`."""

    source: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class PretrainedRun:
    """A pretrained model's run: its checkpoint and the task it is evaluated on (the `prompts`
    task's options; `eval_size` documents per split)."""

    model: ModelSource
    task: TaskSection = field(default_factory=lambda: TaskSection(name="prompts"))


def is_pretrained_run(folder: str | Path) -> bool:
    """Whether `folder` is a pretrained model's run (it holds pretrained.yaml)."""
    return (Path(folder) / PRETRAINED).is_file()


def read_pretrained_run(folder: str | Path) -> PretrainedRun:
    """The run pretrained.yaml records, every error naming the file."""
    path = Path(folder) / PRETRAINED
    try:
        data = read_yaml(path, "pretrained run")
    except ConfigError as error:
        raise DamagedFileError(str(error)) from None
    if not isinstance(data, dict):
        raise DamagedFileError(f"{path}: the pretrained run is not a mapping")
    try:
        return from_dict(PretrainedRun, data)
    except ConfigError as error:
        raise DamagedFileError(f"{path}: {error}") from None


def write_pretrained_run(folder: Path, run: PretrainedRun) -> None:
    import yaml

    atomic_write_text(folder / PRETRAINED, yaml.safe_dump(to_dict(run), sort_keys=False))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(folder: Path) -> dict[str, str]:
    """sha256 of each of the checkpoint's config and weight files in `folder` (by name; the
    shards a sharded index names too)."""
    names = [name for name in CHECKPOINT_FILES if (folder / name).is_file()]
    for index in [name for name in names if name.endswith(".index.json")]:
        try:
            shards = json.loads((folder / index).read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, AttributeError) as error:
            raise DamagedFileError(f"{folder / index}: unreadable ({error})") from None
        names += sorted(set(shards))
    return {name: _sha256(folder / name) for name in names}


def files_sha256(files: dict[str, str]) -> str:
    """One sha256 of the files' names and hashes (the checkpoint's identity)."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()
