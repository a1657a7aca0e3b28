"""Distributed alignment search on trained runs: `mecheval das RUN_DIR`.

    das_all(path, **options)    DAS on every finished run under `path` (one level down: each
                                run folder in it, or `path` itself); per run das.parquet (a
                                row per held-out document, layer, site, position, k and
                                corruption), das_bases.safetensors (the learned bases R) and,
                                written last, das.json (the settings, and the sha256 of both)
    read_bases(run_dir)         the learned bases of a run, by `bases_key`

Each run is trained on its task's evaluation documents (those `mecheval evaluate` patches),
corrupted as the grid corrupts them. A pretrained model's run folder (mecheval.evaluation.
pretrained) is searched as a trained run is, its checkpoint read and checked when its turn
comes (before the trained runs). Every option is checked against every run before any
work: its layers, sites, subspace sizes against the sites' widths, the held-out share against
its documents, and its architecture's code (mecheval.run_folder.provenance). A run whose
das.json names the same settings, and its files, is read back, not trained again, so a killed
job resumes at the run it was on. The method, its parameters and cost: docs/das.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from mecheval.evaluation.config import (
    DAS_DIMS,
    READOUT_SITES,
    DasOptions,
    EvaluateConfig,
    OptionError,
    check_options,
)
from mecheval.evaluation.documents import (
    EvaluationDocuments,
    documents_key,
    documents_of,
    evaluation_documents,
)
from mecheval.evaluation.evaluate import with_run_identity
from mecheval.evaluation.pretrained import resolve, with_identity
from mecheval.interventions.das import DasSettings, das
from mecheval.interventions.das_data import check_holdout, left_out
from mecheval.interventions.plan import select_sites, site_widths
from mecheval.io import DamagedFileError
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import read_state, weights_sha256
from mecheval.run_folder.files import DAS, DAS_BASES, DAS_STAMP, RESULT
from mecheval.run_folder.pretrained import PRETRAINED_CODE, is_pretrained_run
from mecheval.run_folder.provenance import check_code
from mecheval.run_folder.status import finished_runs
from mecheval.run_folder.weights import load_trained_model, run_checkpoint
from mecheval.train.config import TrainConfig, build_model_for


@dataclasses.dataclass(frozen=True)
class _DasPlan:
    """One run's DAS, checked and ready: what it searches, on which documents and weights."""

    run_dir: Path
    documents: EvaluationDocuments
    checkpoint: Path
    step: int
    sites: list[str]  # short names, those the run's model has
    layers: list[int]
    dims: list[int]
    left_out: dict[str, list[int]]  # site (full name) -> sizes above its width
    code: str  # its architecture's code against training's


def bases_key(corruption: str, site: str, position: str, k: int) -> str:
    """The key of a basis in das_bases.safetensors: "{corruption}/{site}/{position}/{k}", the
    site by its full name ("key/layers.1.block_input/value/4")."""
    return f"{corruption}/{site}/{position}/{k}"


def read_bases(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The bases R a run's `mecheval das` learned (das_bases.safetensors, checked against its
    das.json): (width, k) float32 each, orthonormal columns, by `bases_key`."""
    return files.read_tensors(Path(run_dir), DAS_BASES)


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
    sites = options.sites
    if sites is not None and (not sites or not all(isinstance(s, str) for s in sites)):
        raise OptionError("sites", f"expected a non-empty list of site names, got {sites}")
    dims = options.dims
    if dims is not None and (
        not dims or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in dims)
    ):
        raise OptionError("dims", f"expected subspace sizes >= 1, got {dims}")
    layers = options.layers
    if layers is not None and (
        not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
    ):
        raise OptionError("layers", f"expected layer indices >= 0, got {layers}")
    checked = dataclasses.replace(
        options,
        corruptions=evaluation.corruptions,
        positions=evaluation.positions,
        device=evaluation.device,
        dims=None if dims is None else sorted(set(dims)),
    )
    return checked, evaluation


def settings(options: DasOptions) -> DasSettings:
    """The training settings `options` names; those it leaves None, DasSettings' defaults."""
    names = ("steps", "lr", "batch_size", "holdout", "seed")
    given = {name: getattr(options, name) for name in names}
    return DasSettings(**{name: value for name, value in given.items() if value is not None})


