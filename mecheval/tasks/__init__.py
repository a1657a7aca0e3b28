"""Tasks: the contract every task states in code (`Task`, docs/tasks.md), a registry by name or
import path, and the tasks shipped: the study's associative recall (AR) and associative treecall
(ATR), zoology's multi-query associative recall (MQAR), MAD's recall tasks, and recall in
natural language for pretrained models (`prompts`: mecheval.tasks.prompts).

from mecheval.tasks import make_task

task = make_task("ar")                                    # or make_task("mqar", num_kv_pairs=8)
batch = task.sample(32, seed=0, split="train")            # one row per (document, answer)
corrupted = task.corrupt(batch, "key", seed=0)
train = task.dataset("train")                             # 100,032 documents, cached on disk
print(task.format(batch.tokens[0]))
"""

from __future__ import annotations

from mecheval.tasks.associative_recall import AssociativeRecall
from mecheval.tasks.associative_treecall import AssociativeTreecall, TreeAnnotations
from mecheval.tasks.base import DATASET_SEED, DATASET_SIZES, SPLITS, Corruption, Task
from mecheval.tasks.batch import IGNORE, POSITION_NAMES, Batch, concat_batches
from mecheval.tasks.mad import FuzzyRecall, InContextRecall, NoisyRecall
from mecheval.tasks.mqar import MultiQueryAR
from mecheval.tasks.prompts import PromptRecall
from mecheval.tasks.registry import (
    make_task,
    register_task,
    registered_tasks,
    task_class,
    unregister_task,
)
from mecheval.tasks.stats import across_grammar_seeds, stats_table, task_stats

for _task in (
    AssociativeRecall,
    AssociativeTreecall,
    MultiQueryAR,
    InContextRecall,
    NoisyRecall,
    FuzzyRecall,
    PromptRecall,
):
    register_task(_task.name, _task)

__all__ = [
    "DATASET_SEED",
    "DATASET_SIZES",
    "IGNORE",
    "POSITION_NAMES",
    "SPLITS",
    "AssociativeRecall",
    "AssociativeTreecall",
    "Batch",
    "Corruption",
    "FuzzyRecall",
    "InContextRecall",
    "MultiQueryAR",
    "NoisyRecall",
    "PromptRecall",
    "Task",
    "TreeAnnotations",
    "across_grammar_seeds",
    "concat_batches",
    "make_task",
    "register_task",
    "registered_tasks",
    "stats_table",
    "task_class",
    "task_stats",
    "unregister_task",
]
