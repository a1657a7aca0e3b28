"""`check_mixer` and `check_task`: the conformance checks a user runs on their own mixer
(docs/mixers.md) and their own task (docs/tasks.md).

    from mecheval.testing import check_mixer
    report = check_mixer("mypackage.mixers:RetNet")      # or a registered name, or the class
    print(report)                                        # one line per check

mixers.py checks a mixer, tasks.py a task; report.py holds the report both return and the
comparison of the interchange grid with the per-cell loop both end with.
"""

from mecheval.testing.mixers import check_mixer, structure_problems
from mecheval.testing.report import (
    Check,
    MixerCheckError,
    MixerReport,
    TaskCheckError,
    TaskReport,
)
from mecheval.testing.tasks import check_task

__all__ = [
    "Check",
    "MixerCheckError",
    "MixerReport",
    "TaskCheckError",
    "TaskReport",
    "check_mixer",
    "check_task",
    "structure_problems",
]
