"""Position specs of an intervention grid: which token position each cell patches, per row.

A spec is a role of the task's answers (AR's "key", "value", "divider", "query", "answer";
whatever roles a task declares: docs/tasks.md), optionally shifted ("value+1" is the token
after the value: in AR, the next key), or an absolute index (an int, or its string: "7").
"all" expands to every index 0..L-1. A role names its anchor position (a role of several tokens
is anchored at one of them; `Batch.spans` has them all).

A position lies inside a document when 0 <= p < the document's length. The grid patches any
column of the padded documents (`resolve_position`); evaluation patches a position only in the
documents it lies inside (`inside_documents`), since a shifted position can pass the end of a
short document.
"""

from __future__ import annotations

import re

import torch

from mecheval.tasks import Batch

NAMED = ("key", "value", "divider", "query")
_POSITION = re.compile(r"^(?P<name>[a-z_]+)(?P<shift>[+-]\d+)?$|^(?P<index>\d+)$")


def default_positions(roles) -> list[str]:
    """The roles among key, value, divider and query that `roles` holds (a grid's default)."""
    return [name for name in NAMED if name in roles]


def expand_positions(specs, length: int, roles=NAMED) -> list[str]:
    """The list of position labels a grid runs: the named defaults among `roles`, "all"
    expanded."""
    if specs is None:
        return default_positions(roles)
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
    allowed for anything else ("all" is expanded before, by `expand_positions`). Whether a
    role exists is the task's to say (`locate_position`)."""
    match = _POSITION.match(label)
    if match is None:
        raise ValueError(
            f"{label!r} is not a position: use a role of the task (key, value, query, ...), "
            "optionally shifted (value+1, key-1), an index (0, 1, ...), or all"
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
    if name not in batch.positions:
        raise ValueError(
            f"{label!r} is not a role of these documents (their roles: {', '.join(batch.roles)})"
        )
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
