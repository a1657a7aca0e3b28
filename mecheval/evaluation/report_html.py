"""report.html: one self-contained page that needs no server and no script. The first screen
is the overview figure (inline SVG, values on hover); every table fits the page or scrolls
inside its own box; the findings' evidence is a line per model, its details a click away.

    write_html(out, page)    out/report.html from a `Page`
"""

from __future__ import annotations

import html
import numbers
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from mecheval.evaluation.display import (
    Section,
    by_setting,
    cell_text,
    evidence_lines,
    short_line,
)
from mecheval.evaluation.overview import VERDICT_COLOURS

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;padding:0 16px;max-width:1320px;
color:#222}
h1{font-size:22px;margin:10px 0 2px}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid
#ddd}h3{font-size:14px;margin:14px 0 4px;font-style:italic;font-weight:normal}
.lead{margin:0 0 6px;color:#444}nav{font-size:13px}nav a{margin-right:10px}
figure{margin:0}figcaption{font-size:12.5px;color:#444}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #d6d6d6;padding:2px 7px;vertical-align:top}
th{background:#f4f4f4;text-align:left}td.num{text-align:right;white-space:nowrap}
.findings td.claim{min-width:200px}.findings td.ours{min-width:320px}
.verdict{display:inline-block;color:#fff;border-radius:4px;padding:0 6px;white-space:nowrap;
font-weight:bold;font-size:12px}
details summary{cursor:pointer;color:#1a4f9c}ul.lines{margin:0;padding-left:16px}
.missing{color:#555;font-style:italic}img{max-width:100%}
.heatmap{display:inline-block;vertical-align:top;margin:0 18px 12px 0;max-width:100%}
"""


@dataclass(frozen=True)
class Page:
    """What report.html shows: `found` (a line: the runs it rests on), the overview `figure`
    (inline SVG) and its `caption`, the `sections`, the `heatmaps` (anchor, inline SVG,
    PNG name) and the other `figures` (PNG names)."""

    found: str
    figure: str
    caption: str
    sections: list[Section]
    heatmaps: list[tuple[str, str, str]]
    figures: list[str]


def _table(frame: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for values in frame.itertuples(index=False):
        cells = []
        for column, value in zip(frame.columns, values, strict=True):
            number = isinstance(value, numbers.Number) and not isinstance(value, bool)
            cls = ' class="num"' if number else ""
            cells.append(f"<td{cls}>{html.escape(cell_text(value, str(column)))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(rows)}</table></div>'


def verdict_badge(verdict: str) -> str:
    colour = VERDICT_COLOURS.get(verdict, "#8c8c8c")
    return f'<span class="verdict" style="background:{colour}">{html.escape(verdict)}</span>'


def _evidence(ours: str) -> str:
    """A line per model of the deciding setting; every setting in full behind <details>."""
    parts = evidence_lines(ours)
    setting, _, lines = parts[0]
    short = "".join(f"<li>{html.escape(short_line(line))}</li>" for line in lines)
    where = f"<div><em>{html.escape(setting)}</em></div>" if setting else ""
    full = []
    for setting, verdict, lines in parts:
        head = f"<div><em>{html.escape(setting)}</em> {verdict_badge(verdict)}</div>"
        items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
        full.append((head if setting else "") + f'<ul class="lines">{items}</ul>')
    details = f"<details><summary>intervals, seeds, every setting</summary>{''.join(full)}"
    return f'{where}<ul class="lines">{short}</ul>{details}</details>'


def _findings(frame: pd.DataFrame) -> str:
    head = "<tr><th>#</th><th>claim</th><th>verdict</th><th>ours</th><th>study</th>"
    head += "<th>smallest setting that showed it</th></tr>"
    rows = [
        f"<tr><td class=num>{int(row.finding)}</td><td class=claim>{html.escape(row.claim)}</td>"
        f"<td>{verdict_badge(row.verdict)}</td><td class=ours>{_evidence(row.ours)}</td>"
        f"<td>{html.escape(row.study)}</td><td>{html.escape(row.smallest_setting)}</td></tr>"
        for row in frame.itertuples()
    ]
    return f'<div class="scroll"><table class="findings">{head}{"".join(rows)}</table></div>'


def _section(section: Section) -> list[str]:
    parts = [f'<h2 id="{section.anchor}">{html.escape(section.title)}</h2>']
    if section.note:
        parts.append(f"<p>{html.escape(section.note)}</p>")
    if section.table.empty:
        parts.append(f'<p class="missing">{html.escape(section.missing)}</p>')
        return parts
    if section.anchor == "findings":
        parts.append(_findings(section.table))
        return parts
    body = []
    for setting, rows in by_setting(section.table) if section.split else [("", section.table)]:
        if setting:
            body.append(f"<h3>{html.escape(setting)}</h3>")
        body.append(_table(rows))
    if section.collapsed:
        summary = f"<details><summary>show the table ({len(section.table)} rows)</summary>"
        body = [summary, *body, "</details>"]
    return parts + body


def write_html(out: Path, page: Page) -> Path:
    """Write out/report.html; returns its path."""
    links = " ".join(
        f'<a href="#{s.anchor}">{html.escape(s.title.split(" (")[0])}</a>' for s in page.sections
    )
    parts = [
        "<!doctype html><html lang=en><meta charset=utf-8>",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>mecheval report</title><style>{STYLE}</style>",
        "<h1>mecheval report</h1>",
        f'<p class="lead">{page.found}</p>',
        f'<figure id="overview">{page.figure}',
        f"<figcaption>{html.escape(page.caption)}</figcaption></figure>",
        f'<nav>{links} <a href="#heatmaps">Heatmaps</a></nav>',
    ]
    for section in page.sections:
        parts += _section(section)
    parts.append('<h2 id="heatmaps">Attrib heatmaps (key corrupted)</h2>')
    if not page.heatmaps:
        parts.append('<p class="missing">No evaluated run to draw.</p>')
    for anchor, svg, png in page.heatmaps:
        link = f'<a href="{html.escape(png)}">PNG</a>'
        parts.append(f'<div class="heatmap" id="{anchor}">{svg}<div>{link}</div></div>')
    parts.append('<h2 id="figures">Other figures</h2>')
    parts += [f'<p><img src="{html.escape(n)}" alt="{html.escape(n)}"></p>' for n in page.figures]
    path = out / "report.html"
    path.write_text("\n".join(parts) + "\n")
    return path
