"""The study's five findings, checked against a set of evaluated runs.

    findings_table(evidence, seeds) -> one row per finding: claim, the study's numbers, ours,
                                       verdict, and the smallest setting mecheval's runs
                                       showed it in

`evidence` has one row per selected 2-layer model (the report's best learning rate per task
setting, architecture and width): task name ("ar" or "atr"), setting (the task with its
options and the run's length, e.g. "ar(), 50,016 steps": mecheval.evaluation.report's
task_setting), arch, d_model, dev_accuracy, the read-outs (induction, direct_early,
direct_late, with `_low` / `_high` bootstrap bounds when present), mechanism, and for models
with a short conv its layer-0 output read-outs (conv_value+1, conv_value+2). For each
architecture a finding looks at its most accurate width. `seeds` (optional, the same columns
plus `seed`) has the evidence rows of every evaluated seed of the selected configurations: a
model then behaves as the study found only if it does so in most of its seeds (2 of 3; 2 of 2),
and `ours` says in which.

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
    check: Callable[..., tuple[str, str]]  # (evidence, seeds=None) -> (ours, verdict)


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


# How each named model must behave for a finding to hold (one predicate per architecture).
Behaviour = Callable[[pd.Series], bool]
SAME_RUN = ("setting", "task", "arch", "d_model", "n_layers", "lr")


def _solves_by(*mechanisms: str) -> Behaviour:
    return lambda r: r["dev_accuracy"] >= SOLVES and r["mechanism"] in mechanisms


def _solves_by_direct_with_conv(r: pd.Series) -> bool:
    conv = [r.get(c) for c in ("conv_value+1", "conv_value+2")]
    conv = [c for c in conv if c is not None and not pd.isna(c)]
    return _solves_by(*DIRECT)(r) and bool(conv) and max(conv) >= CONV_CARRIES


def _fails(r: pd.Series) -> bool:
    return r["dev_accuracy"] < FAILS


def _solves(r: pd.Series) -> bool:
    return r["dev_accuracy"] >= SOLVES


def _seed_runs(row: pd.Series, seeds: pd.DataFrame | None) -> pd.DataFrame:
    """The evidence rows of every seed of `row`'s configuration (`row` alone without them)."""
    if seeds is None or seeds.empty:
        return pd.DataFrame([row])
    same = pd.Series(True, index=seeds.index)
    for column in SAME_RUN:
        if column in seeds and column in row:
            same &= seeds[column] == row[column]
    return seeds[same] if same.any() else pd.DataFrame([row])


def _held(row: pd.Series, behaves: Behaviour, seeds: pd.DataFrame | None) -> tuple[bool, str]:
    """Whether the configuration behaves so in most of its seeds, and which seeds do."""
    runs = _seed_runs(row, seeds)
    held = [bool(behaves(r)) for _, r in runs.iterrows()]
    if len(runs) == 1:
        return held[0], ""
    seeds_held = (
        sorted(int(s) for s, h in zip(runs["seed"], held, strict=True) if h)
        if "seed" in runs
        else []
    )
    which = f" ({', '.join(map(str, seeds_held))})" if seeds_held else ""
    return 2 * sum(held) > len(held), f" [as found in {sum(held)} of {len(held)} seeds{which}]"


def _check(task: str, behaviours: dict[str, Behaviour], scores=(), evaluated=True, conv=""):
    """A finding on `task`: each architecture behaves as its predicate says, in the majority of
    its selected configuration's seeds (`seeds`: their evidence rows; without them, the
    selected run alone). `conv` names the architecture whose layer-0 conv read-outs `ours`
    adds."""

    def check(evidence, seeds=None):
        rows, missing = _gather(evidence, task, tuple(behaviours), evaluated)
        if missing:
            return _not_run(task, missing)
        ok, parts = True, []
        for arch, behaves in behaviours.items():
            held, which = _held(rows[arch], behaves, seeds)
            ok = ok and held
            parts.append(_describe(rows[arch], *scores) + which)
        ours = "; ".join(parts)
        if conv:
            ours += f"; {conv} layer-0 conv output: " + ", ".join(
                _score(rows[conv], c) for c in ("conv_value+1", "conv_value+2")
            )
        return ours, REPRODUCED if ok else NOT_REPRODUCED

    return check


def _induction(task: str, archs: tuple[str, ...]):
    return _check(task, dict.fromkeys(archs, _solves_by("induction")), ("induction", *DIRECT))


def _fail(task: str, archs: tuple[str, ...]):
    """`archs` fail the task where attention solves it (a setting no model learns, too short a
    run, says nothing of what fails)."""
    behaviours = {**dict.fromkeys(archs, _fails), LEARNABLE_BY: _solves}
    return _check(task, behaviours, evaluated=False)


_direct_and_conv = _check(
    "ar",
    {"mamba": _solves_by_direct_with_conv, "deltanet": _solves_by(*DIRECT)},
    ("induction", *DIRECT),
    conv="mamba",
)
_noconv_atr_induction = _induction("atr", ("attention", "based", "mamba_noconv"))


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


def findings_table(evidence: pd.DataFrame, seeds: pd.DataFrame | None = None) -> pd.DataFrame:
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
            ours, verdict = finding.check(part, seeds)
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
