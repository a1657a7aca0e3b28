"""How the report shows its tables, in Markdown and HTML alike: cell text, sections split by
task setting, and the findings' evidence as a short line per model.

    Section(title, note, table, missing)   one section of the report
    cell_text(value, column)               a cell as text ("" for a missing value)
    by_setting(table)                      (setting, its rows without the setting columns)
    evidence_lines(ours)                   a finding's `ours`, per setting, a line per model
    short_line(line)                       that line without intervals
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd

from mecheval.evaluation.findings import PRECEDENCE
from mecheval.evaluation.over_training import CONV_POSITIONS, parse_conv_column
from mecheval.evaluation.plots import two_places

# Columns of counts, steps and sizes: shown as integers even when stored as floats with gaps.
INTEGER_COLUMNS = {
    *("d_model", "n_layers", "seed", "seeds", "steps", "step", "evaluated", "n", "finding"),
    *("layer", "k", "k_star", "dims"),
}


@dataclass(frozen=True)
class Section:
    """A report section: `table` shown under `title` and `note`; where it is empty, `missing`
    says why (and what command fills it). `split`: one table per task setting."""

    title: str
    anchor: str
    note: str
    table: pd.DataFrame
    missing: str = "none"
    split: bool = False
    collapsed: bool = False


def is_missing(value) -> bool:
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def cell_text(value, column: str = "") -> str:
    """A cell as one line of text: blank where missing; integers without decimals; learning
    rates as written (3e-4); other numbers to 3 decimals."""
    if is_missing(value):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and (column in INTEGER_COLUMNS or column.endswith("_from")):
        return f"{value:.0f}" if value == int(value) else f"{value:.3g}"
    if isinstance(value, float) and column == "lr":
        return f"{value:g}"
    if isinstance(value, float):
        text = f"{value:.3f}"
        return "0.000" if text == "-0.000" else text  # a tiny negative reads as zero
    return " ".join(str(value).split())


def by_setting(table: pd.DataFrame) -> Iterator[tuple[str, pd.DataFrame]]:
    """The rows of each task setting in turn, without the columns the heading says (task,
    setting); the whole table under "" where it has no setting column."""
    if "setting" not in table or table.empty:
        yield "", table
        return
    for setting, rows in table.groupby("setting", sort=False, dropna=False):
        label = "" if is_missing(setting) else str(setting)
        yield label, rows.drop(columns=[c for c in ("task", "setting") if c in rows])


_VERDICTS = "|".join(re.escape(v) for v in sorted(PRECEDENCE, key=len, reverse=True))
_SETTING = re.compile(rf"^(?P<setting>.*?) \((?P<verdict>{_VERDICTS})\): (?P<text>.*)$")
_INTERVAL = re.compile(r" \[-?[\d.]+, -?[\d.]+\]")
_SEEDS = re.compile(r" \[as found in (\d+ of \d+) seeds[^\]]*\]")


def evidence_lines(ours: str) -> list[tuple[str, str, list[str]]]:
    """A finding's `ours` (mecheval.evaluation.findings.findings_table) as (setting, its
    verdict, a line per model) per setting, the deciding setting first; setting and verdict
    are "" where `ours` names none."""
    parts = []
    for part in ours.split(" | "):
        match = _SETTING.match(part)
        setting, verdict, text = match.groups() if match else ("", "", part)
        parts.append((setting, verdict, [line for line in text.split("; ") if line]))
    return parts


def short_line(line: str) -> str:
    """One model's evidence without its intervals, its seeds as "(2 of 3 seeds)"."""
    return _INTERVAL.sub("", _SEEDS.sub(r" (\1 seeds)", line))


def _with_interval(frame: pd.DataFrame, name: str) -> pd.Series:
    def cell(row: pd.Series) -> str:
        value = row.get(name)
        if value is None or pd.isna(value):
            return ""
        text = two_places(value)
        low = row.get(f"{name}_low")
        if low is not None and not pd.isna(low):
            text += f" [{two_places(low)}, {two_places(row[f'{name}_high'])}]"
        seeds_low = row.get(f"{name}_seeds_low")
        if seeds_low is not None and not pd.isna(seeds_low):
            text += f" seeds [{two_places(seeds_low)}, {two_places(row[f'{name}_seeds_high'])}]"
        return text

    return frame.apply(cell, axis=1)


def mechanism_display(evidence: pd.DataFrame) -> pd.DataFrame:
    """The evaluated rows of the evidence, read-outs shown with their intervals."""
    if evidence.empty or "mechanism" not in evidence:
        return pd.DataFrame()
    shown = evidence[evidence["mechanism"].notna()]
    names = [c for c in shown if f"{c}_low" in shown and parse_conv_column(c) is None]
    columns = {c: shown[c] for c in ("setting", "arch", "d_model", "n_layers", "dev_accuracy")}
    columns.update({name: _with_interval(shown, name) for name in names})
    columns["mechanism"] = shown["mechanism"]
    columns["seeds"] = shown["seeds"]
    return pd.DataFrame(columns)


def conv_display(evidence: pd.DataFrame) -> pd.DataFrame:
    """One row per evaluated run and short conv (in run, layer, conv order): its read-outs at
    the value and the two positions after it, with their intervals."""
    convs = {}  # (site, layer) -> {position: column}
    for name in evidence:
        parsed = parse_conv_column(name)
        if parsed and f"{name}_low" in evidence:
            site, layer, position = parsed
            convs.setdefault((layer, site), {})[position] = name
    frames = []
    for (layer, site), columns in sorted(convs.items()):
        shown = evidence.dropna(subset=list(columns.values()), how="all")
        if shown.empty:
            continue
        frame = shown[["setting", "arch", "d_model", "dev_accuracy"]].copy()
        frame["run_order"] = shown.index
        frame["layer"] = layer
        frame["conv"] = site.removesuffix("_output")
        for position in CONV_POSITIONS:
            name = columns.get(position)
            frame[position] = _with_interval(shown, name) if name else ""
        frames.append(frame)
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames).sort_values(["run_order", "layer", "conv"], kind="stable")
    return table.drop(columns=["run_order"]).reset_index(drop=True)
