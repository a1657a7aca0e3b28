"""Distributed alignment search on trained runs: `mecheval das RUN_DIR`.

    das_all(path, **options)    DAS on every finished run under `path`: per run, das.parquet
                                (a row per held-out document, layer, site, position, k and
                                corruption) and das.json (the settings it was computed with)

Each run is trained on its task's evaluation documents (those `mecheval evaluate` patches),
corrupted as the grid corrupts them; a run whose das.json names the same settings is read
back, not trained again, so a killed job resumes at the run it was on. The method, its
parameters and cost: docs/das.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from mecheval.evaluation.config import DasOptions, EvaluateConfig, OptionError, check_options
from mecheval.evaluation.documents import documents_key, documents_of
from mecheval.evaluation.evaluate import with_run_identity
from mecheval.interventions.das import DasSettings, das
from mecheval.io import DamagedFileError
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import read_state, weights_sha256
from mecheval.run_folder.files import DAS, DAS_STAMP, RESULT
from mecheval.run_folder.status import finished_runs
from mecheval.run_folder.weights import load_trained_model, run_checkpoint


def check_das_options(options: DasOptions) -> tuple[DasOptions, EvaluateConfig]:
    """`options` checked before any work (each error an OptionError naming the option), and
    the evaluation options that pick the documents."""
    try:
        seed = settings(options).seed
    except ValueError as error:
        option, problem = str(error).removeprefix("DAS ").split(" ", 1)
        raise OptionError(option, problem) from None
    evaluation = check_options(
        EvaluateConfig(
            split=options.split,
            corruptions=options.corruptions,
            positions=options.positions,
            device=options.device,
            seed=seed,
            step=options.step,
        )
    )
    if not options.sites or not all(isinstance(s, str) for s in options.sites):
        raise OptionError("sites", f"expected a non-empty list of site names, got {options.sites}")
    dims = options.dims
    if not dims or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in dims):
        raise OptionError("dims", f"expected subspace sizes >= 1, got {dims}")
    layers = options.layers
    if layers is not None and any(not isinstance(i, int) or i < 0 for i in layers):
        raise OptionError("layers", f"expected layer indices >= 0, got {layers}")
    checked = dataclasses.replace(
        options,
        corruptions=evaluation.corruptions,
        positions=evaluation.positions,
        device=evaluation.device,
    )
    return checked, evaluation


def settings(options: DasOptions) -> DasSettings:
    """The training settings `options` names; those it leaves None, DasSettings' defaults."""
    names = ("steps", "lr", "batch_size", "holdout", "seed")
    given = {name: getattr(options, name) for name in names}
    return DasSettings(**{name: value for name, value in given.items() if value is not None})


def das_all(
    path: str | Path, progress: bool = True, force: bool = False, **options
) -> pd.DataFrame:
    """DAS on every finished run under `path` (see the module docstring); `options` are
    DasOptions' fields. Returns every run's table, concatenated."""
    checked, evaluation = check_das_options(DasOptions(**options))
    runs = finished_runs(path)
    if not runs:
        raise FileNotFoundError(f"no finished run in {path} (a run folder holds {RESULT})")
    configs = [files.read_run_config(run) for run in runs]
    documents = documents_of(configs, evaluation)
    plans = []
    for run, config in zip(runs, configs, strict=True):
        checkpoint, step = run_checkpoint(run, checked.step)
        plans.append((run, documents[documents_key(config)], checkpoint, step))
    tables = [
        das_run(run, docs, checkpoint, step, checked, force)
        for run, docs, checkpoint, step in tqdm(plans, desc="DAS", unit="run", disable=not progress)
    ]
    return pd.concat(tables, ignore_index=True)


def das_run(run_dir: Path, documents, checkpoint: Path, step: int, options, force: bool):
    """One run's DAS table, computed or read back where its stamp names the same settings."""
    searched_with = {
        **{k: v for k, v in dataclasses.asdict(options).items() if k not in ("device", "step")},
        "checkpoint": {"step": step, "sha256": weights_sha256(read_state(checkpoint))},
    }
    stamp = files.read_stamp(run_dir, DAS_STAMP)
    if not force and (run_dir / DAS).exists() and stamp.get("settings") == searched_with:
        try:
            return files.read_table(run_dir, DAS)
        except DamagedFileError:
            pass  # searched anew, below
    model, _, config = load_trained_model(run_dir, device=options.device, checkpoint=checkpoint)
    sites = _sites_of(model, options.sites, run_dir)
    batch = documents.batch.to(options.device)
    frames = []
    for at in options.corruptions:
        corrupted = documents.corrupted[at].to(options.device)
        for labels, rows in documents.groups:
            part_batch, part_corrupted = batch, corrupted
            if rows is not None:
                part_batch, part_corrupted = batch[rows], corrupted[rows]
            frame = das(
                model,
                part_batch,
                part_corrupted,
                sites=sites,
                positions=labels,
                dims=options.dims,
                layers=options.layers,
                settings=settings(options),
            )
            if rows is not None:
                frame["example"] = rows.cpu().numpy()[frame["example"].to_numpy()]
            frame.insert(0, "corruption", at)
            frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    table = with_run_identity(table, run_dir, config, documents, step)
    files.write_table(run_dir, DAS, table)
    files.write_stamp(run_dir, DAS_STAMP, {"settings": searched_with, "documents": len(batch)})
    return table


def _sites_of(model, wanted: Sequence[str], run_dir: Path) -> list[str]:
    have = {name.split(".", 2)[2] for name in model.site_names()}
    sites = [site for site in wanted if site in have]
    if not sites:
        raise OptionError(
            "sites", f"{run_dir.name}'s model has none of {list(wanted)} (it has {sorted(have)})"
        )
    return sites
