"""Whether a run's architecture still has the code it was trained with.

    code_status(run_dir)               (status, detail): AS_TRAINED, CHANGED or NOT_RECORDED
    check_code(runs, allow_change)     every run's status; CodeChangedError for a changed one

Training records the code of the run's architecture in result.json (`code`:
mecheval.models.provenance.architecture_code); evaluation, DAS and the report compare it with
today's before any work and refuse a run whose code changed, unless told to go on
(`allow_change`, the command line's --allow-code-change; the report then marks the run). Runs
trained before the code was recorded are not refused: they are named once, as not recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from mecheval.run_folder.files import (
    DAS_STAMP,
    INTERVENTIONS_STAMP,
    read_result,
    read_run_config,
    read_stamp,
)
from mecheval.run_folder.pretrained import PRETRAINED_CODE, is_pretrained_run

AS_TRAINED = "as trained"
CHANGED = "changed"
NOT_RECORDED = "not recorded"
NOT_CHECKED = "not checked"  # its architecture cannot be had in this process (report only)


class CodeChangedError(RuntimeError):
    """A run's architecture has other code than it was trained with; the message names the
    part, its sources and both hashes."""


class ProvenanceWarning(UserWarning):
    """Runs whose code was not recorded (trained before it was): not checked."""


def current_code(run_dir: str | Path) -> dict[str, dict]:
    """The code of the run's architecture as it is now (what training would record today)."""
    from mecheval.models import model_config
    from mecheval.models.provenance import architecture_code
    from mecheval.train.config import build_task

    config = read_run_config(run_dir)
    task = build_task(config)
    m = config.model
    model = model_config(
        m.arch, task.vocab_size, m.d_model, m.n_layers, max_len=task.max_document_length,
        **m.options,
    )  # fmt: skip
    return architecture_code(model)


def code_status(run_dir: str | Path) -> tuple[str, str]:
    """(AS_TRAINED, ""), (NOT_RECORDED, "") or (CHANGED, what changed: the part, its sources
    and the sha256 at training and now). A part whose source could not be read (sha256 None,
    then or now) is not compared. A pretrained model's run: (PRETRAINED_CODE, "")."""
    if is_pretrained_run(run_dir):  # converted by today's code at each evaluation
        return PRETRAINED_CODE, ""
    recorded = read_result(run_dir).get("code")
    if not isinstance(recorded, dict):
        return NOT_RECORDED, ""
    now = current_code(run_dir)
    for part, then in recorded.items():
        before, after = then.get("sha256"), (now.get(part) or {}).get("sha256")
        if before is None or after is None or before == after:
            continue
        sources = ", ".join(now[part]["sources"])
        return CHANGED, f"part {part!r} ({sources}): sha256 {before} at training, {after} now"
    return AS_TRAINED, ""


def evaluated_with(run_dir: str | Path) -> str:
    """CHANGED when a stored evaluation or DAS of the run was computed with other code than
    it was trained with (--allow-code-change), else ""."""
    stamps = (read_stamp(Path(run_dir), name) for name in (INTERVENTIONS_STAMP, DAS_STAMP))
    return CHANGED if any(stamp.get("code") == CHANGED for stamp in stamps) else ""


def check_code(
    runs: Sequence[str | Path], allow_change: bool = False, need_code: bool = True
) -> dict[Path, str]:
    """Each run's code status (`code_status`), checked before any work: CodeChangedError names
    the first run whose code changed, unless `allow_change`; runs whose code was not recorded
    are named once, in a ProvenanceWarning. Without `need_code` (the report, which reads
    tables alone) a run whose architecture cannot be had in this process (ArchitectureError:
    a registered name, a module off the path, its code failing) is NOT_CHECKED, named once,
    instead of an error."""
    from mecheval.models.registry import ArchitectureError

    statuses, unrecorded, unchecked = {}, [], []
    for run in map(Path, runs):
        try:
            status, detail = code_status(run)
        except ArchitectureError as error:
            if need_code:
                raise
            status, detail = NOT_CHECKED, str(error)
            unchecked.append(f"{run.name} ({detail})")
        if status == CHANGED and not allow_change:
            raise CodeChangedError(
                f"{run}: the code of its architecture changed since it was trained ({detail}); "
                "its results would not be the trained model's. Retrain it, or go on with "
                "today's code: --allow-code-change (allow_code_change=True)"
            )
        if status == NOT_RECORDED:
            unrecorded.append(run.name)
        statuses[run] = status
    if unchecked:
        warnings.warn(
            f"{len(unchecked)} run(s)' code not checked, their architecture cannot be had here: "
            + "; ".join(unchecked[:2])
            + ("; ..." if len(unchecked) > 2 else ""),
            ProvenanceWarning,
            stacklevel=2,
        )
    if unrecorded:
        more = f" and {len(unrecorded) - 3} more" if len(unrecorded) > 3 else ""
        shown = ", ".join(unrecorded[:3]) + more
        warnings.warn(
            f"{len(unrecorded)} run(s) ({shown}) record no code of their architecture (trained "
            "before it was recorded): not checked against today's code",
            ProvenanceWarning,
            stacklevel=2,
        )
    return statuses
