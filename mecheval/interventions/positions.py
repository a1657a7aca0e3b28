"""Position specs of an intervention grid: which token position each cell patches, per row.

A spec is a named position of the task ("key", "value", "divider", "query", "answer"),
optionally shifted ("value+1" is the token after the value: in AR, the next key), or an
absolute index (an int, or its string: "7"). "all" expands to every index 0..L-1.
"""

from __future__ import annotations

import re

import torch

from mecheval.tasks import Batch

NAMED = ("key", "value", "divider", "query")
_SHIFTED = re.compile(r"^(?P<name>[a-z_]+)(?P<shift>[+-]\d+)?$")


def expand_positions(specs, length: int) -> list[str]:
    """The list of position labels a grid runs: named defaults, "all" expanded."""
    if specs is None:
        return list(NAMED)
    if isinstance(specs, (str, int)):
        specs = [specs]
    labels: list[str] = []
    for spec in specs:
        if spec == "all":
            labels.extend(str(i) for i in range(length))
        else:
            labels.append(str(spec))
    return list(dict.fromkeys(labels))  # unique, order kept


def resolve_position(label: str, batch: Batch) -> torch.Tensor:
    """(n,) LongTensor: the position `label` names in each row of `batch`."""
    n, length = batch.tokens.shape
    if label.lstrip("-").isdigit():
        index = int(label)
        if not 0 <= index < length:
            raise ValueError(f"position {index} is outside the documents' 0..{length - 1}")
        return torch.full((n,), index, dtype=torch.long, device=batch.tokens.device)
    match = _SHIFTED.match(label)
    if match is None or match["name"] not in batch.positions:
        raise ValueError(
            f"unknown position {label!r}: use one of {sorted(batch.positions)} (optionally "
            "shifted, e.g. 'value+1'), an index, or 'all'"
        )
    positions = batch.positions[match["name"]] + int(match["shift"] or 0)
    if int(positions.min()) < 0 or int(positions.max()) >= length:
        raise ValueError(f"position {label!r} falls outside some documents")
    return positions
