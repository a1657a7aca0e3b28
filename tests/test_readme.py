"""The README's Python examples run as written and give what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import mecheval_kernels

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _run(source: str) -> dict:
    namespace: dict = {}
    # The tests turn on Triton's interpreter, which "auto" would pick for CPU tensors.
    with mecheval_kernels.use_backend("torch"):
        exec(compile(source, str(README), "exec"), namespace)
    return namespace


def test_the_readme_has_its_two_examples():
    examples = _examples()
    assert len(examples) == 2
    assert "import mecheval_kernels" in examples[0] and "interchange_grid" in examples[1]


def test_the_kernels_example():
    ns = _run(_examples()[0])
    assert ns["y"].shape == ns["x"].shape == (2, 64, 37)
    assert ns["o"].shape == ns["v"].shape and ns["state"].shape == (2, 1, 16, 16)
    # The output at one position per row is the whole output's there.
    out = ns["at"].out
    assert out.shape == (2, 1, 1, 16)
    rows, positions = torch.arange(2), torch.tensor([36, 20])
    torch.testing.assert_close(out[:, 0], ns["o"][rows, positions])


def test_the_evaluation_example(capsys):
    ns = _run(_examples()[1])
    grid, batch = ns["grid"], ns["batch"]
    cells = grid[["layer", "site", "position"]].drop_duplicates()
    # A row per (document, layer, site, position).
    assert len(grid) == len(batch) * len(cells) == 320 * len(cells)
    assert not grid.duplicated(["example", "layer", "site", "position"]).any()
    printed = capsys.readouterr().out
    assert "mechanism" in printed and "induction" in printed
