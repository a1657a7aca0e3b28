"""The report's first figure: which architecture uses which mechanism, with what certainty.

    overview_table(evidence)                  one row per (task, setting, architecture)
    overview_figure(table, findings, links)   the figure (PNG, and SVG with values on hover)

Rows are the 2-layer evaluated models, each architecture at its most accurate width (as the
findings judge it; every width is in the report's Mechanism table), grouped by task and
setting. Columns: dev accuracy, the three read-outs (layer 1's block input at value, query and
key) and layer 0's short conv at value, value+1 and value+2 (the highest of its convs where a
layer has several, named in the cell). Each cell is the Attrib with its 95% bootstrap interval
over documents. Beside each task, its findings with their verdicts in colour.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import FancyBboxPatch, Rectangle

from mecheval.evaluation.findings import NOT_AT_SCALE, NOT_REPRODUCED, NOT_RUN, REPRODUCED
from mecheval.evaluation.over_training import CONV_POSITIONS, CONV_SITES, conv_column
from mecheval.evaluation.plots import ATTRIB_COLOURS, ATTRIB_RANGE, two_places
from mecheval.evaluation.svg_figure import TipFigure

READOUTS = {
    "induction": "layer 1 block input at value",
    "direct_early": "layer 1 block input at query",
    "direct_late": "layer 1 block input at key",
}
VERDICT_COLOURS = {
    REPRODUCED: "#1b7f3b",
    NOT_REPRODUCED: "#c0392b",
    NOT_AT_SCALE: "#d68910",
    NOT_RUN: "#8c8c8c",
}
# Layout, in inches: column edges left to right.
LABEL_W, ACC_W, CELL_W, GAP_W, FINDINGS_W = 2.0, 0.62, 0.92, 0.18, 4.3
ROW_H, HEAD_H, TASK_H, SETTING_H = 0.36, 0.58, 0.3, 0.26
CLAIM_WIDTH = 62  # characters per line of a finding's claim
NO_EFFECT = "no effect"  # mecheval.interventions.readout's label where corrupting changed nothing


def overview_table(evidence: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, setting, arch) among the evaluated 2-layer models of `evidence` (the
    report's evidence table): the most accurate width (ties: the smaller), with its identity,
    dev_accuracy, seeds, mechanism, the read-outs (`name`, `name_low`, `name_high`,
    `name_seeds_low`, `name_seeds_high`) and layer 0's conv read-outs as `conv@<position>` (with
    `_low`, `_high` and `_site`, the conv it is). Ordered by task, setting, then arch as first
    seen."""
    if evidence.empty or "mechanism" not in evidence:
        return pd.DataFrame()
    shown = evidence[(evidence["n_layers"] == 2) & evidence["mechanism"].notna()]
    shown = shown.sort_values(["dev_accuracy", "d_model"], ascending=[False, True], kind="stable")
    shown = shown.groupby(["task", "setting", "arch"], sort=False).head(1)
    order = {arch: i for i, arch in enumerate(dict.fromkeys(evidence["arch"]))}
    shown = shown.sort_values(
        ["task", "setting", "arch"], key=lambda c: c.map(order) if c.name == "arch" else c
    )
    rows = []
    for _, run in shown.iterrows():
        row = {k: run.get(k) for k in ("run", "task", "setting", "arch", "d_model", "lr")}
        row.update(dev_accuracy=run["dev_accuracy"], seeds=run.get("seeds"))
        row["mechanism"] = run["mechanism"]
        for name in READOUTS:
            for suffix in ("", "_low", "_high", "_seeds_low", "_seeds_high"):
                row[name + suffix] = run.get(name + suffix)
        for position in CONV_POSITIONS:
            row.update(_layer0_conv(run, position))
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def _layer0_conv(run: pd.Series, position: str) -> dict:
    """The highest of layer 0's conv read-outs at `position` (blank where it has none)."""
    best, key = None, f"conv@{position}"
    for site in CONV_SITES:
        name = conv_column(0, position, site)
        value = run.get(name)
        if value is not None and not pd.isna(value) and (best is None or value > best[1]):
            best = (name, value, site.removesuffix("_output"))
    if best is None:
        return {key: None, f"{key}_low": None, f"{key}_high": None, f"{key}_site": None}
    name, value, site = best
    return {
        key: value,
        f"{key}_low": run.get(f"{name}_low"),
        f"{key}_high": run.get(f"{name}_high"),
        f"{key}_site": site,
    }


