"""`prompts`: recall in natural language, for pretrained language models, on the task contract
(docs/tasks.md; docs/pretrained.md has the worked example).

    task = make_task("prompts", tokenizer="openai-community/gpt2",
                     keys=[" Alice", " Bob", " Carol", " Dave"], values=[" 12", " 47", ...])
    batch = task.sample(32, seed=0, split="dev")
    corrupted = task.corrupt(batch, "key", seed=0)
    print(task.format(batch.tokens[0]))   # The code of Bob is 47. The code of ... is

A document states `pairs` facts, `template` ("The code of {key} is {value}.") filled with
distinct keys and distinct values drawn from the lists the options give, joined by
`separator`, then asks `query` ("The code of {key} is") of one of its keys. A filler is put
into its slot as it is written (a leading space included: " Alice"). The text is read by the
checkpoint's tokenizer (transformers' AutoTokenizer of a folder or hub id, the option
`tokenizer`; with `add_special_tokens` the ids it adds, such as Llama's BOS). The answer is the
first token of the queried value, as its statement spells it.

Roles, token spans of the slots (from the tokenizer's offsets):
    key     the queried statement's key, anchored at its last token
    value   the queried statement's value, anchored at its first token (the answer's id)
    query   from the query's key to the last prompt token, anchored at the last prompt token,
            whose next-token prediction is the answer
Corruptions, by slot substitution: `key` puts another key, one the document does not hold, in
the queried statement (the asked key then has no value there); `value` puts another value, one
the document does not hold, in its place (the answer changes with it). The replacement differs
from the original at every token and is drawn uniformly among those that do, by seed.

Every document of a task has the same tokens around its slots, so its spans are the same in
every document, and a substitution keeps the tokenised length. This holds when every filler
is read alike in every slot it fills and as many tokens as the others of its kind; it is
checked on first use for every filler, and every document and corruption made is checked
against the tokenizer's own reading of its text (mecheval.tasks.prompt_layout): a ValueError
names the filler that fails. Values must differ in their first token (the answer), keys and
values in their ids.

Splits: a document (its keys, values and queried pair) falls in the split a hash of it picks,
train one half, dev and test a quarter each, so the splits share no document.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.base import _FIRST_CORRUPTION_STREAM, Corruption, Task
from mecheval.tasks.batch import Batch
from mecheval.tasks.prompt_layout import (
    Layout,
    fingerprint,
    load_tokenizer,
    render,
    template_fields,
    verify,
)

# The share of the document space each split holds (cumulative bounds of a hash in [0, 1)).
SPLIT_BOUNDS = {"train": (0.0, 0.5), "dev": (0.5, 0.75), "test": (0.75, 1.0)}
# Draws per document a split may take before the fillers are found to make too few documents.
MAX_DRAWS = 1000


@dataclass(frozen=True)
class PromptRecall(Task):
    """Recall in natural language (see the module docstring).

    Args:
        tokenizer: a folder holding the checkpoint's tokenizer files, or a hub id.
        keys, values: the fillers of the slots {key} and {value}, each at least pairs + 1
            distinct strings (a corruption draws one the document does not hold).
        pairs: statements per document.
        template: a statement, with one {key} and one {value}.
        query: the question, with one {key}; the answer is its next token.
        separator: between the statements, and before the query.
        add_special_tokens: let the tokenizer add its special ids (BOS) as it does by default.
    """

    tokenizer: str
    keys: Sequence[str]
    values: Sequence[str]
    pairs: int = 3
    template: str = "The code of {key} is {value}."
    query: str = "The code of {key} is"
    separator: str = " "
    add_special_tokens: bool = True
    name: ClassVar[str] = "prompts"
    special_tokens: ClassVar[bool] = False  # the ids are the tokenizer's
    roles: ClassVar[tuple[str, ...]] = ("key", "value", "query")
    corruptions: ClassVar[Mapping[str, Corruption]] = MappingProxyType(
        {"key": Corruption("key"), "value": Corruption("value")}
    )

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise TypeError(
                f"option 'tokenizer' must name a folder or hub id, got {self.tokenizer!r}"
            )
        self._set_option("pairs", check_int("pairs", self.pairs, 1))
        for option in ("keys", "values"):
            self._set_option(option, _fillers(option, getattr(self, option), self.pairs + 1))
        for option in ("template", "query", "separator"):
            if not isinstance(getattr(self, option), str):
                raise TypeError(f"option {option!r} must be a string")
        _check_template("template", self.template, ["key", "value"])
        _check_template("query", self.query, ["key"])
        if not isinstance(self.add_special_tokens, bool):
            raise TypeError("option 'add_special_tokens' must be true or false")

    # ---- what the tokenizer decides ---------------------------------------------------------

    @functools.cached_property
    def _tokenizer(self):
        return load_tokenizer(self.tokenizer)

    @functools.cached_property
    def _fingerprint(self) -> str:
        return fingerprint(self._tokenizer)

    @functools.cached_property
    def layout(self) -> Layout:
        """Where the slots lie in the ids (mecheval.tasks.prompt_layout), every filler checked."""
        return Layout.of(self._tokenizer, self)

    def _digest(self) -> bytes:
        """The options and the tokenizer's definition: another tokenizer, other documents."""
        payload = {
            "task": self.name,
            "config": self.data_config(),
            "tokenizer": self._fingerprint,
            "generator": self.generator_version,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).digest()

    def label(self) -> str:
        """The task, its tokenizer and sizes, and a digest of its options (the fillers and
        templates), e.g. "prompts(gpt2, 3 pairs, 8 keys, 8 values, 1a2b3c4d)"."""
        options = json.dumps(self.config(), sort_keys=True).encode()
        digest = hashlib.sha256(options).hexdigest()[:8]
        sizes = f"{self.pairs} pairs, {len(self.keys)} keys, {len(self.values)} values"
        return f"{self.name}({self.tokenizer}, {sizes}, {digest})"

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def max_document_length(self) -> int:
        return self.layout.length

    def token_name(self, token: int) -> str:
        return self._tokenizer.convert_ids_to_tokens(int(token))

    def format(self, tokens) -> str:
        """One document as the tokenizer decodes it."""
        ids = torch.as_tensor(tokens).cpu()
        if ids.dim() != 1:
            raise ValueError(f"format takes one document (1-D), got shape {tuple(ids.shape)}")
        return self._tokenizer.decode(ids[: self.layout.length].tolist())

    def replacement_range(self, corruption: str) -> tuple[int, int]:
        """The ids the fillers of the corruption's role are made of, lowest to highest + 1 (a
        corruption puts a whole filler in: see `corrupt`)."""
        role = self.corruption(corruption).role
        ids = self.layout.key_ids if role == "key" else self.layout.value_ids
        return int(ids.min()), int(ids.max()) + 1

    # ---- documents --------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator, split: str, n: int) -> tuple[np.ndarray, ...]:
        """(keys (n, pairs), values (n, pairs), queried (n,)): filler indices of n documents of
        `split`, drawn in turn and kept when their hash falls in the split's share."""
        low, high = SPLIT_BOUNDS[split]
        keys, values, queried = [], [], []
        for _ in range(MAX_DRAWS * n):
            k = rng.choice(len(self.keys), self.pairs, replace=False)
            v = rng.choice(len(self.values), self.pairs, replace=False)
            q = int(rng.integers(self.pairs))
            if low <= _share(k, v, q) < high:
                keys.append(k)
                values.append(v)
                queried.append(q)
                if len(keys) == n:
                    return np.stack(keys), np.stack(values), np.asarray(queried)
        raise ValueError(
            f"{self.label()}: {MAX_DRAWS * n} draws gave {len(keys)} of {n} {split} documents; "
            "give more keys or values"
        )

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        keys, values, queried = self._draw(self.task_rng(seed, self.splits.index(split)), split, n)
        asked = keys[np.arange(n), queried]
        tokens = self._placed(keys, values, asked, [self.keys[a] for a in asked])
        return self._batch(tokens, queried)

    def _placed(self, keys, values, asked, names: list[str]) -> np.ndarray:
        """(n, L) the ids of the documents of these filler indices (`asked`: the asked key),
        placed by the layout and checked against the tokenizer's reading of their texts (a
        ValueError names `names[j]`, the filler last placed in document j, otherwise)."""
        tokens = self.layout.tokens(keys, values, asked)
        texts = [
            render(self, [self.keys[i] for i in k], [self.values[i] for i in v], self.keys[a])
            for k, v, a in zip(keys, values, asked, strict=True)
        ]
        verify(self._tokenizer, texts, tokens, names, self.add_special_tokens)
        return tokens

    def _batch(self, tokens: np.ndarray, queried: np.ndarray) -> Batch:
        layout, n = self.layout, len(tokens)
        key = np.asarray(layout.keys)[queried]
        value = np.asarray(layout.values)[queried]
        query = np.tile([layout.query[0], layout.length], (n, 1))
        rows = np.arange(n)

        def tensor(array) -> torch.Tensor:
            return torch.as_tensor(np.asarray(array, dtype=np.int64))

        return Batch(
            tokens=tensor(tokens),
            answers=tensor(tokens[rows, value[:, 0]]),
            positions={
                "key": tensor(key[:, 1] - 1),
                "value": tensor(value[:, 0]),
                "query": tensor(query[:, 1] - 1),
            },
            lengths=torch.full((n,), layout.length, dtype=torch.long),
            spans={"key": tensor(key), "value": tensor(value), "query": tensor(query)},
        )

    # ---- counterfactuals --------------------------------------------------------------------

    def corrupt(self, batch: Batch, corruption: str, seed: int) -> torch.Tensor:
        """The documents with the queried statement's key (`key`) or value (`value`) replaced
        by another filler the document does not hold, differing from it at every token, drawn
        uniformly by seed (see the module docstring); (n, L) on the batch's device. A
        document that is not this task's, or a filler with no replacement, is a ValueError."""
        role = self.corruption(corruption).role
        check_int("seed", seed, 0)
        layout = self.layout
        tokens = batch.tokens[:, : layout.length].cpu().numpy()
        keys, values = layout.read(tokens)
        queried = _queried(batch, layout)
        if (keys < 0).any() or (values < 0).any() or (batch.lengths != layout.length).any():
            raise ValueError(f"corrupt: the batch holds documents that are not {self.label()}'s")
        held = keys if role == "key" else values
        table = layout.key_ids if role == "key" else layout.value_ids
        fillers = self.keys if role == "key" else self.values
        stream = _FIRST_CORRUPTION_STREAM + list(self.corruptions).index(corruption)
        draws = self.task_rng(seed, stream).random(len(tokens))
        rows = np.arange(len(tokens))
        original = held[rows, queried]
        chosen = np.empty_like(original)
        for j, (own, draw) in enumerate(zip(original, draws, strict=True)):
            apart = (table != table[own]).all(axis=1)
            apart[held[j]] = False  # none the document holds
            candidates = np.flatnonzero(apart)
            if not len(candidates):
                raise ValueError(
                    f"corrupt {corruption!r}: no {role} differs from {fillers[own]!r} at every "
                    "token (and is absent from its document): give more fillers"
                )
            chosen[j] = candidates[int(draw * len(candidates))]
        asked = keys[rows, queried]  # the query asks the original key in both corruptions
        held[rows, queried] = chosen
        corrupted = self._placed(keys, values, asked, [fillers[c] for c in chosen])
        out = batch.tokens.clone()
        out[:, : layout.length] = torch.from_numpy(corrupted).to(batch.device)
        return out

    def config(self) -> dict[str, Any]:
        """The options, JSON- and YAML-ready (the fillers as lists)."""
        config = super().config()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