def das_all(
    path: str | Path,
    progress: bool = True,
    force: bool = False,
    allow_code_change: bool = False,
    **options,
) -> pd.DataFrame:
    """DAS on every finished run under `path` (see the module docstring); `options` are
    DasOptions' fields. Every run is checked before the first starts. Returns every run's
    table, concatenated."""
    checked, evaluation = check_das_options(DasOptions(**options))
    runs = finished_runs(path)
    if not runs:
        raise FileNotFoundError(f"no finished run in {path} (a run folder holds {RESULT})")
    pretrained = [run for run in runs if is_pretrained_run(run)]  # each checked as it runs
    runs = [run for run in runs if run not in pretrained]
    configs = [files.read_run_config(run) for run in runs]
    code = check_code(runs, allow_code_change)
    documents = documents_of(configs, evaluation)
    plans = [
        _plan(run, config, documents[documents_key(config)], checked, code[Path(run)])
        for run, config in zip(runs, configs, strict=True)
    ]
    tables = [das_pretrained(run, checked, evaluation, force) for run in pretrained]
    tables += [
        das_run(plan, checked, force)
        for plan in tqdm(plans, desc="DAS", unit="run", disable=not progress)
    ]
    return pd.concat(tables, ignore_index=True)


def _plan(run: Path, config: TrainConfig, documents, options: DasOptions, code: str) -> _DasPlan:
    """One run's DAS, every option checked against it (OptionError naming the run)."""
    checkpoint, step = run_checkpoint(run, options.step)
    with torch.random.fork_rng(devices=[]):  # the model's shape alone: its sites and widths
        model = build_model_for(config, documents.task).eval()
    return searched_plan(run, model, documents, options, checkpoint, step, code)


def searched_plan(run: Path, model, documents, options: DasOptions, checkpoint, step, code):
    """The `_DasPlan` of a run whose model (its weights or its shape alone) is `model`, every
    option checked against it (an OptionError naming the run)."""
    n_layers = len(model.layers)
    layers = list(range(n_layers)) if options.layers is None else list(options.layers)
    if max(layers) >= n_layers:
        bad = [layer for layer in layers if layer >= n_layers]
        raise OptionError("layers", f"{run.name} has layers 0..{n_layers - 1}, got {bad}")
    sites = _sites_of(model, options.sites, layers, run)
    refs = select_sites(model, layers, sites)
    widths = site_widths(model, refs, documents.batch.tokens)
    dims = options.dims or [k for k in DAS_DIMS if k < max(widths.values())] or [1]
    try:
        dropped = left_out(dims, widths)
    except ValueError as error:
        raise OptionError("dims", f"{run.name}: {error}") from None
    holdout = settings(options).holdout
    for labels, rows in documents.groups:
        try:
            check_holdout(holdout, len(documents.batch) if rows is None else len(rows))
        except ValueError as error:
            where = f"{run.name}, positions {', '.join(labels)}"
            raise OptionError("holdout", f"{where}: {error}") from None
    return _DasPlan(run, documents, checkpoint, step, sites, layers, dims, dropped, code)


def _sites_of(model, wanted: Sequence[str] | None, layers: list[int], run: Path) -> list[str]:
    """The sites searched in `run`: every one of `wanted` (an error names those its model
    lacks in the layers searched), or, for None, those of READOUT_SITES it has."""
    have = {ref.short for ref in select_sites(model, layers)}
    if wanted is None:
        sites = [site for site in READOUT_SITES if site in have]
        if not sites:
            raise OptionError("sites", f"{run.name}'s model has none of {list(READOUT_SITES)}")
        return sites
    missing = [site for site in wanted if site not in have]
    if missing:
        raise OptionError(
            "sites", f"{run.name}'s model has no {missing} in layers {layers} (it has "
            f"{sorted(have)})"
        )  # fmt: skip
    return list(wanted)


