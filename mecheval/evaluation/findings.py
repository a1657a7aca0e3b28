"""The study's five findings, checked against a set of evaluated runs.

    findings_table(evidence) -> one row per finding: claim, the study's numbers, ours, verdict,
                                and the smallest setting mecheval's runs showed it in

`evidence` has one row per selected 2-layer model (the report's best learning rate per task
setting, architecture and width): task name ("ar" or "atr"), setting (the task with its
options and the run's length, e.g. "ar(), 50,016 steps": mecheval.evaluation.report's
task_setting), arch, d_model, dev_accuracy, the read-outs (induction, direct_early,
direct_late, with `_low` / `_high` bootstrap bounds when present), mechanism, and for models
with a short conv its layer-0 output read-outs (conv_value+1, conv_value+2). For each
architecture a finding looks at its most accurate width.

A finding is judged in each task setting of its task separately (a toy AR task and the
study's own are not mixed), and `ours` lists every setting's outcome. Verdicts, computed,
never written by hand:
- "reproduced": in some setting, every model the finding names was run and behaves as the
  study found;
- "not reproduced": they were run together in a setting at the study's scale (its task
  setting and training length, `study_scale`;
  mecheval.evaluation.study_numbers.at_study_scale), and in none do all behave so;
- "not reproduced at this scale": as above, but only in smaller settings (a toy task, fewer
  steps), which cannot contradict the study;
- "not run at this scale": no setting has every model the finding needs (evaluated).
Thresholds: a model *solves* a task at dev accuracy >= SOLVES and *fails* it below FAILS (the
study's failing models stay at or below 0.3 on AR); a failure (findings 2 and 4) counts only
in a setting where attention solves the task; a read-out names a mechanism by
`mecheval.interventions.readout`'s rule (the highest read-out, if >= 0.5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from mecheval.evaluation.shipped import shipped_rows

SOLVES = 0.5
FAILS = 0.3
CONV_CARRIES = 0.5
DIRECT = ("direct_early", "direct_late")
# A failure finding counts in a setting only where this architecture solves the task.
LEARNABLE_BY = "attention"

REPRODUCED, NOT_REPRODUCED, NOT_RUN = "reproduced", "not reproduced", "not run at this scale"
NOT_AT_SCALE = "not reproduced at this scale"
# The verdict of a finding is the first of these that one of its settings reached.
PRECEDENCE = (REPRODUCED, NOT_REPRODUCED, NOT_AT_SCALE, NOT_RUN)


@dataclass(frozen=True)
class Finding:
    claim: str
    study: str
    check: Callable[[pd.DataFrame], tuple[str, str]]


def _best(evidence: pd.DataFrame, task: str, arch: str) -> pd.Series | None:
    rows = evidence[(evidence["task"] == task) & (evidence["arch"] == arch)]
    if rows.empty:
        return None
    return rows.sort_values(["dev_accuracy", "d_model"], ascending=[False, True]).iloc[0]


def _score(row: pd.Series, name: str) -> str:
    value = row.get(name)
    if value is None or pd.isna(value):
        return f"{name} n/a"
    low, high = row.get(f"{name}_low"), row.get(f"{name}_high")
    interval = "" if low is None or pd.isna(low) else f" [{low:.2f}, {high:.2f}]"
    return f"{name} {value:.2f}{interval}"


def _describe(row: pd.Series, *scores: str) -> str:
    parts = [f"{row['arch']} d{int(row['d_model'])}: acc {row['dev_accuracy']:.2f}"]
    parts += [_score(row, s) for s in scores]
    return ", ".join(parts)


def _gather(evidence, task, archs, evaluated: bool = True):
    """The most accurate selected run of each arch; `missing` lists those without one (or,
    with `evaluated`, without a read-out)."""
    rows = {arch: _best(evidence, task, arch) for arch in archs}
    missing = [
        arch
        for arch, row in rows.items()
        if row is None or (evaluated and pd.isna(row.get("mechanism", float("nan"))))
    ]
    return rows, missing


def _not_run(task: str, missing: list[str]) -> tuple[str, str]:
    return f"no (evaluated) {task.upper()} run of {', '.join(missing)}", NOT_RUN


def _induction(task: str, archs: tuple[str, ...]):
    def check(evidence):
        rows, missing = _gather(evidence, task, archs)
        if missing:
            return _not_run(task, missing)
        ok = all(
            r["dev_accuracy"] >= SOLVES and r["mechanism"] == "induction" for r in rows.values()
        )
        ours = "; ".join(_describe(r, "induction", *DIRECT) for r in rows.values())
        return ours, REPRODUCED if ok else NOT_REPRODUCED

    return check


def _fail(task: str, archs: tuple[str, ...]):
    """`archs` fail the task where attention solves it (a setting no model learns, too short a
    run, says nothing of what fails)."""

    def check(evidence):
        rows, missing = _gather(evidence, task, (*archs, LEARNABLE_BY), evaluated=False)
        if missing:
            return _not_run(task, missing)
        ok = all(rows[a]["dev_accuracy"] < FAILS for a in archs)
        ok = ok and rows[LEARNABLE_BY]["dev_accuracy"] >= SOLVES
        ours = "; ".join(_describe(r) for r in rows.values())
        return ours, REPRODUCED if ok else NOT_REPRODUCED

    return check


def _direct_and_conv(evidence):
    rows, missing = _gather(evidence, "ar", ("mamba", "deltanet"))
    if missing:
        return _not_run("ar", missing)
    ok = all(r["dev_accuracy"] >= SOLVES and r["mechanism"] in DIRECT for r in rows.values())
    mamba = rows["mamba"]
    conv = [mamba.get(c) for c in ("conv_value+1", "conv_value+2")]
    conv = [c for c in conv if c is not None and not pd.isna(c)]
    ok = ok and bool(conv) and max(conv) >= CONV_CARRIES
    ours = "; ".join(_describe(r, "induction", *DIRECT) for r in rows.values())
    ours += "; mamba layer-0 conv output: " + ", ".join(
        _score(mamba, c) for c in ("conv_value+1", "conv_value+2")
    )
    return ours, REPRODUCED if ok else NOT_REPRODUCED


def _noconv_atr_induction(evidence):
    rows, missing = _gather(evidence, "atr", ("attention", "based", "mamba_noconv"))
    if missing:
        return _not_run("atr", missing)
    ok = all(r["dev_accuracy"] >= SOLVES and r["mechanism"] == "induction" for r in rows.values())
    ours = "; ".join(_describe(r, "induction", *DIRECT) for r in rows.values())
    return ours, REPRODUCED if ok else NOT_REPRODUCED


FINDINGS = (
    Finding(
        "AR: attention and Based solve it by induction (Attrib at value, layer 1's input)",
        "acc attention 1.00 (d >= 32), Based 0.99 (d 64; 99.06% best); Attrib at value "
        "0.88-0.95, at query 0 (ar_32.pdf, ar_32_diff.pdf)",
        _induction("ar", ("attention", "based")),
    ),
    Finding(
        "AR: H3 and Hyena fail it (where attention solves it)",
        "acc H3 0.01-0.02, Hyena 0.01-0.30 over d 16-256 (ar_32.pdf)",
        _fail("ar", ("h3", "hyena")),
    ),
    Finding(
        "AR: Mamba and DeltaNet solve it by direct retrieval, not induction; Mamba's layer-0 "
        "short conv carries the association after the value",
        "acc Mamba 0.81 (d 64), 0.91 (d 256); Mamba Attrib at query 0.65-0.85, at value 0; "
        "DeltaNet close behind Mamba (ar_32.pdf, ar_32_diff.pdf)",
        _direct_and_conv,
    ),
    Finding(
        "AR: Mamba without its short conv fails it (where attention solves it)",
        "acc about 0.02 at every width (mamba_ar_32.pdf, d_conv 0)",
        _fail("ar", ("mamba_noconv",)),
    ),
    Finding(
        "ATR: attention and Based keep induction, and Mamba without its short conv, which "
        "fails AR, solves ATR by induction",
        "attention, Based and BaseConv at value about 1.0 (atr_diff.pdf); Mamba without conv "
        "learns attention-like induction on ATR",
        _noconv_atr_induction,
    ),
)


def _smallest(number: int) -> str:
    seen = smallest_settings().get(number)
    return "" if seen is None else f"{seen[0]} ({seen[1]})"


def _task_of(finding: Finding) -> str:
    return "atr" if finding.claim.startswith("ATR") else "ar"


@functools.cache
def smallest_settings() -> dict[int, tuple[str, str]]:
    """finding -> (the smallest setting in which mecheval's runs showed it, the config that
    trains that setting), measured (docs/reproduction.md, "Where the findings start to show";
    the table is findings_ladder.csv beside this module)."""
    rows = shipped_rows("findings_ladder.csv")
    return {int(row["finding"]): (row["setting"], row["config"]) for row in rows}


def findings_table(evidence: pd.DataFrame) -> pd.DataFrame:
    """One row per finding: finding (1..5), claim, study, ours, verdict, smallest_setting (the
    smallest setting mecheval's runs showed it in, and its config; `smallest_settings`)."""
    rows = []
    for number, finding in enumerate(FINDINGS, start=1):
        task = _task_of(finding)
        settings = (
            list(dict.fromkeys(evidence.loc[evidence["task"] == task, "setting"]))
            if "setting" in evidence
            else [None]
        )
        outcomes = []
        for setting in settings or [None]:
            part = evidence if setting is None else evidence[evidence["setting"] == setting]
            ours, verdict = finding.check(part)
            small = "study_scale" in part and not part["study_scale"].fillna(False).all()
            if verdict == NOT_REPRODUCED and small:
                verdict = NOT_AT_SCALE
            outcomes.append((setting, ours, verdict))
        verdicts = [v for _, _, v in outcomes]
        verdict = next(v for v in PRECEDENCE if v in verdicts or v == NOT_RUN)
        order = sorted(outcomes, key=lambda o: (o[2] != verdict, o[0] or ""))
        ours = " | ".join(
            f"{setting} ({v}): {text}" if setting is not None else text
            for setting, text, v in order
        )
        rows.append(
            {
                "finding": number,
                "claim": finding.claim,
                "study": finding.study,
                "ours": ours,
                "verdict": verdict,
                "smallest_setting": _smallest(number),
            }
        )
    return pd.DataFrame(rows)
