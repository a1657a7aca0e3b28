"""`check_task`: a task against the contract of docs/tasks.md (mecheval.tasks.Task)."""

from __future__ import annotations

import functools
import itertools

import torch

from mecheval.models import build_model
from mecheval.tasks import Task, make_task
from mecheval.testing.report import Check, TaskCheckError, TaskReport, grid_against_loop


def check_task(
    task: str | Task | type[Task],
    *,
    options: dict | None = None,
    n: int = 24,
    seed: int = 0,
    grid: bool = True,
    arch: str = "attention",
) -> TaskReport:
    """Check a task against the contract (docs/tasks.md): its documents are a function of
    (options, seed, split); its declared splits share no document; every role of every answer
    lies inside its document; every corruption changes exactly the tokens of the role it names,
    within its replacement range; an oracle reading each answer off its document (`Task.oracle`)
    is always right; and the interchange grid of a small `arch` model on its documents equals
    the per-cell loop.

    Args:
        task: a registered name or import path (built with `options`), a `Task` subclass, or a
            task.
        n: documents sampled per split; seed: their seed.
        grid: run the grid check (the slowest).

    Returns:
        the report; raises TaskCheckError when a check fails (one line each).
    """
    try:
        if isinstance(task, Task):
            built = task
        elif isinstance(task, type):
            built = task(**(options or {}))
        else:
            built = make_task(task, **(options or {}))
    except Exception as error:  # the task's own code failing is what the report is for
        report = TaskReport(str(task), [Check("build", False, f"{type(error).__name__}: {error}")])
        raise TaskCheckError(report) from error
    report = TaskReport(built.label())
    checks = [_determinism, _splits, _roles, _corruptions, _oracle]
    if grid:
        checks.append(functools.partial(_task_grid, arch=arch))
    for check in checks:
        try:
            report.checks.append(check(built, n, seed))
        except Exception as error:  # the task's code raised: name it, go on
            name = getattr(check, "func", check).__name__.strip("_").replace("task_", "")
            report.checks.append(Check(name, False, f"raised {type(error).__name__}: {error}"))
    if report.failed:
        raise TaskCheckError(report)
    return report


def _determinism(task: Task, n: int, seed: int) -> Check:
    a, b = task.sample(n, seed, "train"), task.sample(n, seed, "train")
    if not a.equals(b):
        return Check("determinism", False, f"two samples of seed {seed} differ")
    other = task.sample(n, seed + 1, "train")
    if other.tokens.shape == a.tokens.shape and torch.equal(other.tokens, a.tokens):
        return Check("determinism", False, f"seeds {seed} and {seed + 1} give the same documents")
    return Check("determinism", True, f"{n} documents a function of the seed")


def _documents(batch) -> set[bytes]:
    first = batch.document_starts[:-1]
    return {
        row[: int(length)].numpy().tobytes()
        for row, length in zip(batch.tokens[first], batch.lengths[first], strict=True)
    }


def _splits(task: Task, n: int, seed: int) -> Check:
    documents = {split: _documents(task.sample(n, seed, split)) for split in task.splits}
    for a, b in itertools.combinations(task.splits, 2):
        shared = len(documents[a] & documents[b])
        if shared:
            return Check("splits", False, f"{shared} of {n} documents are in both {a} and {b}")
    return Check("splits", True, f"{', '.join(task.splits)} share none of {n} documents each")


def _roles(task: Task, n: int, seed: int) -> Check:
    batch = task.sample(n, seed, task.splits[-1])
    missing = [role for role in task.roles if role not in batch.positions]
    if missing or "query" not in task.roles:
        return Check("roles", False, f"the documents name no role {missing or ['query']}")
    for role in batch.roles:
        start, stop = batch.span(role)
        anchor = batch.positions[role]
        bad = (start < 0) | (stop > batch.lengths) | (start >= stop)
        bad |= (anchor < start) | (anchor >= stop)
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            return Check("roles", False, f"role {role!r} of row {row} lies outside its document")
    if (batch.lengths > task.max_document_length).any():
        return Check("roles", False, f"a document is longer than {task.max_document_length}")
    for name, ids in (("tokens", batch.tokens), ("answers", batch.answers)):
        if int(ids.min()) < 0 or int(ids.max()) >= task.vocab_size:
            return Check("roles", False, f"{name} outside the vocabulary 0..{task.vocab_size - 1}")
    return Check("roles", True, f"{', '.join(batch.roles)} inside every document")


def _corruptions(task: Task, n: int, seed: int) -> Check:
    batch = task.sample(n, seed, task.splits[-1])
    columns = torch.arange(batch.width)
    for name, corruption in task.corruptions.items():
        if corruption.role not in task.roles:
            return Check("corruptions", False, f"{name} changes {corruption.role!r}, no role")
        changed = task.corrupt(batch, name, seed) != batch.tokens
        start, stop = batch.span(corruption.role)
        span = (columns >= start[:, None]) & (columns < stop[:, None])
        if not torch.equal(changed, span):
            row = int((changed != span).any(1).nonzero()[0, 0])
            return Check(
                "corruptions", False, f"{name} changes other tokens than {corruption.role!r}'s "
                f"(row {row})"
            )  # fmt: skip
        low, high = task.replacement_range(name)
        drawn = task.corrupt(batch, name, seed)[span]
        if int(drawn.min()) < low or int(drawn.max()) >= high:
            return Check("corruptions", False, f"{name} draws outside [{low}, {high})")
    names = ", ".join(f"{k} ({c.role})" for k, c in task.corruptions.items())
    return Check("corruptions", True, f"{names}: exactly the role's tokens change")


def _oracle(task: Task, n: int, seed: int) -> Check:
    batch = task.sample(n, seed, task.splits[-1])
    right = float((task.oracle(batch) == batch.answers).float().mean())
    return Check("oracle", right == 1.0, f"reads {right:.1%} of {len(batch)} answers off")


def _task_grid(task: Task, n: int, seed: int, arch: str) -> Check:
    batch = task.sample(max(1, n // 8), seed, task.splits[-1])[:8]
    name = next(iter(task.corruptions))
    corrupted = task.corrupt(batch, name, seed)
    torch.manual_seed(seed)
    model = build_model(arch, task.vocab_size, 16, max_len=task.max_document_length).eval()
    with torch.no_grad():  # sharper weights than the init: patches then matter
        for p in model.parameters():
            p.mul_(4.0)
    return grid_against_loop(
        model, batch, corrupted, 1e-5, 1e-4, f"cells of an {arch} model equal the per-cell loop"
    )