def searched_with(plan: _DasPlan, options: DasOptions, sha256: str | None = None) -> dict:
    """What a stored DAS was computed with, every default as its value: equal settings, equal
    results (`sha256`: the weights', by default those of the plan's checkpoint)."""
    if sha256 is None:
        sha256 = weights_sha256(read_state(plan.checkpoint))
    return {
        "sites": plan.sites,
        "layers": plan.layers,
        "positions": options.positions,
        "dims": plan.dims,
        "corruptions": options.corruptions,
        "split": options.split,
        **dataclasses.asdict(settings(options)),
        "checkpoint": {"step": plan.step, "sha256": sha256},
    }


def _stored(run_dir: Path, wanted: dict, force: bool) -> pd.DataFrame | None:
    """The run's stored DAS table when its stamp names the settings `wanted` (and its bases
    match the stamp too), else None."""
    stamp = files.read_stamp(run_dir, DAS_STAMP)
    if not force and (run_dir / DAS).exists() and stamp.get("settings") == wanted:
        try:
            files.read_tensors(run_dir, DAS_BASES)
            return files.read_table(run_dir, DAS)
        except (DamagedFileError, FileNotFoundError):
            pass  # searched anew
    return None


def _write(plan: _DasPlan, wanted: dict, table: pd.DataFrame, bases: dict) -> None:
    record = {
        "settings": wanted,
        "documents": len(plan.documents.batch),
        "left_out": plan.left_out,
        "code": plan.code,
    }
    files.write_stamped(plan.run_dir, DAS_STAMP, {DAS: table, DAS_BASES: bases}, record)


def das_run(plan: _DasPlan, options: DasOptions, force: bool) -> pd.DataFrame:
    """One run's DAS table, computed or read back where its stamp names the same settings."""
    wanted = searched_with(plan, options)
    stored = _stored(plan.run_dir, wanted, force)
    if stored is not None:
        return stored
    device = options.device
    model, _, config = load_trained_model(plan.run_dir, device=device, checkpoint=plan.checkpoint)
    table, bases = das_tables(model, plan, options)
    table = with_run_identity(table, plan.run_dir, config, plan.documents, plan.step)
    _write(plan, wanted, table, bases)
    return table


def das_pretrained(run: Path, options: DasOptions, evaluation, force: bool) -> pd.DataFrame:
    """DAS on a pretrained model's run folder (mecheval.evaluation.pretrained): its checkpoint
    read, the options checked against it, then searched unless stored with these settings."""
    if options.step is not None:
        raise OptionError("step", "a pretrained checkpoint has no steps to choose from")
    checkpoint = resolve(run)
    documents = evaluation_documents(checkpoint.task, checkpoint.run.task.eval_size, evaluation)
    model = checkpoint.model(options.device)
    plan = searched_plan(run, model, documents, options, checkpoint.folder, 0, PRETRAINED_CODE)
    wanted = searched_with(plan, options, checkpoint.sha256)
    stored = _stored(run, wanted, force)
    if stored is not None:
        return stored
    table, bases = das_tables(model, plan, options)
    table = with_identity(table, run, checkpoint, model)
    _write(plan, wanted, table, bases)
    return table


def das_tables(model, plan: _DasPlan, options: DasOptions) -> tuple[pd.DataFrame, dict]:
    """(DAS's table of the plan's documents on `model`, every corruption and group of
    positions; the learned bases by `bases_key`)."""
    documents = plan.documents
    batch = documents.batch.to(options.device)
    frames, bases = [], {}
    for at in options.corruptions:
        corrupted = documents.corrupted[at].to(options.device)
        for labels, rows in documents.groups:
            part_batch, part_corrupted = batch, corrupted
            if rows is not None:
                part_batch, part_corrupted = batch[rows], corrupted[rows]
            frame, learned = das(
                model,
                part_batch,
                part_corrupted,
                sites=plan.sites,
                positions=labels,
                dims=plan.dims,
                layers=plan.layers,
                settings=settings(options),
            )
            if rows is not None:
                frame["example"] = rows.cpu().numpy()[frame["example"].to_numpy()]
            frame.insert(0, "corruption", at)
            frames.append(frame)
            bases.update({f"{at}/{key}": R for key, R in learned.items()})
    return pd.concat(frames, ignore_index=True), bases


def left_out_of(run_dir: str | Path) -> dict[str, list[int]]:
    """The subspace sizes a run's stored DAS left out per site (above its width)."""
    return dict(files.read_stamp(Path(run_dir), DAS_STAMP).get("left_out") or {})
