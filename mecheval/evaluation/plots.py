"""The report's figures, as PNG files: Attrib heatmaps, the value-vs-query scatter, the
read-outs over training, and DAS's IIA against k."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def heatmap(cells: pd.DataFrame, title: str, out: Path, name: str) -> str | None:
    """(layer, site) x position Attrib of one run's grid (an `attrib` table)."""
    if cells.empty:
        return None
    cells = cells.assign(row="L" + cells["layer"].astype(str) + " " + cells["site"])
    order = list(dict.fromkeys(cells.sort_values(["layer"], kind="stable")["row"]))
    columns = list(dict.fromkeys(cells["position"]))
    grid = cells.pivot(index="row", columns="position", values="attrib").reindex(
        index=order, columns=columns
    )
    fig, ax = plt.subplots(figsize=(1.1 * len(columns) + 3, 0.32 * len(order) + 1.5))
    image = ax.imshow(grid.to_numpy(dtype=float), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right")
    ax.set_yticks(range(len(order)), order, fontsize=8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="Attrib")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


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
