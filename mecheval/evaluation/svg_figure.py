"""A matplotlib figure drawn once and written twice: as PNG (the Markdown report, papers) and as
inline SVG whose marked shapes show their values on hover (an SVG <title>), for report.html
with no server and no script.

    fig = TipFigure(width, height)      one axes filling the figure, in inches, y downward
    fig.add(patch, "tip text")          draw a patch; the SVG shows the text on hover
    fig.save_png(path); fig.svg()       the two outputs
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402

PNG_DPI = 110


class TipFigure:
    """A figure of `width` x `height` inches whose one axes has inch coordinates, origin at
    the top left, y growing downward."""

    def __init__(self, width: float, height: float):
        self.figure = plt.figure(figsize=(width, height))
        self.ax = self.figure.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(height, 0)
        self.ax.axis("off")
        self.tips: dict[str, str] = {}

    def add(self, artist: Artist, tip: str) -> Artist:
        """Add `artist` (a patch) to the axes; in the SVG, hovering it shows `tip`."""
        gid = f"tip-{len(self.tips)}"
        artist.set_gid(gid)
        self.tips[gid] = tip
        self.ax.add_patch(artist)
        return artist

    def save_png(self, path: Path) -> None:
        self.figure.savefig(path, dpi=PNG_DPI)

    def svg(self) -> str:
        """The figure as an <svg> element to inline in HTML: text kept as text, its natural
        width (narrowed to fit its container), a <title> in each marked shape."""
        buffer = io.StringIO()
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mecheval"}):
            self.figure.savefig(buffer, format="svg")
        text = buffer.getvalue()
        text = text[text.index("<svg") :]  # drop the XML prolog and doctype: inlined in HTML
        width = float(re.search(r'<svg[^>]*\swidth="([\d.]+)pt"', text)[1]) * 4 / 3  # pt -> px
        text = re.sub(
            r'<svg([^>]*?)\swidth="[\d.]+pt" height="[\d.]+pt"',
            rf'<svg\1 style="width:{width:.0f}px;max-width:100%;height:auto"',
            text,
            count=1,
        )
        text = re.sub(r'(<a xlink:href="#[^"]*") target="_blank"', r"\1", text)  # in-page links
        return re.sub(r'<g id="(tip-\d+)">', self._titled, text)

    def _titled(self, match: re.Match) -> str:
        return f"{match[0]}<title>{html.escape(self.tips[match[1]])}</title>"

    def close(self) -> None:
        plt.close(self.figure)
