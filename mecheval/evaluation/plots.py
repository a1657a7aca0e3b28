"""The report's figures: Attrib heatmaps (PNG, and SVG with values on hover:
mecheval.evaluation.svg_figure), and as PNG the value-vs-query scatter, the read-outs over
training and DAS's IIA against k."""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from mecheval.evaluation.svg_figure import TipFigure  # noqa: E402

ATTRIB_COLOURS = plt.get_cmap("RdBu_r")
ATTRIB_RANGE = Normalize(-1.0, 1.0)  # the Attrib colour scale of every figure


def two_places(value: float) -> str:
    """`value` to 2 decimals, never "-0.00" (a tiny negative Attrib reads as no effect)."""
    text = f"{value:.2f}"
    return "0.00" if text == "-0.00" else text


def heatmap_name(run: pd.Series) -> str:
    """The PNG file name of a selected run's heatmap: task, architecture, width, depth and a
    short hash of its setting (two settings of one task stay apart), in characters that every
    operating system allows (an import path's ':' and '.' become '-')."""
    setting = hashlib.sha1(str(run["setting"]).encode()).hexdigest()[:6]
    stem = f"heatmap_{run['task']}_{run['arch']}_d{run['d_model']}_l{run['n_layers']}_{setting}"
    return re.sub(r"[^A-Za-z0-9_-]+", "-", stem) + ".png"


def _heatmap_rows(cells: pd.DataFrame) -> list[tuple[int, str]]:
    """(layer, site) in layer order, then the grid's site order (the model's data flow)."""
    pairs = list(dict.fromkeys(zip(cells["layer"], cells["site"], strict=True)))
    return sorted(pairs, key=lambda pair: (pair[0], pairs.index(pair)))


def _heatmap_positions(cells: pd.DataFrame, grid: pd.DataFrame | None) -> list[str]:
    """The patched positions in document order (their mean index in `grid`), else as given."""
    positions = list(dict.fromkeys(cells["position"]))
    if grid is None or "position_index" not in grid:
        return positions
    where = grid.groupby("position")["position_index"].mean()
    return sorted(positions, key=lambda p: (where.get(p, float("inf")), positions.index(p)))


def heatmap(
    cells: pd.DataFrame,
    title: str,
    outlined: dict[str, tuple[int, str, str]] | None = None,
    grid: pd.DataFrame | None = None,
) -> TipFigure | None:
    """The Attrib heatmap of one run: a row per (layer, site), grouped by layer, a column per
    position in document order (`grid`, the run's key-corruption grid, gives the order), the
    value in each cell and on hover; `outlined` (name -> (layer, site, position): the
    read-outs) boxed; `title`'s second line (after a newline) in italics. `cells`: an `attrib`
    table. None when `cells` is empty."""
    if cells.empty:
        return None
    rows, positions = _heatmap_rows(cells), _heatmap_positions(cells, grid)
    by_cell = cells.set_index(["layer", "site", "position"])
    layers = list(dict.fromkeys(layer for layer, _ in rows))
    top, left, cell_w, cell_h = 1.05, 2.1, 0.78, 0.3
    height = top + len(rows) * cell_h + 0.12 * len(layers) + 0.6
    head, _, sub = title.partition("\n")
    text_w = 0.1 + 0.075 * max(len(head), len(sub)) + 0.2  # DejaVu Sans at 9 pt, about
    fig = TipFigure(max(left + cell_w * len(positions) + 0.2, text_w), height)
    ax = fig.ax
    ax.text(0.1, 0.22, head, fontsize=9.5, weight="bold", va="center")
    ax.text(0.1, 0.45, sub, fontsize=8.5, style="italic", va="center")
    for j, position in enumerate(positions):
        ax.text(left + (j + 0.5) * cell_w, top - 0.15, position, fontsize=8.5, ha="center")
    boxed = {cell: name for name, cell in (outlined or {}).items()}
    y = top
    for layer in layers:
        sites = [site for lay, site in rows if lay == layer]
        ax.text(0.1, y + len(sites) * cell_h / 2, f"layer {layer}", fontsize=9, va="center")
        for site in sites:
            ax.text(left - 0.08, y + cell_h / 2, site, fontsize=8, ha="right", va="center")
            for j, position in enumerate(positions):
                key = (layer, site, position)
                if key in by_cell.index:
                    _heatmap_cell(
                        fig,
                        left + j * cell_w,
                        y,
                        cell_w,
                        cell_h,
                        by_cell.loc[key],
                        key,
                        boxed.get(key),
                    )
            y += cell_h
        y += 0.12
    ax.text(
        0.1,
        y + 0.25,
        "Attrib: -1 (blue) to 1 (red); boxed: the read-outs; hover a cell for its probabilities",
        fontsize=7.5,
        va="center",
        color="#444",
    )
    return fig


