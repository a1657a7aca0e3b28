"""The measured tables that ship beside these modules as CSV files (study_accuracies.csv,
findings_ladder.csv): read from the installed package, one dict of strings per row."""

from __future__ import annotations

import csv
import io
from importlib import resources


def shipped_rows(name: str) -> list[dict[str, str]]:
    """The rows of the CSV file `name` in mecheval/evaluation/, keyed by its header."""
    text = resources.files(__package__).joinpath(name).read_text()
    return list(csv.DictReader(io.StringIO(text)))
