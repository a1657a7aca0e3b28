"""Pretrained models through the evaluation: the run folder of a Hugging Face checkpoint on
the `prompts` task, its interchange grids, and what DAS and the report read of it.

    evaluate_pretrained("hf:openai-community/gpt2", "prompts.yaml", "runs/hf_gpt2")
        `mecheval evaluate --model hf:ID --task prompts.yaml --out DIR`: writes the run folder
        (mecheval.run_folder.pretrained: pretrained.yaml, result.json), then its grids
    evaluate_pretrained_run(run_dir, options)
        the grids of such a folder (what `mecheval evaluate DIR` does to it); `mecheval das
        DIR` and `mecheval report DIR` read it as they read a trained run

The task file is YAML: the `prompts` task's options (mecheval.tasks.prompts); its `tokenizer`,
when left out, is the checkpoint's. The documents, corruptions and positions are those the
evaluation of a trained run takes (mecheval.evaluation.documents), `eval_size` of each split.
result.json records the model's accuracy on the dev and test documents (the answer the argmax
at the query) and the checkpoint's provenance; a stamp (interventions.json) names the
checkpoint's sha256 and the task's key (its options and tokenizer), so an evaluation of the
same checkpoint, task and settings is read back, and one of a changed checkpoint is redone.

Memory: each grid call takes as many documents as keep its floor (what it holds whatever its
chunks: `mecheval.interventions.plan.GridMemory`) within half the memory budget
(`documents_per_call`), its chunks the rest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import torch

from mecheval.config import ConfigError, read_yaml, to_dict
from mecheval.evaluation.config import EvaluateConfig, OptionError, check_options
from mecheval.evaluation.documents import document_records, evaluation_documents
from mecheval.evaluation.over_training import conv_sites
from mecheval.interventions import interchange_grid
from mecheval.interventions.plan import documents_per_call
from mecheval.io import DamagedFileError, atomic_write_json
from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.load import checkpoint_folder
from mecheval.run_folder import files
from mecheval.run_folder.files import EXAMPLES, INTERVENTIONS, INTERVENTIONS_STAMP, RESULT
from mecheval.run_folder.pretrained import (
    PRETRAINED_CODE,
    ModelSource,
    PretrainedRun,
    checkpoint_files,
    files_sha256,
    is_pretrained_run,
    read_pretrained_run,
    write_pretrained_run,
)
from mecheval.tasks import make_task
from mecheval.train.config import TaskSection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TASK = "prompts"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A pretrained run, resolved: its config, its task (tokenizer read, fillers checked), the
    checkpoint's folder, its files' sha256 and their one sha256 (the run's provenance)."""

    run: PretrainedRun
    task: object
    folder: Path
    files: dict[str, str]
    sha256: str

    def model(self, device: str) -> torch.nn.Module:
        """The checkpoint read in the run's dtype, in eval mode on `device`; its vocabulary
        checked against the tokenizer's."""
        run = self.run
        try:
            model = from_pretrained(self.folder, dtype=DTYPES[run.model.dtype])
        except ValueError as error:
            raise ConfigError(f"--model {run.model.source}: {error}") from None
        if self.task.vocab_size > model.config.vocab_size:
            raise ConfigError(
                f"{run.model.source}: the tokenizer {run.task.options['tokenizer']!r} has "
                f"{self.task.vocab_size} ids, the model {model.config.vocab_size}: not its "
                "tokenizer"
            )
        return model.to(device).eval()


def read_task_file(path: str | Path) -> dict:
    """The `prompts` task's options a YAML task file holds (a ConfigError names the file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--task {path}: no such file (a YAML file of the prompts task's options)"
        )
    options = read_yaml(path, "task file")
    if not isinstance(options, dict):
        raise ConfigError(
            f"{path}: the task file must hold a mapping of the prompts task's options"
        )
    return options


def task_of(run: PretrainedRun, where: str = PRETRAINED_CODE):
    """The run's task, its tokenizer read and every filler checked (a ConfigError naming
    `where`, the file its options came from, otherwise)."""
    try:
        task = make_task(run.task.name, **run.task.options)
        task.max_document_length  # noqa: B018  (loads the tokenizer and checks the fillers)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: task {run.task.name}: {error}") from None
    return task


def resolve(run_dir: Path) -> Checkpoint:
    """The run folder's config and task, and its checkpoint's folder (a hub id downloaded
    unless cached) and files' sha256."""
    run = read_pretrained_run(run_dir)
    task = task_of(run, str(run_dir / "pretrained.yaml"))
    try:
        folder = checkpoint_folder(run.model.source)
    except ValueError as error:
        raise ConfigError(f"--model {run.model.source}: {error}") from None
    checkpoint = checkpoint_files(folder)
    return Checkpoint(run, task, folder, checkpoint, files_sha256(checkpoint))


