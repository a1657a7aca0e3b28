"""The files of a run folder: their names, their formats, and the one reader and writer of each.

Training writes config.yaml, metrics.jsonl, metrics.parquet, checkpoints/ (see
mecheval.run_folder.checkpoints) and, last, result.json; a sweep writes error.json when the run
failed; evaluation writes its tables and the stamps that say what they were computed with.
Everything else in the package asks this module for a file; none spells a name. Every error
of a reader names the file.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from mecheval.config import ConfigError, flatten, from_dict, to_dict
from mecheval.io import (
    DamagedFileError,
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


def read_table(folder: str | Path, name: str) -> pd.DataFrame:
    """A table the run's evaluation wrote (INTERVENTIONS, EXAMPLES, OVER_TRAINING, DAS);
    DamagedFileError names one that cannot be read, and how to write it anew."""
    folder = Path(folder)
    command = "das" if name == DAS else "evaluate"
    fix = f"evaluate the run again: mecheval {command} {folder} --force"
    return read_parquet(folder / name, fix=fix)


def write_table(folder: Path, name: str, table: pd.DataFrame) -> None:
    atomic_write_parquet(folder / name, table)


def read_stamp(folder: Path, name: str) -> dict:
    """A stamp of the run's evaluation (INTERVENTIONS_STAMP, OVER_TRAINING_STAMP, DAS_STAMP):
    what its tables were computed with. {} when missing or unreadable: the run is evaluated anew."""
    try:
        record = json.loads((folder / name).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def write_stamp(folder: Path, name: str, record: dict[str, Any]) -> None:
    atomic_write_json(folder / name, record)


def evaluated_step(folder: str | Path) -> int | None:
    """The checkpoint step a run's stored evaluation used (None: not recorded)."""
    settings = read_stamp(Path(folder), INTERVENTIONS_STAMP).get("settings") or {}
    step = (settings.get("checkpoint") or {}).get("step")
    return step if isinstance(step, int) else None
