"""Where the slots of the `prompts` task's documents lie in a tokenizer's ids, checked.

    layout = Layout.of(tokenizer, task)     the token spans of every slot, the same in every
                                            document; each filler's ids in its slot
    layout.tokens(keys, values, queried)    (n, L) the documents' ids, placed by the layout
    layout.verify(texts, tokens, ...)       the tokenizer's own ids of the texts, compared

A document's ids are placed, not re-read: the layout is the tokenizer's reading of one probe
document (the first fillers), and every filler's ids are its reading in its slot. That holds
when every filler is read alike wherever it stands (its first and last statement and the
query) and as many tokens as the others of its kind; `Layout.of` checks both for every filler,
and `verify` checks every document made (and every corruption) against the tokenizer itself.
A failure is a ValueError naming the filler.
"""

from __future__ import annotations

import functools
import hashlib
import string
from dataclasses import dataclass

import numpy as np


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str):
    """transformers' AutoTokenizer of a folder or hub id (a fast one: the task reads its
    offsets), loaded once per process; a ValueError says what is missing."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "task prompts needs transformers for its tokenizer (pip install 'mecheval[pretrained]')"
        ) from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    except Exception as error:  # noqa: BLE001  (missing files, offline, unknown id: one line)
        text = str(error).strip()
        reason = text.splitlines()[0].split(". ")[0] if text else ""
        raise ValueError(
            f"tokenizer {name!r}: transformers cannot load it ({type(error).__name__}: "
            f"{reason[:160]}); name a folder holding tokenizer.json, or a hub id"
        ) from None
    if not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer {name!r} is not a fast tokenizer: the task reads the token offsets a "
            "fast one gives (save it with tokenizer.json)"
        )
    return tokenizer


def fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's whole definition (vocabulary, merges, normaliser, added
    tokens): documents of another tokenizer are other documents."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def template_fields(template: str) -> list[str]:
    """The names of the `{...}` slots of a template, in order (a ValueError for a malformed
    one)."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(f"template {template!r}: {error}") from None


@dataclass(frozen=True)
class Text:
    """A document's text and the character span [start, stop) of each slot: keys[i] and
    values[i] of statement i, and the query's key."""

    text: str
    keys: list[tuple[int, int]]
    values: list[tuple[int, int]]
    query: tuple[int, int]


def render(task, keys: list[str], values: list[str], asked: str) -> Text:
    """The text of the document stating keys[i] -> values[i] and asking key `asked`."""
    parts, key_at, value_at = [], [], []
    length = 0

    def add(piece: str, into: list | None = None) -> None:
        nonlocal length
        if into is not None:
            into.append((length, length + len(piece)))
        parts.append(piece)
        length += len(piece)

    statements = [(task.template, k, v) for k, v in zip(keys, values, strict=True)]
    for i, (template, key, value) in enumerate([*statements, (task.query, asked, None)]):
        if i:
            add(task.separator)
        for literal, name, _, _ in string.Formatter().parse(template):
            add(literal)
            if name == "key":
                add(key, key_at)
            elif name == "value":
                add(value, value_at)
    return Text("".join(parts), key_at[:-1], value_at, key_at[-1])


def _encode(tokenizer, texts: list[str], special: bool) -> list[tuple[list[int], list]]:
    """(ids, offsets) of each text, trailing special tokens (an end-of-text the tokenizer
    appends) cut off: a document ends at its last prompt token."""
    encoded = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=True)
    out = []
    for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        last = max(i for i, (start, stop) in enumerate(offsets) if stop > start)
        out.append((list(ids[: last + 1]), [tuple(o) for o in offsets[: last + 1]]))
    return out


def _span(text: Text, offsets: list, where: tuple[int, int], filler: str, kind: str) -> tuple:
    """The tokens [first, stop) covering a slot's characters; a ValueError naming the filler
    when a token runs past the slot into the template's text."""
    start, stop = where
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and a < stop and b > start]
    if not inside:
        raise ValueError(f"{kind} {filler!r} is no token in context (an empty filler?)")
    first, last = inside[0], inside[-1]
    before = text.text[offsets[first][0] : start]
    if before.strip() or offsets[last][1] > stop:
        raise ValueError(
            f"{kind} {filler!r} tokenises differently in context: a token joins it to the "
            "template's text around it; choose fillers the tokenizer reads apart"
        )
    return first, last + 1


