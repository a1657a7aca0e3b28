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

import pandas as pd
import torch

from mecheval.evaluation.config import EvaluateConfig, OptionError
from mecheval.interventions.positions import expand_positions, inside_documents, parse_position
from mecheval.tasks import Batch, Task
from mecheval.train.config import TrainConfig, build_task


@dataclasses.dataclass(frozen=True)
class EvaluationDocuments:
    """A task's evaluation documents, corrupted, and where the asked positions lie in them.

    Attributes:
        task: the task (with the evaluation's corruption options).
        batch: the documents (on CPU).
        corrupted: per corruption ("key", "value"), the corrupted tokens (n, L).
        groups: the position labels in groups that lie inside the same documents, each with
            those documents' indices (None: every document).
        skipped: per position that lies outside some documents, how many it skips.
    """

    task: Task
    batch: Batch
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
    for label in expand_positions(options.positions, batch.width):
        inside = inside_documents(label, batch)
        if not inside.any():
            raise OptionError("positions", _outside_everywhere(label, batch, where))
        if not inside.all():
            skipped[label] = int((~inside).sum())
        groups.setdefault(inside.numpy().tobytes(), ([], inside))[0].append(label)
    corrupted = {}
    for at in options.corruptions:
        try:
            corrupted[at] = task.corrupt(batch, at=at, seed=options.seed)
        except ValueError as error:
            raise OptionError("corruptions", str(error)) from None
    return EvaluationDocuments(
        task=task,
        batch=batch,
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
    """Per evaluation document: example index, key and query positions, distance (query -
    key), correct (the answer is the argmax at the query), p_answer (its probability)."""
    was_training = model.training
    model.eval()
    correct, p_answer = [], []
    for start in range(0, len(batch), 256):
        part = batch[start : start + 256]
        width = int(part.lengths.max())
        logits = model(part.tokens[:, :width], positions=part.positions["query"]).float()
        correct.append(logits.argmax(-1) == part.answers)
        p_answer.append(logits.softmax(-1).gather(1, part.answers[:, None])[:, 0])
    model.train(was_training)
    key, query = batch.positions["key"].cpu(), batch.positions["query"].cpu()
    return pd.DataFrame(
        {
            "example": range(len(batch)),
            "key_position": key.numpy(),
            "query_position": query.numpy(),
            "distance": (query - key).numpy(),
            "correct": torch.cat(correct).cpu().numpy(),
            "p_answer": torch.cat(p_answer).cpu().numpy(),
        }
    )
