"""Mechanistic evaluation of trained runs: the interchange grids of every run, stored as
Parquet next to its checkpoint.

    evaluate_run(run_dir)    one run  -> run_dir/interventions.parquet, run_dir/examples.parquet
    evaluate_all(path)       a run folder, or a folder of runs (a sweep): every finished run;
                             also the read-outs of every kept checkpoint
                             (mecheval.evaluation.over_training)

For each run: its evaluation documents (the dev split, `task.eval_size` of them), corrupted at
the key and, separately, at the value; every layer and site of the model at the named
positions key, value, divider, query and the two after the value (value+1, the next key in
AR, and value+2: the study's Mamba conv analysis patches those). Each row records the id range
its corrupting tokens were drawn from (`replacement_ids`, e.g. "3..4098": in AR both key and
value corruption draw key ids by default, as the study does; `corruption_options=
{"corruption_range": "own"}` draws each position's own kind instead, without retraining), and
the checkpoint step whose weights were patched (`step`).

Nothing is dropped or substituted silently:
- every option is checked before any work starts, for every run (mecheval.evaluation.config,
  and mecheval.evaluation.documents against each run's task), and an error names the option,
  the bad value and what is allowed;
- a position that lies outside some documents is patched in the documents it lies inside
  only; how many documents each such position skipped is recorded (`interventions.json`, and
  `evaluation_summary`); a position inside no document is an error;
- the weights are those of the checkpoint the run's result.json names, checked against its
  step and checksum; when it is missing or damaged, evaluation stops and says so, unless
  another step is asked for (`step=N`, or `step="latest"`: the newest intact one).
`examples.parquet` records each evaluation document's key and query positions, their distance,
and whether the model answers it (for accuracy and read-outs by distance). Results are written
atomically, and a run already evaluated with the same settings and checkpoint is skipped, so a
killed evaluation resumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from mecheval.evaluation.config import DEFAULTS, EvaluateConfig, check_options
from mecheval.evaluation.documents import (
    EvaluationDocuments,
    document_records,
    documents_key,
    documents_of,
)
from mecheval.evaluation.over_training import conv_sites, evaluate_over_training
from mecheval.evaluation.pretrained import evaluate_pretrained_run
from mecheval.interventions import interchange_grid
from mecheval.io import DamagedFileError
from mecheval.run_folder import files
from mecheval.run_folder.checkpoints import read_state, weights_sha256
from mecheval.run_folder.files import EXAMPLES, INTERVENTIONS, INTERVENTIONS_STAMP, RESULT
from mecheval.run_folder.pretrained import is_pretrained_run
from mecheval.run_folder.provenance import check_code
from mecheval.run_folder.status import finished_runs
from mecheval.run_folder.weights import load_trained_model, run_checkpoint
from mecheval.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """One run's evaluation, checked and ready: its config, documents and checkpoint."""

    run_dir: Path
    config: TrainConfig
    documents: EvaluationDocuments
    checkpoint: Path
    step: int
    code: str  # its architecture's code against training's (mecheval.run_folder.provenance)


def _plans(
    runs: Sequence[Path],
    options: EvaluateConfig,
    corruption_options: Mapping | None,
    allow_code_change: bool = False,
) -> list[_RunPlan]:
    """Check everything the runs' evaluations need, before any starts: their options, their
    architectures' code (mecheval.run_folder.provenance) and checkpoints."""
    configs = [files.read_run_config(run) for run in runs]
    code = check_code(runs, allow_code_change)
    documents = documents_of(configs, options, corruption_options)
    plans = []
    for run, config in zip(runs, configs, strict=True):
        checkpoint, step = run_checkpoint(run, options.step)
        docs = documents[documents_key(config)]
        plans.append(_RunPlan(run, config, docs, checkpoint, step, code[Path(run)]))
    return plans


def evaluate_run(
    run_dir: str | Path,
    corruptions: Sequence[str] | None = None,
    positions: Sequence[str] | None = None,
    split: str = DEFAULTS.split,
    device: str = DEFAULTS.device,
    seed: int = DEFAULTS.seed,
    memory_budget: int = DEFAULTS.memory_budget,
    force: bool = False,
    corruption_options: Mapping[str, object] | None = None,
    step: int | str | None = DEFAULTS.step,
    allow_code_change: bool = False,
) -> pd.DataFrame:
    """The interchange grids of one finished run (see the module docstring).

    Args:
        corruption_options: task options that only change how documents are corrupted
            (`task.corruption_options`, e.g. AR's corruption_range), overriding the run's.
        step: the checkpoint evaluated: None, the one the run's result names; a step number;
            or "latest", the newest intact one.
        allow_code_change: evaluate it even when its architecture's code changed since it
            was trained (else CodeChangedError).

    Returns:
        the grid table with identifying columns added: run, arch, d_model, n_layers, lr,
        task, step, corruption, replacement_ids, accuracy (the run's accuracy on these
        documents).

    Raises:
        OptionError: an option is bad, for this run's task (named, with what is allowed).
        CheckpointError: the checkpoint is missing or damaged.
    """
    options = check_options(
        EvaluateConfig(
            split=split,
            corruptions=None if corruptions is None else list(corruptions),
            positions=None if positions is None else list(positions),
            device=device,
            seed=seed,
            memory_budget=memory_budget,
            step=step,
        )
    )
    (plan,) = _plans([Path(run_dir)], options, corruption_options, allow_code_change)
    return _evaluate(plan, options, force)


