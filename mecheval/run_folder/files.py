"""The files of a run folder: their names, their formats, and the one reader and writer of each.

Training writes config.yaml, metrics.jsonl, metrics.parquet, checkpoints/ (see
mecheval.run_folder.checkpoints) and, last, result.json; a sweep writes error.json when the run
failed; evaluation writes its tables and the stamps that say what they were computed with.
Everything else in the package asks this module for a file; none spells a name. Every error
of a reader names the file.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import safetensors.torch
import torch
import yaml

from mecheval.config import ConfigError, flatten, from_dict, to_dict
from mecheval.io import (
    DamagedFileError,
    atomic_write,
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
    exclusive_lock,
    read_parquet,
    remove_temporaries,
)
from mecheval.run_folder.checkpoints import latest_checkpoint, read_state, weights_sha256
from mecheval.train.config import TrainConfig, identity

CONFIG = "config.yaml"  # the resolved TrainConfig, as YAML
RESULT = "result.json"  # the final result; its presence marks the run finished
ERROR = "error.json"  # why the run failed, as a sweep recorded it
METRICS = "metrics.jsonl"  # one JSON record per log or eval step
METRICS_TABLE = "metrics.parquet"  # the same records as a table, rewritten at each checkpoint
CHECKPOINTS = "checkpoints"
LOCK = ".lock"  # held by the one process that trains in the folder
INTERVENTIONS = "interventions.parquet"  # the interchange grids
EXAMPLES = "examples.parquet"  # per evaluation document: positions, distance, correct
INTERVENTIONS_STAMP = "interventions.json"  # the evaluation's settings, documents, skips
OVER_TRAINING = "readouts_over_training.parquet"  # the read-outs of every kept checkpoint
OVER_TRAINING_STAMP = "readouts_over_training.json"
DAS = "das.parquet"  # distributed alignment search: IIA per document, site, position and k
DAS_BASES = "das_bases.safetensors"  # DAS's learned bases R, one tensor per combination
DAS_STAMP = "das.json"  # its settings
RESULT_KEYS = (
    "config",
    "steps",
    "dev_accuracy",
    "test_accuracy",
    "best_accuracy",
    "wall_time_s",
    "num_params",
    "checkpoint",
)


@contextmanager
def training_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's lock (FolderInUseError at once when another process holds it)."""
    with exclusive_lock(folder / LOCK):
        yield


def clear_temporaries(folder: Path) -> None:
    """Remove what a killed writer left in the folder and its checkpoints (under the lock)."""
    for place in (folder, folder / CHECKPOINTS):
        remove_temporaries(place)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DamagedFileError(f"{path}: the {what} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise DamagedFileError(f"{path}: the {what} is not valid JSON ({error})") from None


def read_run_config(folder: str | Path) -> TrainConfig:
    """The config a run folder records (config.yaml), every error naming the file."""
    path = Path(folder) / CONFIG
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise DamagedFileError(f"{path}: the run config is not UTF-8 text") from None
    except yaml.YAMLError as error:
        raise DamagedFileError(f"{path}: the run config is not valid YAML ({error})") from None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise DamagedFileError(f"{path}: the run config is {what}")
    try:
        return from_dict(TrainConfig, data)
    except ConfigError as error:
        raise DamagedFileError(f"{path}: {error}") from None


def write_run_config(folder: Path, config: TrainConfig) -> None:
    atomic_write_text(folder / CONFIG, yaml.safe_dump(to_dict(config), sort_keys=False))


def read_result(folder: str | Path) -> dict[str, Any]:
    """A finished run's result.json; DamagedFileError names it when it is unreadable."""
    path = Path(folder) / RESULT
    result = _read_json(path, "run's result")
    if not isinstance(result, dict) or any(k not in result for k in RESULT_KEYS):
        missing = [k for k in RESULT_KEYS if not isinstance(result, dict) or k not in result]
        raise DamagedFileError(f"{path}: not a run result (lacks {', '.join(missing)})")
    return result


def write_result(folder: Path, config: TrainConfig, **fields: Any) -> dict[str, Any]:
    """Write (atomically) and return a finished run's result.json: the run's name and config,
    `fields` (its accuracies, steps, ...), and its final checkpoint by path, step and the
    sha256 of its weights (what evaluation loads)."""
    final = latest_checkpoint(folder / CHECKPOINTS)
    state = read_state(final) if final else {}
    result = {
        "run": folder.name,
        "config": to_dict(config),
        **fields,
        "checkpoint": str(final) if final else None,
        "checkpoint_step": state.get("step"),
        "checkpoint_sha256": weights_sha256(state),
    }
    atomic_write_json(folder / RESULT, result)
    return result


def _differences(saved: TrainConfig, asked: TrainConfig) -> str:
    a, b = flatten(identity(saved)), flatten(identity(asked))
    keys = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    return "; ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} asked" for k in keys[:5])


