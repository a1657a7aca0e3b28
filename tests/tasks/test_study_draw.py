"""ATR `draw="study"` / `"study_after_easy"` against the study's own generator (docs/deviations.md).

Every number below was read off the study's generator, run outside this project as its
language script ran it: NumPy's global generator seeded with 42, the (5, 20) language (grammar,
100,032 training and 1,024 evaluation documents) and then, in the same stream, the (10, 20)
one; the 8192-terminal languages each from a fresh seed 42. Documents are token lists
(BOS=1, EOS=2, terminal t = 3 + t) and (child, parent) positions counted from BOS.
"""

import numpy as np
import pytest
import torch

from mecheval.tasks import make_task

EASY = {"max_rhs_len": 5, "num_terminals": 20, "seed": 42}
MEDIUM = {"max_rhs_len": 10, "num_terminals": 20, "seed": 42}
EASY_8192 = {"max_rhs_len": 5, "num_terminals": 8192, "seed": 42}

EASY_DEPTHS = [7, 4, 8, 5, 7, 10, 3, 7, 8, 5, 4, 8, 8, 3, 6, 5, 2, 8, 6, 2]
EASY_DEPTHS += [5, 1, 10, 6, 9, 1, 10, 3, 7, 4, 9, 3, 5, 3, 7, 5, 9, 7, 2, 4]
EASY_RULES = {  # nonterminal: [(probability, body)], bodies as ("N", X) / ("T", t)
    0: [(1.0, [("T", 2), ("T", 6), ("T", 14), ("N", 26)])],
    1: [
        (0.3280094568336262, [("N", 2)]),
        (0.6719905431663737, [("T", 1), ("N", 8), ("T", 17), ("N", 9)]),
    ],
}
EASY_HEAD_0 = [0.1376431255187687, 0.046304285325222704, 0.0721003316038377]
EASY_TRAIN = [  # the first training documents: tokens, (child, parent)
    ([1, 9, 17, 9, 9, 16, 2, 9, 16, 2], (4, 5)),
    ([1, 9, 5, 14, 21, 17, 18, 9, 5, 14, 21, 13, 19, 18, 4, 2, 21, 13, 2], (10, 11)),
    ([1, 9, 5, 14, 21, 17, 2, 9, 17, 2], (1, 5)),
]
EASY_LAST_TRAIN = [1, 15, 21, 12, 4, 16, 8, 12, 4, 12, 15, 17, 16, 22, 18, 2, 8, 12, 2]
EASY_EVAL_321 = ([1, 13, 15, 21, 20, 16, 2, 21, 20, 2], (3, 4))  # test's first document
EASY_EVAL_1_LENGTH, EASY_EVAL_1_QUERY = 80, (73, 77)  # dev's first document

MEDIUM_DEPTHS_START = [7, 3, 4, 5, 9, 4, 3, 5, 4, 7]
MEDIUM_RULES_0 = [
    (0.0993042463513762, [("T", 1)]),
    (0.48931584484569296, [("N", 4), ("N", 26), ("T", 2), ("T", 16), ("T", 5), ("T", 19)]),
    (0.4113799088029308, [("T", 18)]),
]
MEDIUM_TRAIN_0 = (
    [1, 22, 21, 8, 11, 7, 20, 6, 6, 8, 5, 22, 17, 7, 16, 18, 13, 6, 15, 21, 20, 15, 5, 10, 20]
    + [6, 17, 2, 13, 20, 2],
    (16, 20),
)
MEDIUM_LENGTHS = [26, 9, 5, 3, 75, 24, 192, 10, 18, 11]

EASY_8192_RULES_0 = [(1.0, [("T", 5651), ("T", 3512), ("N", 2), ("N", 24)])]
EASY_8192_TRAIN = [
    (
        [1, 6244, 8020, 6944, 3965, 7476, 4366, 1987, 4558, 7891, 6648, 7105, 7315, 1091, 7651]
        + [4471, 5130, 1148, 7965, 6946, 2, 7315, 1091, 2],
        (12, 13),
    ),
    (
        [1, 5323, 5027, 6135, 7894, 1425, 7651, 4471, 5130, 1148, 6309, 1724, 2, 5130, 6309, 2],
        (8, 10),
    ),
    ([1, 2511, 2742, 7651, 4188, 3722, 2748, 705, 2594, 2, 2742, 2594, 2], (2, 8)),
]

MEDIUM_8192 = {"max_rhs_len": 10, "num_terminals": 8192, "seed": 42}
MEDIUM_8192_TRAIN_0 = (
    [1, 5185, 1727, 3465, 1204, 5482, 6707, 4425, 3681, 2, 3465, 1204, 2],
    (3, 4),
)
# Training documents 13,106 and 13,107 (0-based 13,105 and 13,106), drawn after the language's
# first sentence over 1,024 terminals: (length, first 12 tokens, last 4 tokens, query).
MEDIUM_8192_AFTER_LONG = [
    (
        26,
        [1, 2856, 2084, 7187, 3986, 4550, 5622, 3894, 5799, 7323, 2708, 6362],
        [2, 5799, 2708, 2],
        (8, 10),
    ),
    (
        25,
        [1, 7431, 3231, 6193, 2374, 2894, 3759, 949, 4929, 7814, 6019, 3338],
        [2, 2374, 1315, 2],
        (4, 25),
    ),
]

# The study's figures over the first 300 training documents: mean sentence length (terminals)
# and mean child-parent distance, rounded as reported.
FIGURES = {"study": (15.21, 2.37), "study_after_easy": (46.67, 3.89)}


