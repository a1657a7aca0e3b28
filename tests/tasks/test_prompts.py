"""The `prompts` task (mecheval/tasks/prompts.py): documents are what the tokenizer reads of the
texts, written here from the templates by plain string formatting; roles are the slots' token
spans; corruptions substitute a filler and are what the tokenizer reads of the substituted
text; check_task passes; fillers the tokenizer reads otherwise in context are refused by name.
Tokenizers are built offline (a word per id; byte-level BPE trained on a few sentences)."""

from __future__ import annotations

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer

from mecheval.models.pretrained.synthetic import _save_tokenizer, bpe_tokenizer, word_tokenizer
from mecheval.tasks import make_task
from mecheval.testing import check_task

NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace"]
CODES = ["12", "47", "53", "88", "31", "64", "70"]
WORDS = ["The", "code", "of", "is", ".", *NAMES, *CODES, "Mary", "Ann", "Lee", "Sue"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return str(word_tokenizer(WORDS, tmp_path_factory.mktemp("words")))


def _task(tokenizer, **options):
    return make_task("prompts", tokenizer=tokenizer, **{"keys": NAMES, "values": CODES, **options})


def _text(task, keys, values, asked):
    statements = [task.template.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
    return task.separator.join([*statements, task.query.format(key=asked)])


def _decoded(task, tokenizer, row, span):
    """The text a role's span covers (what the tokenizer's ids there decode to)."""
    start, stop = span.tolist()
    return tokenizer.decode(row[start:stop].tolist()).strip()


def _fillers(task, tokenizer, batch, row):
    """The keys and values of a document, read back from its ids by the tokenizer's decoding."""
    text = tokenizer.decode(batch.tokens[row, : batch.lengths[row]].tolist())
    parts = text.split(" . ")
    pairs = [p.split(" ") for p in parts[:-1]]
    return [p[3] for p in pairs], [p[5].rstrip(" .") for p in pairs], parts[-1].split(" ")[3]


def test_documents_are_the_tokenizers_reading_of_the_texts(words):
    task = _task(words)
    tokenizer = AutoTokenizer.from_pretrained(words)
    batch = task.sample(16, seed=3, split="dev")
    for row in range(len(batch)):
        keys, values, asked = _fillers(task, tokenizer, batch, row)
        assert len(set(keys)) == task.pairs and len(set(values)) == task.pairs
        assert asked in keys
        expected = tokenizer(_text(task, keys, values, asked))["input_ids"]
        assert batch.tokens[row, : batch.lengths[row]].tolist() == expected
        assert _decoded(task, tokenizer, batch.tokens[row], batch.spans["key"][row]) == asked
        queried = values[keys.index(asked)]
        assert _decoded(task, tokenizer, batch.tokens[row], batch.spans["value"][row]) == queried
        assert batch.answers[row] == tokenizer(queried, add_special_tokens=False)["input_ids"][0]
        start, stop = batch.spans["query"][row].tolist()
        assert stop == batch.lengths[row] and batch.positions["query"][row] == stop - 1
        assert tokenizer.decode(batch.tokens[row, start:stop].tolist()) == f"{asked} is"
        assert batch.positions["key"][row] == batch.spans["key"][row, 1] - 1
        assert batch.positions["value"][row] == batch.spans["value"][row, 0]
    assert task.format(batch.tokens[0]).startswith("The code of ")


@pytest.mark.parametrize("corruption", ["key", "value"])
def test_a_corruption_is_the_tokenizers_reading_of_the_substituted_text(words, corruption):
    task = _task(words)
    tokenizer = AutoTokenizer.from_pretrained(words)
    batch = task.sample(16, seed=1, split="test")
    corrupted = task.corrupt(batch, corruption, seed=5)
    assert torch.equal(corrupted, task.corrupt(batch, corruption, seed=5))
    assert not torch.equal(corrupted, task.corrupt(batch, corruption, seed=6))
    for row in range(len(batch)):
        keys, values, asked = _fillers(task, tokenizer, batch, row)
        at = keys.index(asked)
        span = batch.spans[corruption][row]
        new = _decoded(task, tokenizer, corrupted[row], span)
        assert new not in (keys if corruption == "key" else values)  # one it does not hold
        if corruption == "key":
            keys[at] = new
        else:
            values[at] = new
        expected = tokenizer(_text(task, keys, values, asked))["input_ids"]
        assert corrupted[row, : batch.lengths[row]].tolist() == expected


def test_check_task_passes(words):
    report = check_task(_task(words))
    assert not report.failed


def test_fillers_of_several_tokens_with_a_bpe_tokenizer(tmp_path):
    """Byte-level BPE (GPT-2's kind: a leading space joins the word after it); keys of two
    tokens each, substituted whole."""
    keys = [" Mary Ann", " Bob Lee", " Sue Eve", " Dave Ray", " Carl Jo"]
    values = [" 12", " 47", " 53", " 88", " 31"]
    sentences = [f"The code of{k} is{v}." for k in keys for v in values] * 4
    folder = bpe_tokenizer([*sentences, *[" " + " ".join(sentences[:20])] * 4], tmp_path, 400)
    task = make_task(
        "prompts", tokenizer=str(folder), keys=keys, values=values, pairs=2,
        template="The code of{key} is{value}.", query="The code of{key} is",
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert task.layout.key_ids.shape[1] == 2  # every key two tokens
    batch = task.sample(8, seed=0, split="dev")
    first = batch.tokens[0, : batch.lengths[0]].tolist()
    assert tokenizer.decode(first).endswith(" is")
    assert not check_task(task, grid=False).failed


def test_a_tokenizer_that_adds_special_ids(tmp_path):
    """BOS before the text and EOS after it (Llama's BOS, some tokenizers' EOS): the document
    keeps the BOS and ends at the last prompt token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(sorted(WORDS))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    folder = _save_tokenizer(backend, tmp_path, unk_token="<unk>", bos_token="<s>")
    task, plain = _task(str(folder)), _task(str(folder), add_special_tokens=False)
    batch = task.sample(4, seed=0, split="dev")
    assert (batch.tokens[:, 0] == 1).all() and (batch.tokens[:, 1:] > 2).all()
    assert task.max_document_length == plain.max_document_length + 1
    for role in ("keys", "values"):
        assert [(a - 1, b - 1) for a, b in getattr(task.layout, role)] == getattr(
            plain.layout, role
        )
    rows = torch.arange(len(batch))
    assert torch.equal(batch.tokens[rows, batch.positions["value"]], batch.answers)


def test_fillers_the_tokenizer_reads_otherwise_are_refused_by_name(words, tmp_path):
    with pytest.raises(ValueError, match=r"key 'Mary Ann' is 2 token\(s\) in context"):
        _task(words, keys=[*NAMES[:3], "Mary Ann"]).sample(2, 0, "dev")
    with pytest.raises(ValueError, match="key 'Zed' is read as the tokenizer's unknown token"):
        _task(words, keys=[*NAMES[:3], "Zed"]).layout  # noqa: B018
    twice = ["12 47", "12 53", "47 53", "88 31"]
    with pytest.raises(ValueError, match="values '12 47' and '12 53' have the same first token"):
        _task(words, values=twice).layout  # noqa: B018
    joined = str(word_tokenizer([*WORDS, "12-", "47-", "53-", "88-", "-."], tmp_path))
    with pytest.raises(ValueError, match="value '12-' tokenises differently in context"):
        _task(joined, values=["12-", "47-", "53-", "88-"]).layout  # noqa: B018


def test_a_corruption_with_no_filler_apart_is_refused_by_name(words):
    task = _task(words, keys=["Mary Ann", "Mary Lee", "Mary Sue"], pairs=2)
    batch = task.sample(4, seed=0, split="dev")
    with pytest.raises(ValueError, match=r"no key differs from 'Mary \w+' at every token"):
        task.corrupt(batch, "key", seed=0)
    assert task.corrupt(batch, "value", seed=0).shape == batch.tokens.shape


def test_options_are_checked_and_round_trip(words):
    task = _task(words)
    assert make_task("prompts", **task.config()) == task
    assert yaml.safe_load(yaml.safe_dump(task.config())) == task.config()
    assert hash(task) == hash(make_task("prompts", **task.config()))
    with pytest.raises(ValueError, match="'keys' needs at least 4 fillers"):
        _task(words, keys=NAMES[:3])
    with pytest.raises(ValueError, match=r"names \['Bob'\] more than once"):
        _task(words, keys=["Bob", *NAMES])
    with pytest.raises(ValueError, match=r"'template' must hold \{key\} and \{value\} once"):
        _task(words, template="The code of {key} is.")
    with pytest.raises(ValueError, match=r"'query' must hold \{key\} once"):
        _task(words, query="The code is")
    with pytest.raises(TypeError, match="'keys' must be a list of strings"):
        _task(words, keys="Alice")
    with pytest.raises(TypeError, match="unknown option"):
        _task(words, pair=2)


def test_a_missing_tokenizer_is_one_line(tmp_path):
    task = _task(str(tmp_path / "nothing"))
    assert task.label().startswith("prompts(")  # its options alone: no tokenizer needed
    with pytest.raises(ValueError, match="tokenizer .*: transformers cannot load it") as error:
        task.sample(2, 0, "dev")
    assert "\n" not in str(error.value)


def test_another_tokenizer_makes_other_documents(words, tmp_path):
    other = str(word_tokenizer([*WORDS, "extra"], tmp_path))
    a, b = _task(words), _task(other)
    assert a.key() != b.key() and a.label() != b.label()