def _blank(value) -> bool:
    return value is None or pd.isna(value)


def _interval(row: pd.Series, name: str, suffix: str = "") -> str:
    low, high = row.get(f"{name}{suffix}_low"), row.get(f"{name}{suffix}_high")
    return "" if _blank(low) or _blank(high) else f"[{two_places(low)}, {two_places(high)}]"


def short_claim(claim: str) -> str:
    """A finding's claim without its task prefix and parenthetical detail."""
    claim = re.sub(r"^[A-Z]+: ", "", claim)
    claim = re.sub(r"\s*\([^)]*\)", "", claim)
    return claim[:1].upper() + claim[1:]


def _columns() -> list[tuple[str, str, str]]:
    """(key, header, subheader) of each Attrib column."""
    columns = [(name, name.replace("_", " "), READOUTS[name].split(" at ")[1]) for name in READOUTS]
    columns += [(f"conv@{p}", p, "") for p in CONV_POSITIONS]
    return columns


def _x_edges() -> dict[str, float]:
    """Left edge of each column (inches)."""
    x = {"label": 0.1, "acc": 0.1 + LABEL_W}
    left = x["acc"] + ACC_W + GAP_W / 2
    for i, (key, _, _) in enumerate(_columns()):
        x[key] = left + i * CELL_W + (GAP_W if key.startswith("conv@") else 0.0)
    x["findings"] = x[f"conv@{CONV_POSITIONS[-1]}"] + CELL_W + 2 * GAP_W
    x["end"] = x["findings"] + FINDINGS_W
    return x


def _finding_lines(finding: pd.Series) -> list[str]:
    return textwrap.wrap(f"{int(finding['finding'])}. {short_claim(finding['claim'])}", CLAIM_WIDTH)


def _finding_height(finding: pd.Series) -> float:
    return 0.24 + 0.16 * len(_finding_lines(finding)) + 0.06


def _task_of(claim: str) -> str:
    match = re.match(r"^([A-Z]+): ", claim)
    return match[1].lower() if match else ""


def layout(table: pd.DataFrame, findings: pd.DataFrame) -> list[tuple[str, float, object]]:
    """What the figure draws, top to bottom: (kind, y in inches, what) with kind one of
    "task" (task name), "setting" (its label), "row" (an overview_table row), "none" (a task
    with findings but no evaluated model), "finding" (a findings row, drawn at the right, from
    its task's first line down), and "end" (the figure's height)."""
    tasks = list(dict.fromkeys(table["task"])) if len(table) else []
    tasks += [t for t in dict.fromkeys(findings["claim"].map(_task_of)) if t and t not in tasks]
    items, y = [], HEAD_H + 0.1
    for task in tasks:
        items.append(("task", y, task))
        top, y = y, y + TASK_H
        part = table[table["task"] == task] if len(table) else table
        if part.empty:
            items.append(("none", y, task))
            y += ROW_H
        for setting, rows in part.groupby("setting", sort=False) if len(part) else []:
            items.append(("setting", y, setting))
            y += SETTING_H
            for _, row in rows.iterrows():
                items.append(("row", y, row))
                y += ROW_H
        right = top
        for _, finding in findings[findings["claim"].map(_task_of) == task].iterrows():
            items.append(("finding", right, finding))
            right += _finding_height(finding)
        y = max(y, right) + 0.12
    items.append(("end", y + 0.55, None))
    return items


