"""The report of a set of trained and evaluated runs: accuracy and mechanism side by side.

    build_report(path) -> path/report/{report.md, report.html, *.png}

Contents:
- accuracy: the best learning rate per (task, architecture, width), by final dev accuracy (the
  study's selection), with its dev and test accuracy;
- mechanism: for each selected run, key corrupted, the Attrib of restoring layer 1's block
  input at the value (induction), the query (direct retrieval, early) and the key (direct,
  late), and the label these give (mecheval.interventions.readout);
- Attrib heatmaps of each selected run: (layer, site) x position, key corruption;
- a scatter of value- vs query-Attrib across architectures;
- for Mamba runs, the read-outs inside the layer-0 short conv: its output at the value, the
  next key (value+1) and value+2.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from mecheval.evaluate import INTERVENTIONS, finished_runs  # noqa: E402
from mecheval.interventions import MECHANISM_THRESHOLD, attrib, readout  # noqa: E402
from mecheval.train.loop import RESULT  # noqa: E402

MODEL = ["task", "arch", "d_model", "n_layers"]


def collect_results(path: str | Path) -> pd.DataFrame:
    """One row per finished run: its identity and accuracies."""
    rows = []
    for run in finished_runs(path):
        result = json.loads((run / RESULT).read_text())
        config = result["config"]
        rows.append(
            {
                "run": run.name,
                "path": str(run),
                "task": config["task"]["name"],
                "arch": config["model"]["arch"],
                "d_model": config["model"]["d_model"],
                "n_layers": config["model"]["n_layers"],
                "lr": config["optim"]["lr"],
                "dev_accuracy": result["dev_accuracy"],
                "test_accuracy": result["test_accuracy"],
                "steps": result["steps"],
                "wall_time_s": result["wall_time_s"],
                "evaluated": (run / INTERVENTIONS).exists(),
            }
        )
    return pd.DataFrame(rows)


def best_runs(results: pd.DataFrame) -> pd.DataFrame:
    """The run with the best dev accuracy per (task, arch, width, depth); ties: smaller lr."""
    ordered = results.sort_values(["dev_accuracy", "lr"], ascending=[False, True])
    return ordered.groupby(MODEL, sort=False).head(1).sort_values(MODEL).reset_index(drop=True)


def mechanism_table(best: pd.DataFrame) -> pd.DataFrame:
    """Read-outs (key corruption) of the selected runs that have been evaluated."""
    rows = []
    for _, run in best[best["evaluated"]].iterrows():
        grid = pd.read_parquet(Path(run["path"]) / INTERVENTIONS)
        grid = grid[grid["corruption"] == "key"].drop(
            columns=["corruption", "task", "accuracy", "lr", "replacement_ids"], errors="ignore"
        )
        scores = readout(grid.drop(columns=["run", "arch", "d_model", "n_layers"]))
        row = {k: run[k] for k in (*MODEL, "lr", "dev_accuracy")}
        row.update(scores.iloc[0].to_dict())
        rows.append(row)
    return pd.DataFrame(rows)


def _attrib_of(run: pd.Series, corruption: str = "key") -> pd.DataFrame:
    grid = pd.read_parquet(Path(run["path"]) / INTERVENTIONS)
    grid = grid[grid["corruption"] == corruption]
    identity = ["run", "arch", "d_model", "n_layers", "lr", "task", "accuracy", "corruption"]
    return attrib(grid.drop(columns=[*identity, "replacement_ids"], errors="ignore"))


def corruption_note(best: pd.DataFrame) -> str:
    """Which ids the evaluated runs' corruptions drew from, e.g. "key: ids 3..4098; value:
    ids 3..4098" per task."""
    seen: dict[str, dict[str, str]] = {}
    for _, run in best[best["evaluated"]].iterrows():
        grid = pd.read_parquet(Path(run["path"]) / INTERVENTIONS)
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


