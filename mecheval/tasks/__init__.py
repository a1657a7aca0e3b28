"""The study's tasks (docs/study.md): associative recall (AR) and associative treecall (ATR).

from mecheval.tasks import make_task

task = make_task("ar")                                    # or make_task("atr", max_rhs_len=5,
batch = task.sample(32, seed=0, split="train")            #     num_terminals=20)
corrupted = task.corrupt(batch, at="key", seed=0)
train = task.dataset("train")                             # 100,032 documents, cached on disk
print(task.format(batch.tokens[0]))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mecheval.tasks.associative_recall import AssociativeRecall
from mecheval.tasks.associative_treecall import AssociativeTreecall, TreeAnnotations
from mecheval.tasks.base import DATASET_SEED, DATASET_SIZES, SPLITS, Task
from mecheval.tasks.batch import POSITION_NAMES, Batch, concat_batches
from mecheval.tasks.stats import across_grammar_seeds, stats_table, task_stats

TASKS: dict[str, type[Task]] = {"ar": AssociativeRecall, "atr": AssociativeTreecall}


def make_task(name: str, **options: Any) -> Task:
    """Build a task by name with typed, validated options.

    Args:
        name: "ar" (options: num_pairs, num_keys, query, holdout, corruption_range,
            query_ids) or "atr" (options: max_rhs_len, num_terminals, terminal_factor,
            num_nonterminals, max_depth, max_rules, holdout, seed, max_length, query, draw).
        **options: the task's options; `make_task(name, **task.config())` rebuilds `task`.

    Raises:
        ValueError: unknown task name, or an option with an impossible value (named).
        TypeError: unknown option, missing required option or wrong type (named).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    task_class = TASKS[name]
    valid = [field.name for field in dataclasses.fields(task_class) if field.init]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for task {name!r}; valid options: {valid}")
    return task_class(**options)


__all__ = [
    "DATASET_SEED",
    "DATASET_SIZES",
    "POSITION_NAMES",
    "SPLITS",
    "TASKS",
    "AssociativeRecall",
    "AssociativeTreecall",
    "Batch",
    "Task",
    "TreeAnnotations",
    "across_grammar_seeds",
    "concat_batches",
    "make_task",
    "stats_table",
    "task_stats",
]