def evaluate_pretrained(
    model: str,
    task: str | Path | Mapping,
    out: str | Path,
    *,
    eval_size: int | None = None,
    dtype: str = "float32",
    force: bool = False,
    **options,
) -> pd.DataFrame:
    """The run folder `out` of checkpoint `model` (a folder or hub id, "hf:" allowed) on the
    prompts task of `task` (a YAML file of its options, or the options), and its grids.

    Args:
        eval_size: documents per split (default: a trained run's, 320).
        dtype: the checkpoint's dtype: float32 (the grid's precision), bfloat16 or float16.
        force: evaluate again even where the stored grids have the same settings.
        options: EvaluateConfig's fields (split, corruptions, positions, device, seed,
            memory_budget; `step` refused: a checkpoint has one).

    Returns:
        the grid table, as `evaluate_run`'s (arch is the checkpoint's family, lr and step 0).

    Raises:
        ConfigError: a bad option, task file or checkpoint (named); another run in `out`.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    checked = _checked(options)
    given = read_task_file(task) if isinstance(task, (str, Path)) else dict(task)
    given.setdefault("tokenizer", str(model).removeprefix("hf:"))
    section = TaskSection(name=TASK, options=given)
    if eval_size is not None:
        section.eval_size = eval_size
    run = PretrainedRun(ModelSource(str(model), dtype), section)
    if section.eval_size < 1:
        raise ConfigError(f"--eval-size must be >= 1, got {section.eval_size}")
    task_of(run, str(task) if isinstance(task, (str, Path)) else "task")
    out = Path(out)
    _refuse_another_run(out, run)
    out.mkdir(parents=True, exist_ok=True)
    write_pretrained_run(out, run)
    return evaluate_pretrained_run(out, checked, force)


def _checked(options: Mapping) -> EvaluateConfig:
    checked = check_options(EvaluateConfig(**options))
    if checked.step is not None:
        raise OptionError("step", "a pretrained checkpoint has no steps to choose from")
    return checked


def _refuse_another_run(out: Path, run: PretrainedRun) -> None:
    """A ConfigError when `out` holds a trained run, or a pretrained run of another checkpoint
    or task."""
    if (out / files.CONFIG).exists() or (out / files.CHECKPOINTS).exists():
        raise ConfigError(f"--out {out} holds a trained run; use another folder")
    if is_pretrained_run(out) and to_dict(read_pretrained_run(out)) != to_dict(run):
        raise ConfigError(
            f"--out {out} holds the run of another checkpoint or task (its pretrained.yaml); "
            "use another folder or delete it"
        )


def evaluate_pretrained_run(
    run_dir: str | Path, options: EvaluateConfig, force: bool = False
) -> pd.DataFrame:
    """The grids of a pretrained run folder (its result.json written first when missing or of
    another checkpoint), or those stored when their stamp names the same settings."""
    run_dir = Path(run_dir)
    options = _checked(dataclasses.asdict(options))
    checkpoint = resolve(run_dir)
    documents = evaluation_documents(checkpoint.task, checkpoint.run.task.eval_size, options)
    settings = _settings(checkpoint, documents, options)
    fresh = _result_sha256(run_dir) == checkpoint.sha256 and not force
    stamp = files.read_stamp(run_dir, INTERVENTIONS_STAMP)
    if fresh and stamp.get("settings") == settings:
        try:
            return files.read_table(run_dir, INTERVENTIONS)
        except DamagedFileError:
            pass  # evaluated anew, below
    model, batch = checkpoint.model(options.device), documents.batch.to(options.device)
    if not fresh:
        write_result(run_dir, checkpoint, model, documents.batch)
    frames = []
    for at in documents.corruptions:
        corrupted = documents.corrupted[at].to(options.device)
        grid = grids(model, batch, corrupted, documents.groups, options.memory_budget)
        low, high = documents.task.replacement_range(at)
        grid.insert(0, "replacement_ids", f"{low}..{high - 1}")
        grid.insert(0, "corruption", at)
        frames.append(grid)
    examples = document_records(model, batch)
    accuracy = float(examples["correct"].mean())
    table = pd.concat(frames, ignore_index=True)
    table = with_identity(table, run_dir, checkpoint, model, accuracy=accuracy)
    record = {
        "settings": settings,
        "documents": batch.num_documents,
        "answers": len(batch),
        "skipped": documents.skipped,
        "conv_sites": conv_sites(model),
        "code": PRETRAINED_CODE,
    }
    files.write_stamped(
        run_dir, INTERVENTIONS_STAMP, {INTERVENTIONS: table, EXAMPLES: examples}, record
    )
    return table


def _settings(checkpoint: Checkpoint, documents, options: EvaluateConfig) -> dict:
    """What a stored evaluation was computed with: equal settings, equal results."""
    task = documents.task
    return {
        "corruptions": documents.corruptions,
        "positions": documents.positions,
        "split": options.split,
        "seed": options.seed,
        "corruption": {at: task.corruption_metadata(at) for at in documents.corruptions},
        "task_key": task.key(),
        "checkpoint": {"step": 0, "sha256": checkpoint.sha256},
    }


def _result_sha256(run_dir: Path) -> str | None:
    if not (run_dir / RESULT).exists():
        return None
    try:
        return files.read_result(run_dir).get("checkpoint_sha256")
    except DamagedFileError:
        return None


def write_result(run_dir: Path, checkpoint: Checkpoint, model, dev) -> dict:
    """result.json of a pretrained run (mecheval.run_folder.pretrained): the model's accuracy
    on the dev documents `dev` and as many test documents, and the checkpoint's provenance."""
    start = time.perf_counter()
    run = checkpoint.run
    test = checkpoint.task.dataset("test", size=run.task.eval_size)
    device = next(model.parameters()).device
    dev_accuracy, test_accuracy = (
        float(document_records(model, batch.to(device))["correct"].mean()) for batch in (dev, test)
    )
    config = {
        "task": to_dict(run.task),
        "model": {**identity(model), "source": run.model.source, "dtype": run.model.dtype},
        "optim": {"lr": 0.0},
        "seed": None,
    }
    result = {
        "run": run_dir.name,
        "config": config,
        "steps": 0,
        "dev_accuracy": dev_accuracy,
        "test_accuracy": test_accuracy,
        "best_accuracy": dev_accuracy,
        "wall_time_s": time.perf_counter() - start,
        "num_params": model.num_params(),
        "checkpoint": run.model.source,
        "checkpoint_step": None,
        "checkpoint_sha256": checkpoint.sha256,
        "checkpoint_folder": str(checkpoint.folder),
        "files": checkpoint.files,
    }
    atomic_write_json(run_dir / RESULT, result)
    return result