def refuse_other_config(folder: Path, config: TrainConfig) -> None:
    """ConfigError, naming the differences, when the folder's config.yaml is another run's."""
    if (folder / CONFIG).exists():
        _refuse(folder, read_run_config(folder), config, "a run")


def _refuse(folder: Path, saved: TrainConfig, config: TrainConfig, what: str) -> None:
    if identity(saved) != identity(config):
        raise ConfigError(
            f"{folder} holds {what} with a different config ({_differences(saved, config)}); "
            "use another folder or delete it"
        )


def finished_result(config: TrainConfig, folder: Path) -> dict[str, Any] | None:
    """The saved result when the folder holds this config's finished run; None when the run is
    not finished; ConfigError when the folder holds another config's run."""
    if not (folder / RESULT).exists():
        return None
    result = read_result(folder)
    if (folder / CONFIG).exists():
        saved = read_run_config(folder)
    else:
        try:
            saved = from_dict(TrainConfig, result["config"])
        except (ConfigError, TypeError) as error:
            raise DamagedFileError(f"{folder / RESULT}: its config: {error}") from None
    _refuse(folder, saved, config, "a finished run")
    return result


def read_error(folder: Path) -> str:
    """The error error.json records ("Name: message"); DamagedFileError when unreadable."""
    path = folder / ERROR
    try:
        return str(json.loads(path.read_bytes().decode("utf-8"))["error"])
    except (ValueError, KeyError, TypeError) as reason:
        raise DamagedFileError(f"{path}: unreadable ({type(reason).__name__}: {reason})") from None


def write_error(folder: Path, record: dict[str, Any]) -> None:
    atomic_write_json(folder / ERROR, record)


def clear_error(folder: Path) -> None:
    (folder / ERROR).unlink(missing_ok=True)


def read_metrics(folder: Path, up_to_step: int) -> list[dict]:
    """The records of metrics.jsonl up to `up_to_step`; malformed lines (not UTF-8, not JSON,
    no integer `step`) are skipped with a warning naming the file and line, except a last line
    cut short by a kill, skipped silently."""
    path = folder / METRICS
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.splitlines()
    records, bad = [], []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append(f"{number} (not UTF-8)")
            continue
        except json.JSONDecodeError:
            if number == len(lines) and not data.endswith(b"\n"):
                continue  # a line cut short by a kill
            bad.append(f"{number} (not JSON)")
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            bad.append(f"{number} (no integer 'step')")
            continue
        if step <= up_to_step:
            records.append(record)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(f"{path}: skipped malformed line(s) {shown}", RuntimeWarning, stacklevel=3)
    return records


def keep_metrics(folder: Path, up_to_step: int) -> list[dict]:
    """The records up to the step a run resumes from, metrics.jsonl rewritten to hold only
    those: the steps trained again are logged once."""
    records = read_metrics(folder, up_to_step)
    atomic_write_text(folder / METRICS, "".join(json.dumps(r) + "\n" for r in records))
    return records


class MetricsLog:
    """A run's metrics.jsonl open for appending, one record a line, each flushed at once."""

    def __init__(self, folder: Path) -> None:
        self._file = open(folder / METRICS, "a")  # noqa: SIM115 (closed by close())

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_metrics_table(folder: Path, records: list[dict]) -> None:
    atomic_write_parquet(folder / METRICS_TABLE, pd.DataFrame(records))


# Which stamp says what each evaluation file was computed with. A stamp is the manifest of
# its files: written after them, it names each one's sha256, and a file that does not match it
# is not read (a kill between a file and its stamp leaves them disagreeing).
STAMP_OF = {
    INTERVENTIONS: INTERVENTIONS_STAMP,
    EXAMPLES: INTERVENTIONS_STAMP,
    OVER_TRAINING: OVER_TRAINING_STAMP,
    DAS: DAS_STAMP,
    DAS_BASES: DAS_STAMP,
}


