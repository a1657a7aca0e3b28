"""A run's evaluation documents: its task's documents of the evaluated split, corrupted, with
every asked position and corruption checked against them, and what the model answers on each.

    evaluation_documents(task, eval_size, options)   the documents of one task
    documents_of(configs, options)                   those of every run's task, made once each
    document_records(model, batch)                   per document: key and query positions,
                                                     their distance, correct, p_answer

A position that lies outside some documents (a shift past the end of a short document, an
index past it) is patched in the documents it lies inside only, and how many it skips is
recorded; a position inside no document is an `OptionError`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from mecheval.evaluation.config import EvaluateConfig, OptionError, task_positions
from mecheval.interventions.positions import expand_positions, inside_documents, parse_position
from mecheval.tasks import Batch, Task
from mecheval.train.config import TrainConfig, build_task


@dataclasses.dataclass(frozen=True)
class EvaluationDocuments:
    """A task's evaluation documents, corrupted, and where the asked positions lie in them.

    Attributes:
        task: the task (with the evaluation's corruption options).
        batch: the documents (on CPU), one row per (document, answer).
        corruptions: the corruptions evaluated (the options', or the task's own).
        positions: the position specs evaluated (the options', or `task_positions(task)`).
        corrupted: per corruption ("key", "value"), the corrupted tokens (n, L).
        groups: the position labels in groups that lie inside the same documents, each with
            those documents' indices (None: every document).
        skipped: per position that lies outside some documents, how many it skips.
    """

    task: Task
    batch: Batch
    corruptions: list[str]
    positions: list[str]
    corrupted: dict[str, torch.Tensor]
    groups: list[tuple[list[str], torch.Tensor | None]]
    skipped: dict[str, int]


def _outside_everywhere(label: str, batch: Batch, where: str) -> str:
    """Why position `label` is refused: it lies inside no document (`where` names them)."""
    parsed = parse_position(label)
    if isinstance(parsed, int):
        longest = int(batch.lengths.max())
        return f"{label} lies past the end of every {where} (the longest has {longest} tokens)"
    name, _ = parsed
    at = batch.positions[name]
    low, high = -int(at.max()), int((batch.lengths - 1 - at).max())
    return (
        f"{label!r} lies outside every {where} ({name}+k lies inside some of them for k "
        f"from {low} to +{high})"
    )


def evaluation_documents(
    task, eval_size: int, options: EvaluateConfig, corruption_options: Mapping | None = None
) -> EvaluationDocuments:
    """The documents `options` evaluates a run of `task` on (its `eval_size` documents of the
    split), corrupted, with every position and corruption checked against them.

    Raises:
        OptionError: a position lies inside none of the documents; a corruption cannot be
            drawn for this task (e.g. a one-key task has no other key).
    """
    task = _with_corruption_options(task, corruption_options or {})
    batch = task.dataset(options.split, size=eval_size)
    where = f"{options.split} document of {task.label()}"
    groups: dict[bytes, tuple[list[str], torch.Tensor]] = {}
    skipped = {}
    positions = options.positions or task_positions(task)
    for label in expand_positions(positions, batch.width, batch.roles):
        parsed = parse_position(label)
        if not isinstance(parsed, int) and parsed[0] not in batch.roles:
            raise OptionError(
                "positions",
                f"{label!r} is not a position of {task.name}'s documents: use its roles "
                f"({', '.join(batch.roles)}), optionally shifted (value+1, key-1), an index "
                "(0, 1, ...), or all",
            )
        inside = inside_documents(label, batch)
        if not inside.any():
            raise OptionError("positions", _outside_everywhere(label, batch, where))
        if not inside.all():
            skipped[label] = int((~inside).sum())
        groups.setdefault(inside.numpy().tobytes(), ([], inside))[0].append(label)
    corruptions = options.corruptions or list(task.corruptions)
    corrupted = {}
    for at in corruptions:
        if at not in task.corruptions:
            allowed = " and/or ".join(task.corruptions)
            raise OptionError(
                "corruptions", f"{at!r} is not a corruption of {task.name}: use {allowed}"
            )
        try:
            corrupted[at] = task.corrupt(batch, at, seed=options.seed)
        except ValueError as error:
            raise OptionError("corruptions", str(error)) from None
    return EvaluationDocuments(
        task=task,
        batch=batch,
        corruptions=corruptions,
        positions=positions,
        corrupted=corrupted,
        groups=[
            (labels, None if inside.all() else inside.nonzero()[:, 0])
            for labels, inside in groups.values()
        ],
        skipped=skipped,
    )


def _with_corruption_options(task, options: Mapping[str, object]):
    unknown = sorted(set(options) - set(task.corruption_options))
    if unknown:
        raise ValueError(
            f"corruption_options {unknown} are not corruption options of task {task.name!r} "
            f"(its options: {list(task.corruption_options) or 'none'})"
        )
    return dataclasses.replace(task, **options) if options else task


def documents_key(config: TrainConfig) -> str:
    """Runs with equal keys are evaluated on the same documents."""
    task = config.task
    return json.dumps([task.name, task.options, task.eval_size], sort_keys=True)


def documents_of(
    configs: Sequence[TrainConfig],
    options: EvaluateConfig,
    corruption_options: Mapping | None = None,
) -> dict[str, EvaluationDocuments]:
    """The evaluation documents of the runs of `configs`, made and checked once per task
    (`evaluation_documents`), by `documents_key`."""
    documents: dict[str, EvaluationDocuments] = {}
    for config in configs:
        key = documents_key(config)
        if key not in documents:
            task = build_task(config)
            eval_size = config.task.eval_size
            documents[key] = evaluation_documents(task, eval_size, options, corruption_options)
    return documents


@torch.no_grad()
def document_records(model, batch) -> pd.DataFrame:
    """Per evaluation row (document, answer): example index, document, key and query
    positions, distance (query - key; NaN for a task without a key role), correct (the answer
    is the argmax at the query), p_answer (its probability)."""
    was_training = model.training
    model.eval()
    correct, p_answer = [], []
    for start in range(0, len(batch), 256):
        part = batch[start : start + 256]
        width = int(part.lengths.max())
        logits = model(part.tokens[:, :width], at=part.positions["query"]).float()
        correct.append(logits.argmax(-1) == part.answers)
        p_answer.append(logits.softmax(-1).gather(1, part.answers[:, None])[:, 0])
    model.train(was_training)
    query = batch.positions["query"].cpu().numpy()
    key = batch.positions["key"].cpu().numpy() if "key" in batch.positions else np.nan
    return pd.DataFrame(
        {
            "example": range(len(batch)),
            "document": batch.documents().cpu().numpy(),
            "key_position": key,
            "query_position": query,
            "distance": query - key,
            "correct": torch.cat(correct).cpu().numpy(),
            "p_answer": torch.cat(p_answer).cpu().numpy(),
        }
    )
