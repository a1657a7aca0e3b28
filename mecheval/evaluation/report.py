"""The report of a set of trained and evaluated runs: the study's findings, accuracy and
mechanism side by side.

    build_report(path) -> path/report/{report.md, report.html, *.png, *.parquet}

Contents (report.html lays them out: mecheval.evaluation.report_html):
- the overview figure, which architecture uses which mechanism with what certainty, and the
  findings' verdicts beside it (mecheval.evaluation.overview);
- how many run folders it found, by status (finished, diverged, failed, incomplete,
  unreadable: mecheval.run_folder.status), and a table of every one of them; the findings and
  accuracy tables say how many runs they rest on (the finished ones; a result.json that cannot
  be read leaves its run out, listed as unreadable);
- findings: the study's five findings, each with the study's numbers, ours and a verdict
  computed from the runs (mecheval.evaluation.findings);
- accuracy: the best learning rate per (task, architecture, width, depth), by final dev
  accuracy, with its dev and test accuracy;
- mechanism: for each selected run, key corrupted, the Attrib of restoring layer 1's block
  input at the value (induction), the query (direct retrieval, early) and the key (direct,
  late), each with a 95% bootstrap interval over documents (and over seeds where the
  configuration ran with several), and the label these give;
- the read-outs inside each layer's short conv (its output at value, value+1, value+2);
- mechanisms over training: when each read-out first reaches 0.5, and a plot;
- accuracy and read-outs by key-to-query distance;
- DAS's k* (mecheval.evaluation.das_tables);
- Attrib heatmaps of each selected run, and a value-vs-query scatter.
A section with nothing to show names the command that fills it. The tables are also written as
Parquet (evidence, findings, over_training, distance, das_iia, das_k_star, run_folders). A
stored table that cannot be read stops the report with an error naming it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mecheval.evaluation.analysis import (
    distance_table,
    evidence_table,
    formation_steps,
    key_grid,
    over_training_table,
    seed_runs,
)
from mecheval.evaluation.das_tables import (
    KSTAR_SHARE,
    MIN_GAIN,
    das_results,
    iia_table,
    k_star_table,
)
from mecheval.evaluation.display import (
    Section,
    by_setting,
    cell_text,
    conv_display,
    evidence_lines,
    mechanism_display,
    short_line,
)
from mecheval.evaluation.findings import findings_table
from mecheval.evaluation.kind_report import CONFIGURATION, kind_sections, routes_over_seeds
from mecheval.evaluation.overview import write_overview
from mecheval.evaluation.plots import (
    heatmap,
    heatmap_name,
    iia_vs_k,
    over_training,
    value_vs_query,
)
from mecheval.evaluation.report_html import Page, write_html
from mecheval.evaluation.results import (
    MODEL,
    best_runs,
    collect_results,
    with_seed_spread,
    with_study_accuracy,
)
from mecheval.interventions import MECHANISM_THRESHOLD, attrib, readout_cells
from mecheval.io import atomic_write_parquet
from mecheval.run_folder.files import INTERVENTIONS, read_table
from mecheval.run_folder.provenance import check_code, evaluated_with
from mecheval.run_folder.status import status_counts, status_table

OVERVIEW = "overview.png"
OVERVIEW_NOTE = (
    "Which architecture uses which mechanism: the Attrib of restoring layer 1's block input at "
    "the value (induction), the query (direct retrieval, early) and the key (direct, late), and "
    "layer 0's short conv output at the value and the two positions after it, key corrupted; "
    "each architecture at its most accurate width (every width: Mechanism), its 2-layer "
    "evaluated models only. Beside each task, the study's findings and their verdicts (Findings). "
    "In report.html, hover a cell for its values; an architecture's name links to its heatmap."
)


def corruption_note(best: pd.DataFrame) -> str:
    """Which ids the evaluated runs' corruptions drew from, per task."""
    seen: dict[str, dict[str, str]] = {}
    for _, run in best[best["evaluated"]].iterrows():
        grid = read_table(run["path"], INTERVENTIONS)
        if "replacement_ids" not in grid:
            continue
        pairs = grid[["task", "corruption", "replacement_ids"]].drop_duplicates()
        for row in pairs.itertuples(index=False):
            seen.setdefault(row.task, {})[row.corruption] = row.replacement_ids
    parts = [
        f"{task}: " + "; ".join(f"{at} replaced by ids {ids}" for at, ids in draws.items())
        for task, draws in seen.items()
    ]
    return "Corrupting tokens: " + (" | ".join(parts) if parts else "not recorded") + "."


def _markdown(frame: pd.DataFrame) -> str:
    shown = frame.astype(object)
    header = "| " + " | ".join(map(str, shown.columns)) + " |"
    rule = "|" + "---|" * len(shown.columns)
    body = [
        "| " + " | ".join(cell_text(v, str(c)).replace("|", "\\|") for c, v in row.items()) + " |"
        for _, row in shown.iterrows()
    ]
    return "\n".join([header, rule, *body]) + "\n"