def _fillers(option: str, value: object, at_least: int) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"option {option!r} must be a list of strings, got {value!r}")
    if not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"option {option!r} must hold non-empty strings, got {list(value)!r}")
    if len(set(value)) != len(value):
        twice = sorted({v for v in value if list(value).count(v) > 1})
        raise ValueError(f"option {option!r} names {twice} more than once")
    if len(value) < at_least:
        raise ValueError(
            f"option {option!r} needs at least {at_least} fillers (pairs + 1: a corruption puts "
            f"one the document does not hold), got {len(value)}"
        )
    return tuple(value)


def _check_template(option: str, template: str, wanted: list[str]) -> None:
    fields = template_fields(template)
    if sorted(fields) != sorted(wanted):
        slots = " and ".join("{" + name + "}" for name in wanted)
        raise ValueError(f"option {option!r} must hold {slots} once each, got {template!r}")


def _share(keys: np.ndarray, values: np.ndarray, queried: int) -> float:
    """A document's place in [0, 1): a hash of its filler indices and queried pair."""
    data = np.concatenate([keys, values, [queried]]).astype(np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2.0**64


def _queried(batch: Batch, layout: Layout) -> np.ndarray:
    """Each row's queried statement, from where its key role lies."""
    ends = {stop - 1: i for i, (_, stop) in enumerate(layout.keys)}
    anchors = batch.positions["key"].cpu().tolist()
    if any(a not in ends for a in anchors):
        raise ValueError("corrupt: the batch's key roles lie at no statement's key")
    return np.asarray([ends[a] for a in anchors])
