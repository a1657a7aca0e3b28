"""Intervention kinds on trained runs: `mecheval evaluate --kind NAME` (docs/interventions.md).

    evaluate_kind(path, "path", {"layers": [0]})   every finished run under path ->
                                                   run_dir/path.parquet, run_dir/path.json

The interchange grid (`grid`, the default) is `evaluate_all`'s (interventions.parquet). Any
other kind runs on the same evaluation documents, checkpoint and checks (every option, every
run's code and checkpoint before any work), once per corruption when it corrupts, and writes
its table and, last, its stamp: the kind (its name or import path) and options, the documents'
settings and the checkpoint. A run already evaluated with equal settings is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from mecheval.evaluation.config import EvaluateConfig, OptionError, check_options
from mecheval.evaluation.evaluate import _plans, _RunPlan, _settings, with_run_identity
from mecheval.interventions.kinds import Intervention, make_intervention
from mecheval.io import DamagedFileError
from mecheval.run_folder import files
from mecheval.run_folder.files import RESULT
from mecheval.run_folder.status import finished_runs
from mecheval.run_folder.weights import load_trained_model


def table_name(kind: str) -> str:
    """The run folder's file of a kind's table: `<name>.parquet`, its stamp `<name>.json`."""
    if not kind.replace("_", "").isalnum():
        raise ValueError(f"intervention kind names its files: {kind!r} must be letters and _")
    return f"{kind}.parquet"


def intervention(name: str, options: Mapping[str, object] | None) -> Intervention:
    """The kind `name` with `options`, an OptionError naming what is wrong."""
    try:
        return make_intervention(name, **dict(options or {}))
    except (TypeError, ValueError) as error:
        raise OptionError("kind", str(error)) from None


def evaluate_kind(
    path: str | Path,
    kind: str,
    kind_options: Mapping[str, object] | None = None,
    progress: bool = True,
    force: bool = False,
    allow_code_change: bool = False,
    **options,
) -> pd.DataFrame:
    """The kind's tables of every finished run under `path` (see the module docstring);
    `options` are EvaluateConfig's fields (the documents, the device, the checkpoint)."""
    chosen = intervention(kind, kind_options)
    checked = check_options(EvaluateConfig(**options))
    runs = finished_runs(path)
    if not runs:
        raise FileNotFoundError(f"no finished run in {path} (a run folder holds {RESULT})")
    plans = _plans(runs, checked, None, allow_code_change)
    tables = [
        _evaluate_kind(plan, kind, chosen, checked, force)
        for plan in tqdm(plans, desc=kind, unit="run", disable=not progress)
    ]
    return pd.concat(tables, ignore_index=True)


def _evaluate_kind(plan: _RunPlan, kind: str, chosen, options: EvaluateConfig, force: bool):
    run_dir, documents = plan.run_dir, plan.documents
    name = table_name(chosen.name)
    stamp = name.removesuffix(".parquet") + ".json"
    settings = {"kind": kind, "options": _plain(chosen.options()), **_settings(plan, options)}
    if not chosen.corrupts:
        settings.pop("corruption")
    stored = files.read_stamp(run_dir, stamp)
    if not force and stored.get("settings") == settings and (run_dir / name).exists():
        try:
            return files.read_table(run_dir, name)
        except DamagedFileError:
            pass  # evaluated anew, below
    model, _, config = load_trained_model(
        run_dir, device=options.device, checkpoint=plan.checkpoint
    )
    batch = documents.batch.to(options.device)
    frames = []
    for at in documents.corruptions if chosen.corrupts else [None]:
        corrupted = None if at is None else documents.corrupted[at].to(options.device)
        table = chosen.run(model, batch, corrupted)
        table.insert(0, "corruption", at or "none")
        frames.append(table)
    table = with_run_identity(pd.concat(frames, ignore_index=True), run_dir, config, documents,
                              plan.step)  # fmt: skip
    record = {"settings": settings, "documents": batch.num_documents, "code": plan.code}
    files.write_stamped(run_dir, stamp, {name: table}, record)
    return table


def _plain(value):
    """Options as JSON holds them (tuples as lists), so a stored stamp compares equal."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def evaluated_kinds(run_dir: str | Path) -> dict[str, str]:
    """The kinds a run's folder holds tables of: file name -> the kind's name or import path
    (from each `<name>.json` stamp that names one)."""
    found = {}
    for stamp in sorted(Path(run_dir).glob("*.json")):
        kind = files.read_stamp(Path(run_dir), stamp.name).get("settings", {})
        if isinstance(kind, dict) and isinstance(kind.get("kind"), str):
            found[stamp.with_suffix(".parquet").name] = kind["kind"]
    return found
