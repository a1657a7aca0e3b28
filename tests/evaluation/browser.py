"""A page measured as headless Chromium renders it (Debian's `chromium`), offline, no driver:
the page is copied beside itself with a script that writes its measurements into the DOM on
load, and `chromium --dump-dom` hands the DOM back.

    measure(page)              -> dict: viewport, page width, images, tables, the figure
    screenshot(page, png)      the first screen, as the browser draws it

    python -m tests.evaluation.browser REPORT.html OUT.png    (the screenshot in docs/)
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH, HEIGHT = 1400, 900  # the first screen
# Offline and alone: no network, no sync, no first-run, a fresh profile each time.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WIDTH},{HEIGHT}",
]
MEASURE = """<script>
addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect();
    return {left: r.left, right: r.right, top: r.top + scrollY, bottom: r.bottom + scrollY,
            width: r.width, height: r.height}; };
  const figure = document.querySelector("#overview svg");
  const out = {
    viewport: [innerWidth, innerHeight],
    page_width: document.documentElement.scrollWidth,
    images: [...document.images].map(i => ({src: i.getAttribute("src"),
                                            loaded: i.complete && i.naturalWidth > 0})),
    tables: [...document.querySelectorAll("table")].map(t => ({
      ...box(t), head: t.querySelector("th") ? t.querySelector("th").textContent : "",
      box: box(t.closest(".scroll") || t)})),
    figure: figure ? box(figure) : null,
    svgs: [...document.querySelectorAll("svg")].map(s => ({id: s.parentElement.id, ...box(s)})),
    links: [...document.querySelectorAll("svg a")].map(a =>
      (a.getAttribute("href") || a.getAttribute("xlink:href"))),
    ids: [...document.querySelectorAll("[id]")].map(e => e.id),
  };
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _run(args: list[str], timeout: float = 120) -> str:
    if CHROMIUM is None:
        raise RuntimeError("no chromium on PATH")
    with tempfile.TemporaryDirectory(prefix="mecheval-chromium-") as profile:
        done = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    return done.stdout


def measure(page: Path) -> dict:
    """What Chromium measured of `page` at 1400 x 900 px (the copy lives beside it, so its
    relative images resolve; it is removed afterwards)."""
    page = Path(page).resolve()
    probe = page.with_name(f".measure-{page.name}")
    probe.write_text(page.read_text().replace("</body>", "") + MEASURE)
    try:
        dom = _run(["--virtual-time-budget=10000", "--dump-dom", probe.as_uri()])
    finally:
        probe.unlink()
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, flags=re.S)
    if found is None:
        raise AssertionError(f"the page's load handler did not run: {dom[-500:]}")
    return json.loads(html.unescape(found[1]))


def screenshot(page: Path, png: Path) -> Path:
    """The first screen of `page` (1400 x 900 px) as Chromium draws it, written to `png`."""
    png = Path(png).resolve()
    _run(["--virtual-time-budget=10000", f"--screenshot={png}", Path(page).resolve().as_uri()])
    return png


if __name__ == "__main__":
    print(screenshot(Path(sys.argv[1]), Path(sys.argv[2])))