@dataclass(frozen=True)
class Layout:
    """The token spans of every slot (the same in every document of the task), each filler's
    ids in its slot, and the probe document's ids around them.

    Attributes:
        probe: (L,) the ids of the document of the first fillers, queried at its first pair.
        keys, values: per statement, the token span [start, stop) of its key and value.
        query: the token span of the query's key; the last prompt token is L - 1.
        key_ids, value_ids: (fillers, tokens) each filler's ids in its slot.
    """

    probe: np.ndarray
    keys: list[tuple[int, int]]
    values: list[tuple[int, int]]
    query: tuple[int, int]
    key_ids: np.ndarray
    value_ids: np.ndarray

    @property
    def length(self) -> int:
        return len(self.probe)

    @staticmethod
    def of(tokenizer, task) -> Layout:
        """The layout of `task`'s documents under `tokenizer`, every filler checked (module
        docstring); a ValueError names the first filler that fails."""
        pairs, special = task.pairs, task.add_special_tokens
        first_keys, first_values = list(task.keys[:pairs]), list(task.values[:pairs])
        probe_text = render(task, first_keys, first_values, first_keys[0])
        ((probe, offsets),) = _encode(tokenizer, [probe_text.text], special)
        keys = [
            _span(probe_text, offsets, w, k, "key")
            for w, k in zip(probe_text.keys, first_keys, strict=True)
        ]
        values = [
            _span(probe_text, offsets, w, v, "value")
            for w, v in zip(probe_text.values, first_values, strict=True)
        ]
        query = _span(probe_text, offsets, probe_text.query, task.keys[0], "key")
        layout = Layout(np.asarray(probe), keys, values, query, None, None)
        key_ids = _filler_ids(tokenizer, task, layout, "key")
        value_ids = _filler_ids(tokenizer, task, layout, "value")
        return Layout(layout.probe, layout.keys, layout.values, query, key_ids, value_ids)

    def tokens(self, keys: np.ndarray, values: np.ndarray, asked: np.ndarray) -> np.ndarray:
        """(n, L) the ids of n documents: keys[j, i] and values[j, i] (filler indices) stated
        at pair i, key asked[j] asked."""
        tokens = np.repeat(self.probe[None], len(keys), axis=0)
        for i, ((ks, ke), (vs, ve)) in enumerate(zip(self.keys, self.values, strict=True)):
            tokens[:, ks:ke] = self.key_ids[keys[:, i]]
            tokens[:, vs:ve] = self.value_ids[values[:, i]]
        tokens[:, self.query[0] : self.query[1]] = self.key_ids[asked]
        return tokens

    def read(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys (n, pairs), values (n, pairs)): the filler indices of documents' ids, -1
        where a slot holds no filler's ids."""
        found = []
        for spans, ids in ((self.keys, self.key_ids), (self.values, self.value_ids)):
            lookup = {tuple(row): i for i, row in enumerate(ids.tolist())}
            found.append(
                np.array(
                    [[lookup.get(tuple(row[a:b]), -1) for a, b in spans] for row in tokens.tolist()]
                ).reshape(len(tokens), len(spans))
            )
        return found[0], found[1]


def _contexts(task, kind: str, filler: str) -> list[tuple[Text, int]]:
    """Documents that hold `filler` at its kind's first and last statement (the other fillers
    the first of their lists), each with that statement's index."""
    fillers = task.keys if kind == "key" else task.values
    others = [f for f in fillers if f != filler][: task.pairs - 1]
    out = []
    for where in sorted({0, task.pairs - 1}):
        mine = [*others[:where], filler, *others[where:]]
        keys = mine if kind == "key" else list(task.keys[: task.pairs])
        values = mine if kind == "value" else list(task.values[: task.pairs])
        out.append((render(task, keys, values, keys[where]), where))
    return out


def _filler_ids(tokenizer, task, layout: Layout, kind: str) -> np.ndarray:
    """(fillers, tokens): each filler of `kind` read in its first and last statement (and,
    for keys, in the query), checked to be read alike there and as many tokens as the
    layout's slot."""
    fillers = task.keys if kind == "key" else task.values
    placed = [
        (filler, text, where) for filler in fillers for text, where in _contexts(task, kind, filler)
    ]
    encoded = _encode(tokenizer, [text.text for _, text, _ in placed], task.add_special_tokens)
    width = int(np.diff((layout.keys if kind == "key" else layout.values)[0])[0])
    ids: dict[str, tuple] = {}
    for (filler, text, where), (read_ids, offsets) in zip(placed, encoded, strict=True):
        places = [text.keys[where], text.query] if kind == "key" else [text.values[where]]
        for place in places:
            start, stop = _span(text, offsets, place, filler, kind)
            read = tuple(read_ids[start:stop])
            if stop - start != width:
                raise ValueError(
                    f"{kind} {filler!r} is {stop - start} token(s) in context, {fillers[0]!r} "
                    f"{width}: every {kind} must be as many tokens (a substitution would change "
                    "the tokenised length)"
                )
            if ids.setdefault(filler, read) != read:
                raise ValueError(
                    f"{kind} {filler!r} tokenises differently in context ({list(ids[filler])} "
                    f"in one place, {list(read)} in another)"
                )
    table = np.array([ids[filler] for filler in fillers], dtype=np.int64)
    unknown = tokenizer.unk_token_id
    if unknown is not None and (table == unknown).any():
        filler = fillers[int(np.flatnonzero((table == unknown).any(axis=1))[0])]
        raise ValueError(
            f"{kind} {filler!r} is read as the tokenizer's unknown token {tokenizer.unk_token!r} "
            "(not in its vocabulary)"
        )
    _check_distinct(table, fillers, kind)
    return table


def _check_distinct(table: np.ndarray, fillers, kind: str) -> None:
    """Fillers of one kind must be told apart by their ids (and values by their first id,
    which is the answer)."""
    column = table[:, 0] if kind == "value" else None
    seen: dict = {}
    for i, row in enumerate(table.tolist()):
        key = row[0] if column is not None else tuple(row)
        if key in seen:
            what = "first token" if kind == "value" else "tokens"
            raise ValueError(
                f"{kind}s {fillers[seen[key]]!r} and {fillers[i]!r} have the same {what} in "
                f"context ({key}): the answer would not tell them apart"
            )
        seen[key] = i


def verify(tokenizer, texts: list[Text], tokens: np.ndarray, names: list[str], special: bool):
    """Check that the tokenizer reads each text as the ids placed for it (`tokens` (n, L));
    a ValueError names the filler (`names[j]`, the one placed last in document j) otherwise."""
    encoded = _encode(tokenizer, [t.text for t in texts], special)
    for j, (ids, _) in enumerate(encoded):
        if len(ids) != tokens.shape[1] or not np.array_equal(ids, tokens[j]):
            raise ValueError(
                f"{names[j]!r} tokenises differently in context: the tokenizer reads the document "
                f"{texts[j].text!r} as {len(ids)} tokens unlike the other documents' "
                f"{tokens.shape[1]} (or other ids)"
            )