@dataclass(frozen=True)
class _Heatmap:
    run: str
    anchor: str  # the HTML element's id
    png: str
    svg: str


def _heatmaps(best: pd.DataFrame, out: Path) -> list[_Heatmap]:
    """The Attrib heatmap of each evaluated selected run: PNG written into `out`, SVG kept."""
    drawn = []
    for _, run in best[best["evaluated"]].iterrows():
        grid = key_grid(run["path"])
        title = (
            f"{run['arch']} d{run['d_model']}, {run['n_layers']} layers, lr {run['lr']:g}: "
            f"Attrib, key corrupted (dev acc {run['dev_accuracy']:.2f})\n{run['setting']}"
        )
        fig = heatmap(attrib(grid), title, readout_cells(int(run["n_layers"])), grid)
        if fig is None:
            continue
        name = heatmap_name(run)
        fig.save_png(out / name)
        drawn.append(_Heatmap(run["run"], name.removesuffix(".png"), name, fig.svg()))
        fig.close()
    return drawn


@dataclass(frozen=True)
class _Tables:
    """What the report shows, from the run folders under its path."""

    folders: pd.DataFrame  # every run folder and its status
    results: pd.DataFrame  # one row per finished run
    best: pd.DataFrame  # the best learning rate per model
    evidence: pd.DataFrame  # their read-outs
    findings: pd.DataFrame
    over: pd.DataFrame  # read-outs over training
    formation: pd.DataFrame
    distance: pd.DataFrame
    iia: pd.DataFrame  # DAS: IIA against k
    k_star: pd.DataFrame  # DAS: the smallest sufficient k
    routes: pd.DataFrame  # path patching's route shares over seeds
    das_notes: list[str]  # DAS: what the section leaves out, named

    def stored(self) -> dict[str, pd.DataFrame]:
        """The tables the report folder keeps as Parquet, by name."""
        return {
            "evidence": self.evidence,
            "findings": self.findings,
            "over_training": self.over,
            "distance": self.distance,
            "das_iia": self.iia,
            "das_k_star": self.k_star,
            "routes": self.routes,
            "run_folders": self.folders,
        }


def _tables(path: Path, allow_code_change: bool = False) -> _Tables:
    folders = status_table(path)
    results = collect_results(folders)
    if results.empty:
        found = f" ({len(folders)} run folders: {status_counts(folders)})" if len(folders) else ""
        raise FileNotFoundError(f"no finished run under {path}{found}")
    # Each run's code against today's: a changed one is refused, or marked where allowed.
    statuses = check_code(list(results["path"]), allow_code_change, need_code=False)
    results["code"] = [evaluated_with(p) or statuses[Path(p)] for p in results["path"]]
    best = best_runs(results)
    # One pass over the selected runs and every evaluated seed of their configurations.
    seeds = seed_runs(best, results)
    table = evidence_table(pd.concat([best, seeds]).drop_duplicates(subset="run"), results)
    evidence = table[table["run"].isin(best["run"])].reset_index(drop=True)
    over = over_training_table(best)
    das, das_notes = das_results(results, best)
    return _Tables(
        folders=folders,
        results=results,
        best=best,
        evidence=evidence,
        findings=findings_table(
            evidence[evidence["n_layers"] == 2], table[table["run"].isin(seeds["run"])]
        ),
        over=over,
        formation=formation_steps(over),
        distance=distance_table(best),
        iia=iia_table(das) if len(das) else pd.DataFrame(),
        k_star=k_star_table(das) if len(das) else pd.DataFrame(),
        das_notes=das_notes,
        routes=routes_over_seeds(results.merge(best[list(CONFIGURATION)].drop_duplicates())),
    )


def _findings_note(t: _Tables) -> str:
    judged = t.evidence[t.evidence["n_layers"] == 2]
    evaluated = int(judged["mechanism"].notna().sum()) if "mechanism" in judged else 0
    return (
        f"These verdicts rest on {len(judged)} 2-layer model(s), {evaluated} of them "
        f"evaluated: the best learning rate of each, among the {len(t.results)} finished "
        f"run(s) of the {len(t.folders)} run folder(s) (see Run folders). Verdicts are "
        "computed from the runs below (mecheval.evaluation.findings): a model solves a task at "
        "dev accuracy >= 0.5 and fails it below 0.3; each architecture is judged at its most "
        "accurate width. A finding that does not show in runs smaller than the study's "
        '(another task setting, or fewer training steps) is "not reproduced at this scale"; '
        "\"not reproduced\" needs the study's setting and length. The study's numbers are its "
        "best learning rate per width. `smallest_setting`: the smallest setting in which "
        "mecheval's runs showed the finding, and the config that trains it (docs/reproduction.md,"
        ' "Where the findings start to show").'
    )