def stamp_of(name: str) -> str:
    """The stamp that names an evaluation file: STAMP_OF's, or an intervention kind's
    `<kind>.json` beside its `<kind>.parquet` (mecheval.evaluation.kinds)."""
    return STAMP_OF.get(name, name.removesuffix(".parquet") + ".json")


class StaleFileError(DamagedFileError):
    """An evaluation file that its stamp does not name (a kill between them): computed anew."""


def _fix(folder: Path, name: str) -> str:
    command = "das" if stamp_of(name) == DAS_STAMP else "evaluate"
    return f"evaluate the run again: mecheval {command} {folder} --force"


def _checked_bytes(folder: Path, name: str) -> bytes:
    """The bytes of an evaluation file, checked against the sha256 its stamp names; a stamp
    from before stamps named their files (no `files`) is taken at its word."""
    path = folder / name
    data = path.read_bytes()
    stamp_name = stamp_of(name)
    stamp = read_stamp(folder, stamp_name)
    named = stamp.get("files") if stamp else {}
    if not stamp or (isinstance(named, dict) and name not in named):
        raise StaleFileError(
            f"{path}: {stamp_name} beside it does not name it (its evaluation was cut short); "
            f"{_fix(folder, name)}"
        )
    if isinstance(named, dict) and named[name] != hashlib.sha256(data).hexdigest():
        raise StaleFileError(
            f"{path}: not the file {stamp_name} names (another sha256: a kill between the "
            f"two, or a damaged file); {_fix(folder, name)}"
        )
    return data


def read_table(folder: str | Path, name: str) -> pd.DataFrame:
    """A table the run's evaluation wrote (INTERVENTIONS, EXAMPLES, OVER_TRAINING, DAS),
    checked against its stamp (StaleFileError when the stamp does not name it);
    DamagedFileError names one that cannot be read, and how to write it anew."""
    folder = Path(folder)
    data = _checked_bytes(folder, name)
    return read_parquet(folder / name, fix=_fix(folder, name), data=data)


def read_tensors(folder: str | Path, name: str) -> dict[str, torch.Tensor]:
    """Tensors the run's evaluation wrote as safetensors (DAS_BASES), checked as `read_table`."""
    folder = Path(folder)
    data = _checked_bytes(folder, name)
    try:
        return safetensors.torch.load(data)
    except Exception as error:  # noqa: BLE001  (safetensors raises its own, varying errors)
        raise DamagedFileError(
            f"{folder / name}: cannot be read as safetensors ({error}); {_fix(folder, name)}"
        ) from None


def write_stamped(folder: Path, stamp: str, written: dict[str, Any], record: dict) -> None:
    """Write an evaluation's files and then its stamp, `record` plus `files`: each file's
    sha256. `written`: file name -> a DataFrame (Parquet) or {name: tensor} (safetensors).
    A kill leaves the old stamp, which names none of the new files: they are not read."""
    digests = {}
    for name, content in written.items():
        if isinstance(content, pd.DataFrame):
            atomic_write_parquet(folder / name, content)
        else:
            tensors = {k: v.detach().cpu().contiguous() for k, v in content.items()}
            atomic_write(folder / name, lambda p, t=tensors: safetensors.torch.save_file(t, p))
        digests[name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    atomic_write_json(folder / stamp, {**record, "files": digests})


def read_stamp(folder: Path, name: str) -> dict:
    """A stamp of the run's evaluation (INTERVENTIONS_STAMP, OVER_TRAINING_STAMP, DAS_STAMP):
    what its files were computed with, and their sha256 (`files`). {} when missing or
    unreadable: the run is evaluated anew."""
    try:
        record = json.loads((folder / name).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def evaluated_conv_sites(folder: str | Path) -> dict[int, list[str]] | None:
    """The short convs' outputs per layer that a run's stored evaluation recorded (its
    mixers' `conv_sites`); None: not recorded (evaluated before mixers declared them)."""
    sites = read_stamp(Path(folder), INTERVENTIONS_STAMP).get("conv_sites")
    if not isinstance(sites, dict):
        return None
    return {int(layer): list(names) for layer, names in sites.items()}


def evaluated_step(folder: str | Path) -> int | None:
    """The checkpoint step a run's stored evaluation used (None: not recorded)."""
    settings = read_stamp(Path(folder), INTERVENTIONS_STAMP).get("settings") or {}
    step = (settings.get("checkpoint") or {}).get("step")
    return step if isinstance(step, int) else None