def _settings(plan: _RunPlan, options: EvaluateConfig) -> dict:
    """What a stored evaluation was computed with: equal settings, equal results."""
    task = plan.documents.task
    state = read_state(plan.checkpoint)
    return {
        "corruptions": plan.documents.corruptions,
        "positions": plan.documents.positions,
        "split": options.split,
        "seed": options.seed,
        "corruption": {at: task.corruption_metadata(at) for at in plan.documents.corruptions},
        "checkpoint": {
            "step": plan.step,
            "sha256": weights_sha256(state),
        },
    }


def _evaluate(plan: _RunPlan, options: EvaluateConfig, force: bool) -> pd.DataFrame:
    run_dir, documents = plan.run_dir, plan.documents
    settings = _settings(plan, options)
    done = all((run_dir / name).exists() for name in (INTERVENTIONS, EXAMPLES, INTERVENTIONS_STAMP))
    stamp = files.read_stamp(run_dir, INTERVENTIONS_STAMP)
    if done and not force and stamp.get("settings") == settings:
        try:
            return files.read_table(run_dir, INTERVENTIONS)
        except DamagedFileError:
            pass  # evaluated anew, below
    device = options.device
    model, _, config = load_trained_model(run_dir, device=device, checkpoint=plan.checkpoint)
    batch = documents.batch.to(device)
    examples = document_records(model, batch)
    frames = []
    for at in documents.corruptions:
        corrupted = documents.corrupted[at].to(device)
        grid = _grids(model, batch, corrupted, documents.groups, options.memory_budget)
        low, high = documents.task.replacement_range(at)
        grid.insert(0, "replacement_ids", f"{low}..{high - 1}")
        grid.insert(0, "corruption", at)
        frames.append(grid)
    table = pd.concat(frames, ignore_index=True)
    accuracy = float(examples["correct"].mean())
    table = with_run_identity(table, run_dir, config, documents, plan.step, accuracy=accuracy)
    record = {
        "settings": settings,
        "documents": batch.num_documents,
        "answers": len(batch),
        "skipped": documents.skipped,
        "conv_sites": conv_sites(model),
        "code": plan.code,
    }
    written = {INTERVENTIONS: table, EXAMPLES: examples}
    files.write_stamped(run_dir, INTERVENTIONS_STAMP, written, record)
    return table


def with_run_identity(table, run_dir: Path, config, documents, step: int, **extra) -> pd.DataFrame:
    """`table` with the run's identifying columns first: run, arch, d_model, n_layers, lr,
    task, step, then `extra`'s."""
    identity = {
        "run": run_dir.name,
        "arch": config.model.arch,
        "d_model": config.model.d_model,
        "n_layers": config.model.n_layers,
        "lr": config.optim.lr,
        "task": documents.task.label(),
        "step": step,
        **extra,
    }
    for i, (name, value) in enumerate(identity.items()):
        table.insert(i, name, value)
    return table


def _grids(model, batch, corrupted, groups, memory_budget: int) -> pd.DataFrame:
    """The grid of every group of positions, each on the documents its positions lie inside
    (`example` indexes `batch`)."""
    frames = []
    for labels, rows in groups:
        if rows is None:
            frames.append(
                interchange_grid(
                    model, batch, corrupted, positions=labels, memory_budget=memory_budget
                )
            )
            continue
        rows = rows.to(batch.device)
        grid = interchange_grid(
            model, batch[rows], corrupted[rows], positions=labels, memory_budget=memory_budget
        )
        grid["example"] = rows.cpu().numpy()[grid["example"].to_numpy()]
        frames.append(grid)
    return pd.concat(frames, ignore_index=True)


def evaluation_summary(run_dir: str | Path) -> str:
    """One line on a run's stored evaluation: the checkpoint step it used, its documents and
    the positions that skipped some of them."""
    run_dir = Path(run_dir)
    record = files.read_stamp(run_dir, INTERVENTIONS_STAMP)
    if not record.get("settings"):
        return f"{run_dir}: not evaluated"
    documents, answers = record.get("documents"), record.get("answers")
    counted = f"{documents} documents"
    if answers not in (None, documents):
        counted = f"{answers} answers in {counted}"
    line = f"{run_dir}: step {files.evaluated_step(run_dir)}, {counted}"
    skipped = record.get("skipped") or {}
    if skipped:
        parts = ", ".join(f"{label} lies outside {n}" for label, n in skipped.items())
        line += f" ({parts}: skipped there)"
    return line


def evaluate_all(
    path: str | Path,
    progress: bool = True,
    over_training: bool = True,
    force: bool = False,
    corruption_options: Mapping[str, object] | None = None,
    allow_code_change: bool = False,
    **options,
) -> pd.DataFrame:
    """`evaluate_run` on every finished run under `path` (and, with `over_training`, the
    read-outs of every kept checkpoint: mecheval.evaluation.over_training); returns all grids
    concatenated. `options` are EvaluateConfig's fields. Every run's options, architecture's
    code and checkpoint are checked before the first is evaluated. A pretrained model's run
    folder is evaluated by mecheval.evaluation.pretrained."""
    checked = check_options(EvaluateConfig(**options))
    runs = finished_runs(path)
    if not runs:
        raise FileNotFoundError(f"no finished run in {path} (a run folder holds {RESULT})")
    pretrained = [run for run in runs if is_pretrained_run(run)]  # evaluation.pretrained's
    runs = [run for run in runs if run not in pretrained]
    plans = _plans(runs, checked, corruption_options, allow_code_change)
    tables = [evaluate_pretrained_run(run, checked, force) for run in pretrained]
    for plan in tqdm(plans, desc="evaluate", unit="run", disable=not progress):
        tables.append(_evaluate(plan, checked, force))
        if over_training:
            evaluate_over_training(
                plan.run_dir,
                split=checked.split,
                device=checked.device,
                seed=checked.seed,
                memory_budget=checked.memory_budget,
                force=force,
            )
    return pd.concat(tables, ignore_index=True)