def _accuracy_note(t: _Tables) -> str:
    return (
        f"{len(t.best)} model(s), each the best of its learning rates among the "
        f"{len(t.results)} finished run(s) of the {len(t.folders)} run folder(s). `study`: the "
        "study's dev accuracy at its best learning rate for the same setting, read off its "
        "figure (+-0.02 to 0.05), where it reports one. `seeds`: the finished runs of the "
        "same configuration (seeds), over which `dev_mean`, `dev_min` and `dev_max` are taken."
    )


def _mechanism_note(t: _Tables) -> str:
    return (
        f"{corruption_note(t.best)} Intervals: 95% bootstrap over documents (and over seeds, "
        f"marked, where a configuration ran with several). The `mechanism` label is mecheval's "
        f"own rule (the highest read-out if it reaches {MECHANISM_THRESHOLD}, else "
        '"unclear"); the study reports the Attrib values themselves.'
    )


K_STAR_NOTE = (
    "Distributed alignment search (`mecheval das`, docs/das.md): k* is the smallest number "
    f"of dimensions whose swap gains {KSTAR_SHARE:.0%} of the full swap's gain in "
    "interchange intervention accuracy (IIA, held-out documents) over no swap (the base "
    f"documents unpatched); no k* where the full swap gains less than {MIN_GAIN}: the site "
    "carries too little of the answer there. Intervals: 95% bootstrap over documents (and "
    "seeds), k* recomputed in each draw. Runs are pooled only within a model's selected "
    "learning rate and DAS settings (`das_settings`); `k_left_out`: sizes some pooled "
    "documents lack. IIA against k: das_iia.png and das_iia.parquet."
)
FOLDERS_NOTE = (
    "Every run folder found: finished, diverged (at the first non-finite step), failed, "
    "incomplete (no result yet: running or stopped) or unreadable; `evaluated`: the "
    "checkpoint step its evaluation patched."
)
CONV_NOTE = (
    "One row per run and short conv, each site its layer's mixer declares in "
    "`conv_sites` (conv: Mamba's, Based's and Mamba-2's one conv; q_conv, k_conv, "
    "v_conv: DeltaNet's three; a mixer of one's own, its own), Attrib at the value and "
    "the two positions after it. The study finds Mamba's association in its layer-0 "
    "short conv after the value."
)
FORMATION_NOTE = (
    "First kept checkpoint at which each read-out reaches 0.5, which mechanism came "
    "first, and the first at which a short conv's read-out does (conv_at: which one)."
)


def _sections(t: _Tables, path: Path) -> list[Section]:
    """The report's sections, in order; an empty one says what command fills it."""
    columns = [*MODEL, "lr", "seed", "dev_accuracy", "test_accuracy", "steps", "task_label"]
    accuracy = with_seed_spread(with_study_accuracy(t.best[columns]), t.results)
    accuracy = accuracy.drop(columns=["task_label", "steps"])  # the setting names the steps
    evaluate = f"No run is evaluated yet: `mecheval evaluate {path}` runs the grids."
    no_conv = "None of the evaluated models has a short conv."
    k_star_note = " ".join([K_STAR_NOTE, *t.das_notes])
    return [
        Section("Findings", "findings", _findings_note(t), t.findings),
        Section(
            "Accuracy (best learning rate per architecture and width)",
            "accuracy",
            _accuracy_note(t),
            accuracy,
            split=True,
        ),
        Section(
            "Mechanism (key corrupted; Attrib of restoring layer 1's block input)",
            "mechanism",
            _mechanism_note(t),
            mechanism_display(t.evidence),
            evaluate,
            split=True,
        ),
        Section(
            "Inside the short convs (Attrib of their output, key corrupted)",
            "convs",
            CONV_NOTE,
            conv_display(t.evidence),
            no_conv if t.best["evaluated"].any() else evaluate,
            split=True,
        ),
        Section(
            "Mechanisms over training",
            "over-training",
            FORMATION_NOTE,
            t.formation,
            f"No checkpoint evaluated: `mecheval evaluate {path}` reads every kept one.",
            split=True,
        ),
        Section(
            "Accuracy and read-outs by key-to-query distance",
            "distance",
            "",
            t.distance,
            evaluate,
            split=True,
        ),
        Section(
            "Where the association lives (DAS: k*)",
            "das",
            k_star_note,
            t.k_star,
            f"DAS has not run on these runs: `mecheval das {path}` runs it (docs/das.md).",
        ),
        *_kind_sections(t),
        Section(
            "Routes over seeds (path patching)",
            "routes",
            ROUTES_NOTE,
            t.routes,
            f"No run holds path patching: `mecheval evaluate {path} --kind path`.",
        ),
        Section(
            "Finished runs",
            "finished-runs",
            "",
            t.results.drop(columns=["path", "evaluated", "task_label"]),
            collapsed=True,
        ),
        Section("Run folders", "run-folders", FOLDERS_NOTE, t.folders.drop(columns=["path"])),
    ]


