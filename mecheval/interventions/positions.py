"""Position specs of an intervention grid: which token position each cell patches, per row.

A spec is a named position of the task ("key", "value", "divider", "query", "answer"),
optionally shifted ("value+1" is the token after the value: in AR, the next key), or an
absolute index (an int, or its string: "7"). "all" expands to every index 0..L-1.

A position lies inside a document when 0 <= p < the document's length. The grid patches any
column of the padded documents (`resolve_position`); evaluation patches a position only in the
documents it lies inside (`inside_documents`), since a shifted position can pass the end of a
short document.
"""

from __future__ import annotations

import re

import torch

from mecheval.tasks import POSITION_NAMES, Batch

NAMED = ("key", "value", "divider", "query")
_POSITION = re.compile(r"^(?P<name>[a-z_]+)(?P<shift>[+-]\d+)?$|^(?P<index>\d+)$")


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


def parse_position(label: str) -> tuple[str, int] | int:
    """("value", 1) for "value+1", ("key", 0) for "key", 7 for "7"; ValueError naming what is
    allowed for anything else ("all" is expanded before, by `expand_positions`)."""
    match = _POSITION.match(label)
    if match is None or not (match["index"] or match["name"] in POSITION_NAMES):
        raise ValueError(
            f"{label!r} is not a position: use {', '.join(POSITION_NAMES)}, optionally "
            "shifted (value+1, key-1), an index (0, 1, ...), or all"
        )
    if match["index"]:
        return int(match["index"])
    return match["name"], int(match["shift"] or 0)


def locate_position(label: str, batch: Batch) -> torch.Tensor:
    """(n,) LongTensor: the position `label` names in each row of `batch`, which may lie
    outside the row's document."""
    parsed = parse_position(label)
    if isinstance(parsed, int):
        return torch.full((len(batch),), parsed, dtype=torch.long, device=batch.device)
    name, shift = parsed
    return batch.positions[name] + shift


def inside_documents(label: str, batch: Batch) -> torch.Tensor:
    """(n,) bool: whether the position `label` names lies inside each document of `batch`."""
    positions = locate_position(label, batch)
    return (positions >= 0) & (positions < batch.lengths)


def resolve_position(label: str, batch: Batch) -> torch.Tensor:
    """(n,) LongTensor: the position `label` names in each row of `batch`, a column of its
    padded tokens."""
    length = batch.width
    positions = locate_position(label, batch)
    if isinstance(parse_position(label), int) and not 0 <= int(positions[0]) < length:
        raise ValueError(f"position {label} is outside the documents' 0..{length - 1}")
    if int(positions.min()) < 0 or int(positions.max()) >= length:
        raise ValueError(f"position {label!r} falls outside some documents")
    return positions
