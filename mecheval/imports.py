"""Importing what a config names by import path (`package.module:Name`): mixers, tasks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def import_module(module_name: str) -> ModuleType:
    """`importlib.import_module`, searching the current directory too, as `python -m` would."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = str(Path.cwd())
        if here in sys.path or not module_name.startswith(error.name or "\0"):
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
