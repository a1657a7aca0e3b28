"""Mechanistic evaluation of trained runs: the interchange grids of every run, stored as
Parquet next to its checkpoint.

    evaluate_run(run_dir)    one run  -> run_dir/interventions.parquet, run_dir/examples.parquet
    evaluate_all(path)       a run folder, or a folder of runs (a sweep): every finished run;
                             also the read-outs of every kept checkpoint
                             (mecheval.over_training)

For each run: its evaluation documents (the dev split, `task.eval_size` of them), corrupted at
the key and, separately, at the value; every layer and site of the model at the named
positions key, value, divider, query and the two after the value (value+1, the next key in
AR, and value+2: the study's Mamba conv analysis patches those). Each row records the id range
its corrupting tokens were drawn from (`replacement_ids`, e.g. "3..4098": in AR both key and
value corruption draw key ids by default, as the study does; `corruption_options=
{"corruption_range": "own"}` draws each position's own kind instead, without retraining).
`examples.parquet` records each evaluation document's key and query positions, their
distance, and whether the model answers it (for accuracy and read-outs by distance). Results
are written atomically, and a run already evaluated with the same settings is skipped, so a
killed evaluation resumes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from mecheval.evaluate_config import CORRUPTIONS, DEFAULTS, POSITIONS
from mecheval.interventions import interchange_grid
from mecheval.io import atomic_write_json, atomic_write_parquet
from mecheval.train.loop import RESULT, load_trained_model

INTERVENTIONS = "interventions.parquet"
EXAMPLES = "examples.parquet"


def _positions_for(batch, wanted: Sequence[str]) -> list[str]:
    """The wanted positions that lie inside every document (value+2 can pass the end in ATR)."""
    from mecheval.interventions import resolve_position

    kept = []
    for label in wanted:
        try:
            resolve_position(label, batch)
        except ValueError:
            continue
        kept.append(label)
    return kept


def evaluate_run(
    run_dir: str | Path,
    corruptions: Sequence[str] = CORRUPTIONS,
    positions: Sequence[str] = POSITIONS,
    split: str = DEFAULTS.split,
    device: str = DEFAULTS.device,
    seed: int = DEFAULTS.seed,
    memory_budget: int = DEFAULTS.memory_budget,
    force: bool = False,
    corruption_options: Mapping[str, object] | None = None,
) -> pd.DataFrame:
    """The interchange grids of one finished run (see the module docstring).

    Args:
        corruption_options: task options that only change how documents are corrupted
            (`task.corruption_options`, e.g. AR's corruption_range), overriding the run's.

    Returns:
        the grid table with identifying columns added: run, arch, d_model, n_layers, lr,
        task, corruption, replacement_ids, accuracy (the run's accuracy on these documents).
    """
    run_dir = Path(run_dir)
    out = run_dir / INTERVENTIONS
    model, task, config = load_trained_model(run_dir, device=device)
    task = _with_corruption_options(task, corruption_options or {})
    settings = {
        "corruptions": list(corruptions),
        "positions": list(positions),
        "split": split,
        "seed": seed,
        "corruption": {at: task.corruption_metadata(at) for at in corruptions},
    }
    stamp = run_dir / "interventions.json"
    done = out.exists() and (run_dir / EXAMPLES).exists() and stamp.exists()
    if done and not force and json.loads(stamp.read_text()) == settings:
        return pd.read_parquet(out)
    batch = task.dataset(split, size=config.task.eval_size).to(device)
    examples = document_records(model, batch)
    acc = float(examples["correct"].mean())
    labels = _positions_for(batch, positions)
    frames = []
    for at in corruptions:
        corrupted = task.corrupt(batch, at=at, seed=seed)
        grid = interchange_grid(
            model, batch, corrupted, positions=labels, memory_budget=memory_budget
        )
        low, high = task.replacement_range(at)
        grid.insert(0, "replacement_ids", f"{low}..{high - 1}")
        grid.insert(0, "corruption", at)
        frames.append(grid)
    table = pd.concat(frames, ignore_index=True)
    identity = {
        "run": run_dir.name,
        "arch": config.model.arch,
        "d_model": config.model.d_model,
        "n_layers": config.model.n_layers,
        "lr": config.optim.lr,
        "task": task.label(),
        "accuracy": acc,
    }
    for i, (name, value) in enumerate(identity.items()):
        table.insert(i, name, value)
    atomic_write_parquet(out, table)
    atomic_write_parquet(run_dir / EXAMPLES, examples)
    atomic_write_json(stamp, settings)
    return table


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


def _with_corruption_options(task, options: Mapping[str, object]):
    unknown = sorted(set(options) - set(task.corruption_options))
    if unknown:
        raise ValueError(
            f"corruption_options {unknown} are not corruption options of task {task.name!r} "
            f"(its options: {list(task.corruption_options) or 'none'})"
        )
    return dataclasses.replace(task, **options) if options else task


def finished_runs(path: str | Path) -> list[Path]:
    """`path` itself if it is a finished run, else its finished runs (one level down)."""
    path = Path(path)
    if (path / RESULT).exists():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{RESULT}"))


def evaluate_all(
    path: str | Path, progress: bool = True, over_training: bool = True, **options
) -> pd.DataFrame:
    """`evaluate_run` on every finished run under `path` (and, with `over_training`, the
    read-outs of every kept checkpoint: mecheval.over_training); returns all grids
    concatenated."""
    from mecheval.over_training import evaluate_over_training

    runs = finished_runs(path)
    if not runs:
        raise FileNotFoundError(f"no finished run in {path} (a run folder holds {RESULT})")
    tables = []
    for run in tqdm(runs, desc="evaluate", unit="run", disable=not progress):
        tables.append(evaluate_run(run, **options))
        if over_training:
            keep = ("split", "device", "seed", "memory_budget", "force")
            evaluate_over_training(run, **{k: v for k, v in options.items() if k in keep})
    return pd.concat(tables, ignore_index=True)