def _heatmap_cell(
    fig: TipFigure,
    x: float,
    y: float,
    w: float,
    h: float,
    cell: pd.Series,
    key: tuple[int, str, str],
    readout: str | None,
) -> None:
    value = float(cell["attrib"])
    colour = "#f0f0f0" if math.isnan(value) else ATTRIB_COLOURS(ATTRIB_RANGE(value))
    box = Rectangle(
        (x + 0.02, y + 0.02),
        w - 0.04,
        h - 0.04,
        facecolor=colour,
        edgecolor="black" if readout else "none",
        lw=1.4 if readout else 0,
    )
    layer, site, position = key
    tip = f"layer {layer} {site} at {position}" + (f" ({readout})" if readout else "")
    tip += f": Attrib {value:.3f}"
    if "p_restored" in cell:
        tip += (
            f"\np restored {cell['p_restored']:.3f}, corrupted {cell['p_corrupted']:.3f}, "
            f"original {cell['p_original']:.3f}"
        )
    if "n" in cell:
        tip += f"; {int(cell['n'])} documents"
    fig.add(box, tip)
    if not math.isnan(value):
        ink = "white" if abs(value) > 0.55 else "black"
        fig.ax.text(
            x + w / 2,
            y + h / 2,
            two_places(value),
            fontsize=7.5,
            ha="center",
            va="center",
            color=ink,
        )


def value_vs_query(evidence: pd.DataFrame, out: Path) -> str | None:
    """Induction (value) against direct retrieval (query) read-outs across architectures."""
    if "induction" not in evidence:
        return None
    two_layer = evidence.dropna(subset=["induction", "direct_early"])
    if two_layer.empty:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for (setting, arch), part in two_layer.groupby(["setting", "arch"]):
        ax.scatter(part["direct_early"], part["induction"], label=f"{setting} {arch}", s=40)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.5)
    ax.set_xlabel("Attrib at query (direct retrieval, early)")
    ax.set_ylabel("Attrib at value (induction)")
    ax.set_title("Layer 1 block input, key corrupted")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "value_vs_query.png", dpi=110)
    plt.close(fig)
    return "value_vs_query.png"


def over_training(table: pd.DataFrame, out: Path) -> str | None:
    """One panel per selected run: accuracy and the read-outs against the training step."""
    if table.empty:
        return None
    runs = list(dict.fromkeys(table["run"]))
    columns = min(3, len(runs))
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs, strict=False):
        part = table[table["run"] == run].sort_values("step")
        for name in ("accuracy", "induction", "direct_early", "direct_late"):
            if name in part and part[name].notna().any():
                style = "k--" if name == "accuracy" else "-o"
                ax.plot(part["step"], part[name], style, label=name, markersize=3)
        first = part.iloc[0]
        ax.set_title(f"{first['setting']} {first['arch']} d{first['d_model']}", fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylim(-0.2, 1.2)
    for ax in list(axes.flat)[len(runs) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Read-outs over training (key corrupted; layer 1's block input)")
    fig.tight_layout()
    fig.savefig(out / "over_training.png", dpi=110)
    plt.close(fig)
    return "over_training.png"


def iia_vs_k(iia: pd.DataFrame, out: Path) -> str | None:
    """DAS: one panel per site, IIA (with its interval) against the subspace size k, a line per
    model, layer, position and corruption."""
    iia = iia[iia["k"] > 0] if len(iia) else iia  # no swap (k = 0) has no place on a log axis
    if iia.empty:
        return None
    sites = list(dict.fromkeys(iia["site"]))
    fig, axes = plt.subplots(1, len(sites), figsize=(4.5 * len(sites), 4), squeeze=False)
    for ax, site in zip(axes[0], sites, strict=True):
        keys = ["arch", "d_model", "layer", "position", "corruption"]
        for key, line in iia[iia["site"] == site].groupby(keys):
            arch, d_model, layer, position, corruption = key
            label = f"{arch} d{d_model} L{layer} @{position} ({corruption})"
            ax.plot(line["k"], line["iia"], marker="o", ms=3, label=label)
            ax.fill_between(line["k"], line["iia_low"], line["iia_high"], alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_xlabel("k (dimensions swapped)")
        ax.set_ylabel("IIA")
        ax.set_title(site)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "das_iia.png", dpi=110)
    plt.close(fig)
    return "das_iia.png"