ROUTES_NOTE = (
    "Each route's share of the sender's effect on the answer (path patching: the route alone "
    "carries the clean run's value, everything off it frozen at the corrupted run), pooled "
    "over the seeds of the selected configurations; 95% bootstrap interval over seeds and "
    "documents; `per_seed`: each seed's own share, in seed order."
)


def _kind_sections(t: _Tables) -> list[Section]:
    """A section per other intervention kind the selected runs hold tables of (`mecheval
    evaluate --kind`), and the EAP screens' agreement with path patching."""
    if t.best.empty:
        return []
    runs = seed_runs(t.best, t.results)
    return [
        Section(title, f"kind-{i}", note, table)
        for i, (title, table, note) in enumerate(kind_sections(runs[runs["evaluated"]]))
    ]


def _write_markdown(out: Path, found: str, sections: list[Section], figures: list[str]) -> None:
    md = ["# mecheval report", "", found, "", f"![overview]({OVERVIEW})", "", OVERVIEW_NOTE, ""]
    for section in sections:
        md += [f"## {section.title}", ""] + ([section.note, ""] if section.note else [])
        if section.table.empty:
            md += [f"_{section.missing}_", ""]
        elif section.anchor == "findings":
            md += _markdown_findings(section.table)
        else:
            for setting, rows in (
                by_setting(section.table) if section.split else [("", section.table)]
            ):
                md += ([f"### {setting}", ""] if setting else []) + [_markdown(rows)]
    md += ["## Figures", ""] + [f"![{name}]({name})" for name in figures]
    (out / "report.md").write_text("\n".join(md) + "\n")


def _markdown_findings(findings: pd.DataFrame) -> list[str]:
    """The findings table, `ours` a short line per model, and each finding's evidence in full."""
    short = findings.assign(
        ours=[
            "<br>".join(short_line(line) for line in evidence_lines(ours)[0][2])
            for ours in findings["ours"]
        ]
    )
    columns = ["finding", "claim", "verdict", "ours", "study", "smallest_setting"]
    md = [_markdown(short[columns]), "In full (intervals, seeds, every task setting):", ""]
    for row in findings.itertuples():
        for setting, verdict, lines in evidence_lines(row.ours):
            where = f", {setting} ({verdict})" if setting else ""
            md.append(f"- Finding {row.finding}{where}: " + "; ".join(lines))
    return [*md, ""]


def build_report(
    path: str | Path, out: str | Path | None = None, allow_code_change: bool = False
) -> Path:
    """Write report.md, report.html, the PNG plots and the tables; returns the report folder.
    A run whose architecture's code changed since training is refused (CodeChangedError),
    or, with `allow_code_change`, shown and marked (`code`: changed)."""
    path = Path(path)
    out = Path(out) if out else path / "report"
    tables = _tables(path, allow_code_change)  # before any folder is made: a mistyped path
    # leaves no trace
    out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.stored().items():
        atomic_write_parquet(out / f"{name}.parquet", table)
    heatmaps = _heatmaps(tables.best, out)
    links = {h.run: f"#{h.anchor}" for h in heatmaps}
    _, overview_svg = write_overview(tables.evidence, tables.findings, out, links)
    figures = [
        name
        for name in (
            value_vs_query(tables.evidence, out),
            over_training(tables.over, out),
            iia_vs_k(tables.iia, out),
        )
        if name is not None
    ]
    if "das_iia.png" not in figures:  # a plot of DAS tables no longer there
        (out / "das_iia.png").unlink(missing_ok=True)
    sections = _sections(tables, path)
    count = f"{len(tables.folders)} ({status_counts(tables.folders)})"
    _write_markdown(
        out, f"Run folders under `{path}`: {count}.", sections, figures + [h.png for h in heatmaps]
    )
    page = Page(
        found=f"Run folders under <code>{html.escape(str(path))}</code>: {html.escape(count)}.",
        figure=overview_svg,
        caption=OVERVIEW_NOTE,
        sections=sections,
        heatmaps=[(h.anchor, h.svg, h.png) for h in heatmaps],
        figures=figures,
    )
    write_html(out, page)
    return out


def read_report_table(report: str | Path, name: str) -> pd.DataFrame:
    """A table a report folder keeps (evidence, findings, over_training, distance, das_iia,
    das_k_star, routes, run_folders)."""
    return pd.read_parquet(Path(report) / f"{name}.parquet")