def identity(model) -> dict:
    """The model's identity as a trained run's: its family as `arch`, width and depth."""
    config = model.config
    return {"arch": config.family, "d_model": config.d_model, "n_layers": config.n_layers}


def with_identity(table: pd.DataFrame, run_dir: Path, checkpoint, model, **extra) -> pd.DataFrame:
    """`table` with a run's identifying columns first (as `with_run_identity`'s: run, arch,
    d_model, n_layers, lr, task, step), lr and step 0, then `extra`'s."""
    columns = {
        "run": run_dir.name,
        **identity(model),
        "lr": 0.0,
        "task": checkpoint.task.label(),
        "step": 0,
        **extra,
    }
    for i, (name, value) in enumerate(columns.items()):
        table.insert(i, name, value)
    return table


def grids(model, batch, corrupted, groups, memory_budget: int) -> pd.DataFrame:
    """The grid of every group of positions, each on the documents its positions lie inside
    (`example` indexes `batch`), in calls of as many documents as `documents_per_call` keeps
    within the budget."""
    frames = []
    for labels, rows in groups:
        rows = torch.arange(len(batch)) if rows is None else rows
        rows = rows.to(batch.device)
        step = documents_per_call(model, batch[rows], positions=labels, memory_budget=memory_budget)
        for first in range(0, len(rows), step):
            part = rows[first : first + step]
            grid = interchange_grid(
                model, batch[part], corrupted[part], positions=labels, memory_budget=memory_budget
            )
            grid["example"] = part.cpu().numpy()[grid["example"].to_numpy()]
            frames.append(grid)
    return pd.concat(frames, ignore_index=True)