def document(batch, i) -> tuple[list[int], tuple[int, int]]:
    """Row i without padding, and its (key, value) positions."""
    tokens = batch.tokens[i, : int(batch.lengths[i])].tolist()
    return tokens, (int(batch.positions["key"][i]), int(batch.positions["value"][i]))


def figures(batch) -> tuple[float, float]:
    length = (batch.lengths - 5).double().mean().item()
    distance = (batch.positions["value"] - batch.positions["key"]).double().mean().item()
    return length, distance


def test_study_draw_gives_the_studys_easy_grammar():
    grammar = make_task("atr", **EASY, draw="study").grammar
    assert grammar.depth_scores.tolist() == EASY_DEPTHS
    for nonterminal, rules in EASY_RULES.items():
        assert grammar.rules_of(nonterminal) == rules
    assert grammar.head_probs[0, :3].tolist() == EASY_HEAD_0
    assert np.allclose(grammar.head_probs.sum(axis=1), 1.0)


def test_study_draw_gives_the_studys_first_documents_and_figures():
    task = make_task("atr", **EASY, draw="study")
    batch, trees = task.sample_with_trees(300, 0, "train")
    assert [document(batch, i) for i in range(3)] == EASY_TRAIN
    length, distance = figures(batch)
    assert (round(length, 2), round(distance, 2)) == FIGURES["study"]
    rows = torch.arange(300)
    # The tree annotations agree with the query: the key's parent is the value.
    assert torch.equal(trees.parents[rows, batch.positions["key"]], batch.positions["value"])
    assert torch.equal(batch.tokens[rows, batch.positions["value"]], batch.answers)


def test_study_draw_of_8192_terminals_with_the_terminal_factor():
    task = make_task("atr", **EASY_8192, draw="study")
    assert task.terminal_factor == 20.0
    assert task.grammar.depth_scores.tolist() == EASY_DEPTHS  # the same first draws
    assert task.grammar.rules_of(0) == EASY_8192_RULES_0
    batch = task.sample(3, 0, "train")
    assert [document(batch, i) for i in range(3)] == EASY_8192_TRAIN


@pytest.mark.slow
def test_study_draw_stops_an_over_long_sentence_as_the_studys_later_generator():
    """The (10, 8192) language: its first sentence over 1,024 terminals is drawn while its
    13,106th training document is; the documents after it are the study's only if that
    sentence spends the draws the study's generator (from 11 May 2025) spends (about 5 s)."""
    task = make_task("atr", **MEDIUM_8192, draw="study")
    assert task.grammar.rules_of(0) == [(0.9999999999999999, [("T", 2853), ("N", 2)])]
    batch = task.sample(13_107, 0, "train")
    assert document(batch, 0) == MEDIUM_8192_TRAIN_0
    for i, (length, head, tail, query) in zip(
        (13_105, 13_106), MEDIUM_8192_AFTER_LONG, strict=True
    ):
        tokens, got_query = document(batch, i)
        assert (len(tokens) - 5, tokens[:12], tokens[-4:], got_query) == (length, head, tail, query)


@pytest.mark.slow
def test_study_splits_are_its_training_and_evaluation_documents():
    """train = its 100,032 training documents; dev = its evaluation documents 1..320 (those it
    evaluated on), test = 321..1,024 (about 7 s: the whole language is drawn)."""
    task = make_task("atr", **EASY, draw="study")
    assert document(task.sample(100_032, 0, "train"), 100_031)[0] == EASY_LAST_TRAIN
    dev = task.sample(320, 0, "dev")
    tokens, query = document(dev, 0)
    assert (len(tokens) - 5, query) == (EASY_EVAL_1_LENGTH, EASY_EVAL_1_QUERY)
    assert document(task.sample(704, 0, "test"), 0) == EASY_EVAL_321


@pytest.mark.slow
def test_study_after_easy_gives_the_studys_medium_grammar_documents_and_figures():
    """The (10, 20) language continues the stream after the whole (5, 20) one (about 10 s)."""
    task = make_task("atr", **MEDIUM, draw="study_after_easy")
    assert task.grammar.depth_scores[:10].tolist() == MEDIUM_DEPTHS_START
    assert task.grammar.rules_of(0) == MEDIUM_RULES_0
    batch = task.sample(300, 0, "train")
    assert document(batch, 0) == MEDIUM_TRAIN_0
    assert (batch.lengths[:10] - 5).tolist() == MEDIUM_LENGTHS
    length, distance = figures(batch)
    assert (round(length, 2), round(distance, 2)) == FIGURES["study_after_easy"]


def test_study_draw_differs_from_mechevals_and_keeps_default_identities():
    default = make_task("atr", **EASY)
    study = make_task("atr", **EASY, draw="study")
    assert "draw" not in default.config() and study.config()["draw"] == "study"
    assert study.key() != default.key()
    assert make_task("atr", **study.config()) == study
    assert "draw='study'" in study.label()
    assert study.grammar.depth_scores.tolist() != default.grammar.depth_scores.tolist()


@pytest.mark.parametrize(
    "options, call, message",
    [
        ({"draw": "tinylang"}, None, "option 'draw' must be one of"),
        ({"draw": "study", "holdout": 0.2}, None, "does not take holdout"),
        ({"draw": "study", "query": "sibling"}, None, "offers only query='parent'"),
        ({"draw": "study"}, (3, 1, "train"), "seed must be 0"),
        ({"draw": "study"}, (321, 0, "dev"), "has 320 'dev' documents"),
        ({"draw": "study"}, (100_033, 0, "train"), "has 100032 'train' documents"),
    ],
)
def test_study_draw_refuses_what_it_cannot_give(options, call, message):
    with pytest.raises(ValueError, match=message):
        task = make_task("atr", **EASY, **options)
        if call is not None:
            task.sample(*call)