def _draw_header(fig: TipFigure, x: dict[str, float]) -> None:
    ax = fig.ax
    ax.text(x["label"], 0.32, "architecture (width)", fontsize=9, weight="bold", va="center")
    ax.text(
        x["acc"] + ACC_W / 2, 0.32, "dev acc", fontsize=9, weight="bold", ha="center", va="center"
    )
    for key, head, sub in _columns():
        centre = x[key] + CELL_W / 2
        ax.text(centre, 0.32, head, fontsize=9, weight="bold", ha="center", va="center")
        ax.text(centre, 0.48, sub, fontsize=7.5, ha="center", va="center", color="#444")
    first, last = x["induction"], x["direct_late"] + CELL_W
    groups = [(first, last, "layer 1 block input")]
    first, last = x[f"conv@{CONV_POSITIONS[0]}"], x[f"conv@{CONV_POSITIONS[-1]}"] + CELL_W
    groups.append((first, last, "layer 0 short conv output"))
    for first, last, label in groups:
        ax.text((first + last) / 2, 0.1, label, fontsize=8, ha="center", va="center", color="#444")
        ax.plot([first + 0.05, last - 0.05], [0.18, 0.18], color="#999", lw=0.6)
    ax.text(x["findings"], 0.32, "findings (verdict)", fontsize=9, weight="bold", va="center")


def _draw_cell(fig: TipFigure, left: float, y: float, row: pd.Series, key: str) -> None:
    value = row.get(key)
    what = READOUTS.get(key) or f"layer 0 {row.get(f'{key}_site') or 'conv'} output at "
    what += key.split("@")[1] if key.startswith("conv@") else ""
    model = f"{row['arch']} d{int(row['d_model'])} ({row['setting']})"
    box = Rectangle((left + 0.03, y + 0.03), CELL_W - 0.06, ROW_H - 0.06, lw=0.6)
    if _blank(value):
        box.set(facecolor="none", edgecolor="#dddddd")
        why = "no short conv, or not patched there"
        if key in READOUTS and row.get("mechanism") == NO_EFFECT:  # the row says so in words
            why = "corrupting the key leaves the model's answer as it was"
            box.set_edgecolor("none")
        fig.add(box, f"{model}\n{what}: no read-out ({why})")
        return
    box.set(facecolor=ATTRIB_COLOURS(ATTRIB_RANGE(value)), edgecolor="white")
    interval = _interval(row, key)
    seeds = _interval(row, key, "_seeds")
    tip = f"{model}\n{what}, key corrupted\nAttrib {value:.3f}"
    tip += f", 95% interval {interval} over documents" if interval else ""
    tip += f"; {seeds} over {int(row['seeds'])} seeds and documents" if seeds else ""
    fig.add(box, tip)
    ink = "white" if abs(value) > 0.55 else "black"
    site = row.get(f"{key}_site")
    label = (
        two_places(value)
        if site in (None, "conv")
        else f"{site.split('_')[0]}: {two_places(value)}"
    )
    centre = left + CELL_W / 2
    fig.ax.text(centre, y + 0.135, label, fontsize=8.5, ha="center", va="center", color=ink)
    if interval:
        fig.ax.text(centre, y + 0.265, interval, fontsize=6, ha="center", va="center", color=ink)


def _draw_row(fig: TipFigure, x: dict[str, float], y: float, row: pd.Series, links) -> None:
    ax = fig.ax
    label = ax.text(
        x["label"] + 0.15, y + ROW_H / 2, f"{row['arch']} (d{int(row['d_model'])})", fontsize=9
    )
    label.set_va("center")
    if row["run"] in links:
        label.set_url(links[row["run"]])
        label.set_color("#1a4f9c")
    seeds = "" if _blank(row.get("seeds")) else f", {int(row['seeds'])} evaluated seed(s)"
    acc = Rectangle((x["acc"] + 0.03, y + 0.03), ACC_W - 0.06, ROW_H - 0.06, lw=0)
    acc.set_facecolor(plt.get_cmap("Greys")(0.1 + 0.45 * float(row["dev_accuracy"])))
    fig.add(
        acc,
        f"{row['arch']} d{int(row['d_model'])}, lr {row['lr']:g}: dev accuracy "
        f"{row['dev_accuracy']:.3f}{seeds}\nrun {row['run']}",
    )
    ax.text(
        x["acc"] + ACC_W / 2,
        y + ROW_H / 2,
        f"{row['dev_accuracy']:.2f}",
        fontsize=9,
        ha="center",
        va="center",
    )
    for key, _, _ in _columns():
        _draw_cell(fig, x[key], y, row, key)
    if row.get("mechanism") == NO_EFFECT:
        centre = (x["induction"] + x["direct_late"] + CELL_W) / 2
        ax.text(
            centre,
            y + ROW_H / 2,
            "no effect: the corrupted key changes no answer",
            fontsize=7.5,
            style="italic",
            ha="center",
            va="center",
            color="#666",
        )