def _heatmap(run: pd.Series, out: Path) -> str | None:
    table = _attrib_of(run)
    if table.empty:
        return None
    table["row"] = "L" + table["layer"].astype(str) + " " + table["site"]
    order = list(dict.fromkeys(table.sort_values(["layer"], kind="stable")["row"]))
    columns = list(dict.fromkeys(table["position"]))
    grid = table.pivot(index="row", columns="position", values="attrib").reindex(
        index=order, columns=columns
    )
    fig, ax = plt.subplots(figsize=(1.1 * len(columns) + 3, 0.32 * len(order) + 1.5))
    image = ax.imshow(grid.to_numpy(dtype=float), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right")
    ax.set_yticks(range(len(order)), order, fontsize=8)
    ax.set_title(
        f"{run['arch']} d={run['d_model']}: Attrib, key corrupted (acc {run['dev_accuracy']:.2f})"
    )
    fig.colorbar(image, ax=ax, label="Attrib")
    fig.tight_layout()
    name = f"heatmap_{run['arch']}_d{run['d_model']}_l{run['n_layers']}.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _scatter(mechanisms: pd.DataFrame, out: Path) -> str | None:
    two_layer = (
        mechanisms.dropna(subset=["induction", "direct_early"])
        if "induction" in mechanisms
        else None
    )
    if two_layer is None or two_layer.empty:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for arch, part in two_layer.groupby("arch"):
        ax.scatter(part["direct_early"], part["induction"], label=arch, s=40)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
    ax.set_xlabel("Attrib at query (direct retrieval, early)")
    ax.set_ylabel("Attrib at value (induction)")
    ax.set_title("Layer 1 block input, key corrupted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "value_vs_query.png", dpi=110)
    plt.close(fig)
    return "value_vs_query.png"


def mamba_conv_readouts(best: pd.DataFrame) -> pd.DataFrame:
    """Layer-0 short conv of Mamba runs: Attrib of its output at value, value+1, value+2."""
    rows = []
    for _, run in best[best["evaluated"] & best["arch"].str.startswith("mamba")].iterrows():
        table = _attrib_of(run)
        cells = table[(table["layer"] == 0) & (table["site"] == "conv_output")]
        if cells.empty:
            continue
        row = {k: run[k] for k in ("arch", "d_model", "dev_accuracy")}
        for position in ("value", "value+1", "value+2"):
            hit = cells[cells["position"] == position]
            row[position] = float(hit["attrib"].iloc[0]) if len(hit) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def _markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_none_\n"
    shown = frame.copy()
    for column in shown.columns:
        if shown[column].dtype.kind == "f":
            shown[column] = shown[column].map(lambda v: "" if pd.isna(v) else f"{v:.3f}")
    header = "| " + " | ".join(map(str, shown.columns)) + " |"
    rule = "|" + "---|" * len(shown.columns)
    body = ["| " + " | ".join(map(str, row)) + " |" for row in shown.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def build_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write report.md, report.html and the PNG plots; returns the report folder."""
    path = Path(path)
    out = Path(out) if out else path / "report"
    out.mkdir(parents=True, exist_ok=True)
    results = collect_results(path)
    if results.empty:
        raise FileNotFoundError(f"no finished run under {path}")
    best = best_runs(results)
    mechanisms = mechanism_table(best)
    conv = mamba_conv_readouts(best)
    plots = [name for _, run in best[best["evaluated"]].iterrows() if (name := _heatmap(run, out))]
    scatter = _scatter(mechanisms, out) if not mechanisms.empty else None

    accuracy = best[[*MODEL, "lr", "dev_accuracy", "test_accuracy", "steps", "wall_time_s"]]
    mechanism_note = (
        f"{corruption_note(best)} The `mechanism` label is mecheval's own rule (the highest "
        f'read-out if it reaches {MECHANISM_THRESHOLD}, else "unclear"); the study reports '
        "the Attrib values themselves."
    )
    sections = [
        ("Accuracy (best learning rate per architecture and width)", _markdown(accuracy)),
        (
            "Mechanism (key corrupted; Attrib of restoring layer 1's block input)",
            mechanism_note
            + "\n\n"
            + _markdown(mechanisms.drop(columns=[c for c in ("run",) if c in mechanisms])),
        ),
        ("Mamba: inside the layer-0 short conv (Attrib of its output)", _markdown(conv)),
        ("All runs", _markdown(results.drop(columns=["path", "evaluated"]))),
    ]
    figures = ([scatter] if scatter else []) + plots
    md = ["# mecheval report", "", f"Runs under `{path}`: {len(results)}.", ""]
    for title, body in sections:
        md += [f"## {title}", "", body]
    md += ["## Figures", ""] + [f"![{name}]({name})" for name in figures]
    (out / "report.md").write_text("\n".join(md) + "\n")

    page = [
        "<!doctype html><meta charset=utf-8><title>mecheval report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}</style>",
        "<h1>mecheval report</h1>",
        f"<p>Runs under <code>{html.escape(str(path))}</code>: {len(results)}.</p>",
    ]
    notes = {sections[1][0]: mechanism_note}
    for (title, _), frame in zip(
        sections,
        (accuracy, mechanisms, conv, results.drop(columns=["path", "evaluated"])),
        strict=True,
    ):
        page += [f"<h2>{html.escape(title)}</h2>"]
        if title in notes:
            page += [f"<p>{html.escape(notes[title])}</p>"]
        page += [
            frame.to_html(index=False, float_format=lambda v: f"{v:.3f}", na_rep="")
            if not frame.empty
            else "<p><em>none</em></p>",
        ]
    page += ["<h2>Figures</h2>"] + [f'<p><img src="{name}" alt="{name}"></p>' for name in figures]
    (out / "report.html").write_text("\n".join(page) + "\n")
    return out
