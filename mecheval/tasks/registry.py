"""Tasks by name: one table from a name to a `Task` subclass, as mixers have theirs.

    register_task("mytask", MyTask)            a task of your own, by name
    task_class("mypackage.tasks:MyTask")       a task named by import path (nothing to register)
    make_task("mqar", num_pairs=8)             a task with its options checked

Names are what configs, run folders and reports record: a run of a registered name needs that
registration in the process that loads it again; an import path needs nothing. The current
directory is searched too, as `python -m` would.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from mecheval.imports import import_module
from mecheval.tasks.base import Task

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_REGISTRY: dict[str, type[Task]] = {}


def register_task(name: str, task: type[Task], *, replace: bool = False) -> type[Task]:
    """Register the `Task` subclass `task` under `name` and return it.

    Args:
        name: letters, digits, "_", "." and "-" (":" marks import paths).
        task: a frozen dataclass deriving from `mecheval.tasks.Task`.
        replace: allow replacing an entry of that name (else a second registration is an error).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"task name {name!r} must be letters, digits, '_', '.' or '-'")
    _check_task_class(name, task)
    if name in _REGISTRY and _REGISTRY[name] is not task and not replace:
        raise ValueError(f"a task named {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a registered task (tests register tasks for their own time)."""
    _REGISTRY.pop(name, None)


def registered_tasks() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_REGISTRY)


def task_class(name: str) -> type[Task]:
    """The task class of a registered name or an import path `module:Class`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"task name must be a non-empty string, got {name!r}")
    if ":" in name:
        return _imported(name)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown task {name!r}: registered are {', '.join(_REGISTRY)}; register yours with "
            "mecheval.tasks.register_task, or name it by import path (package.module:Class)"
        )
    return _REGISTRY[name]


def make_task(name: str, **options: Any) -> Task:
    """Build a task by name (or import path) with typed, validated options.

    Args:
        name: a registered name ("ar", "atr", "mqar", ...) or an import path.
        **options: the task's options; `make_task(name, **task.config())` rebuilds `task`.

    Raises:
        ValueError: unknown task, or an option with an impossible value (named).
        TypeError: unknown option, missing required option or wrong type (named).
    """
    cls = task_class(name)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for task {name!r}; valid options: {valid}")
    return cls(**options)


def _check_task_class(name: str, task: object) -> None:
    if not (inspect.isclass(task) and issubclass(task, Task)):
        raise TypeError(f"task {name!r} must be a subclass of mecheval.tasks.Task, got {task!r}")
    if not dataclasses.is_dataclass(task):
        raise TypeError(f"task {name!r} ({task.__name__}) must be a frozen dataclass")
    if inspect.isabstract(task):
        missing = ", ".join(sorted(task.__abstractmethods__))
        raise TypeError(f"task {name!r} ({task.__name__}) does not write {missing}")


def _imported(path: str) -> type[Task]:
    module_name, _, attribute = path.partition(":")
    try:
        module = import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"task {path!r}: cannot import {module_name!r} ({error}); run from the folder that "
            "holds it, or put that folder on PYTHONPATH"
        ) from None
    task = getattr(module, attribute, None)
    if task is None:
        raise ValueError(f"task {path!r}: module {module_name!r} has no {attribute!r}")
    _check_task_class(path, task)
    return task