def _draw_finding(fig: TipFigure, left: float, y: float, finding: pd.Series) -> None:
    verdict = finding["verdict"]
    colour = VERDICT_COLOURS.get(verdict, "#8c8c8c")
    badge = FancyBboxPatch(
        (left, y + 0.05),
        2.0,
        0.17,
        boxstyle="round,pad=0,rounding_size=0.05",
        facecolor=colour,
        edgecolor="none",
    )
    tip = (
        f"Finding {int(finding['finding'])}: {verdict}\n{finding['claim']}\n"
        f"Study: {finding['study']}\nOurs: {finding['ours']}"
    )
    fig.add(badge, tip)
    fig.ax.text(
        left + 1.0,
        y + 0.135,
        verdict,
        fontsize=7.5,
        color="white",
        ha="center",
        va="center",
        weight="bold",
    )
    for i, line in enumerate(_finding_lines(finding)):
        fig.ax.text(left, y + 0.34 + 0.16 * i, line, fontsize=7.5, va="center")


def _draw_legend(fig: TipFigure, x: dict[str, float], y: float) -> None:
    ax = fig.ax
    ax.text(x["label"], y + 0.2, "Attrib (key corrupted)", fontsize=7.5, va="center")
    for i, value in enumerate([-1.0, -0.5, 0.0, 0.5, 1.0]):
        left = x["label"] + 1.3 + 0.42 * i
        ax.add_patch(
            Rectangle((left, y + 0.1), 0.4, 0.2, facecolor=ATTRIB_COLOURS(ATTRIB_RANGE(value)))
        )
        ax.text(
            left + 0.2,
            y + 0.2,
            f"{value:g}",
            fontsize=6.5,
            ha="center",
            va="center",
            color="white" if abs(value) > 0.55 else "black",
        )
    note = "[low, high]: 95% bootstrap interval over documents; hover a cell for seeds"
    ax.text(x["label"] + 3.5, y + 0.2, note, fontsize=7.5, va="center", color="#444")


def overview_figure(
    table: pd.DataFrame, findings: pd.DataFrame, links: dict[str, str] | None = None
) -> TipFigure:
    """The figure of `table` (overview_table) with `findings` (the findings table) beside its
    tasks; `links` maps a run to the URL its row label links to in the SVG."""
    x = _x_edges()
    items = layout(table, findings)
    fig = TipFigure(x["end"] + 0.1, items[-1][1])
    _draw_header(fig, x)
    for kind, y, what in items:
        if kind == "task":
            fig.ax.text(
                x["label"], y + TASK_H / 2, what.upper(), fontsize=11, weight="bold", va="center"
            )
            fig.ax.plot([x["label"], x["end"]], [y, y], color="#999", lw=0.6)
        elif kind == "setting":
            fig.ax.text(
                x["label"] + 0.05,
                y + SETTING_H / 2,
                what,
                fontsize=8,
                style="italic",
                va="center",
                color="#333",
            )
        elif kind == "none":
            fig.ax.text(
                x["label"] + 0.15,
                y + ROW_H / 2,
                "no evaluated 2-layer model",
                fontsize=8.5,
                va="center",
                color="#666",
            )
        elif kind == "row":
            _draw_row(fig, x, y, what, links or {})
        elif kind == "finding":
            _draw_finding(fig, x["findings"], y, what)
    _draw_legend(fig, x, items[-1][1] - 0.5)
    return fig


def write_overview(
    evidence: pd.DataFrame, findings: pd.DataFrame, out: Path, links: dict[str, str]
) -> tuple[str, str]:
    """Write overview.png into `out`; returns its name and the figure as inline SVG."""
    fig = overview_figure(overview_table(evidence), findings, links)
    fig.save_png(out / "overview.png")
    svg = fig.svg()
    fig.close()
    return "overview.png", svg
