"""Tasks by name or import path: the registry refuses what is not a task, by name."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from mecheval.tasks import (
    AssociativeRecall,
    make_task,
    register_task,
    registered_tasks,
    task_class,
    unregister_task,
)


def test_the_shipped_tasks_are_registered_like_any_other():
    assert registered_tasks()[:6] == (
        "ar", "atr", "mqar", "mad_recall", "mad_noisy_recall", "mad_fuzzy_recall"
    )  # fmt: skip
    assert task_class("ar") is AssociativeRecall
    assert task_class("mecheval.tasks:AssociativeRecall") is AssociativeRecall
    assert make_task("mecheval.tasks:MultiQueryAR", num_kv_pairs=4).num_kv_pairs == 4


def test_a_task_of_ones_own_registers_and_refuses_a_second_name():
    @dataclasses.dataclass(frozen=True)
    class Mine(AssociativeRecall):
        name = "mine"

    try:
        register_task("mine", Mine)
        assert make_task("mine", num_pairs=2).num_pairs == 2
        with pytest.raises(ValueError, match="already registered"):
            register_task("mine", AssociativeRecall)
    finally:
        unregister_task("mine")
    with pytest.raises(ValueError, match="unknown task 'mine'"):
        make_task("mine")


@pytest.mark.parametrize(
    "target, message",
    [
        (dict, "must be a subclass of mecheval.tasks.Task"),
        ("not a class", "must be a subclass"),
    ],
)
def test_what_is_not_a_task_is_refused_by_name(target, message):
    with pytest.raises(TypeError, match=message):
        register_task("bad", target)


def test_import_paths_name_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "half.py").write_text(
        "from mecheval.tasks import Task\nclass NotFrozen(Task):\n    name = 'x'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="cannot import 'nowhere'"):
        make_task("nowhere:Task")
    with pytest.raises(ValueError, match="module 'half' has no 'Missing'"):
        make_task("half:Missing")
    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        make_task("half:NotFrozen")
    sys.modules.pop("half", None)
