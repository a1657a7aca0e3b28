"""make_task: typed, validated options; configuration round trips and stable keys."""

import json

import pytest

from mecheval.tasks import AssociativeRecall, AssociativeTreecall, make_task

ATR = {"max_rhs_len": 5, "num_terminals": 20}

BAD_OPTIONS = [
    ("ar", {"num_pair": 16}, TypeError, "num_pair"),
    ("ar", {"num_pairs": 0}, ValueError, "num_pairs"),
    ("ar", {"num_pairs": 2.0}, TypeError, "num_pairs"),
    ("ar", {"num_pairs": True}, TypeError, "num_pairs"),
    ("ar", {"num_keys": 8}, ValueError, "num_keys"),
    ("ar", {"query": "both"}, ValueError, "query"),
    ("ar", {"holdout": 1.0}, ValueError, "holdout"),
    ("ar", {"holdout": -0.1}, ValueError, "holdout"),
    ("ar", {"holdout": "0.2"}, TypeError, "holdout"),
    ("ar", {"holdout": 1e-12}, ValueError, "holdout"),
    ("ar", {"num_keys": 100, "holdout": 0.2}, ValueError, "holdout"),
    ("ar", {"corruption_range": "key_range"}, ValueError, "corruption_range"),
    ("atr", {"num_terminals": 20}, TypeError, "max_rhs_len"),
    ("atr", {**ATR, "max_rhs_len": 1}, ValueError, "max_rhs_len"),
    ("atr", {**ATR, "num_terminals": 1}, ValueError, "num_terminals"),
    ("atr", {**ATR, "terminal_factor": 0}, ValueError, "terminal_factor"),
    ("atr", {**ATR, "terminal_factor": "big"}, TypeError, "terminal_factor"),
    ("atr", {**ATR, "num_nonterminals": 0}, ValueError, "num_nonterminals"),
    ("atr", {**ATR, "max_depth": 0}, ValueError, "max_depth"),
    ("atr", {**ATR, "max_rules": 0}, ValueError, "max_rules"),
    ("atr", {**ATR, "holdout": 1}, ValueError, "holdout"),
    ("atr", {**ATR, "seed": -1}, ValueError, "seed"),
    ("atr", {**ATR, "max_length": 2}, ValueError, "max_length"),
    ("atr", {**ATR, "num_pairs": 16}, TypeError, "num_pairs"),
]


@pytest.mark.parametrize("name, options, error, option", BAD_OPTIONS)
def test_bad_options_are_refused_by_name(name, options, error, option):
    with pytest.raises(error, match=option):
        make_task(name, **options)


def test_unknown_task_and_bad_sampling_arguments():
    with pytest.raises(ValueError, match="unknown task 'nope': registered are ar, atr, mqar"):
        make_task("nope")
    task = make_task("ar")
    with pytest.raises(ValueError, match="split"):
        task.sample(4, seed=0, split="valid")
    with pytest.raises(ValueError, match="n must be >= 1"):
        task.sample(0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        task.sample(4, seed=-1)
    with pytest.raises(TypeError, match="seed"):
        task.sample(4, seed=1.5)


@pytest.mark.parametrize(
    "name, options",
    [
        ("ar", {}),
        ("ar", {"query": "value", "holdout": 0.1}),
        ("ar", {"corruption_range": "own"}),
        ("atr", ATR),
        ("atr", {"max_rhs_len": 10, "num_terminals": 8192, "holdout": 0.2, "seed": 3}),
    ],
)
def test_config_rebuilds_an_equal_task_with_the_same_key_and_data(name, options):
    task = make_task(name, **options)
    config = task.config()
    assert json.loads(json.dumps(config)) == config
    rebuilt = make_task(name, **config)
    assert rebuilt == task and hash(rebuilt) == hash(task) and rebuilt.key() == task.key()
    assert rebuilt.sample(20, seed=1).equals(task.sample(20, seed=1))
    assert task.key().startswith(f"{name}-")


def test_config_contents_and_labels():
    assert make_task("ar").config() == {
        "num_pairs": 16,
        "num_keys": 4096,
        "query": "key",
        "holdout": 0.0,
        "corruption_range": "query",
    }
    atr = make_task("atr", max_rhs_len=10, num_terminals=8192)
    assert atr.config()["terminal_factor"] == 20.0 and atr.config()["max_length"] == 1024
    assert atr.label() == "atr(max_rhs_len=10, num_terminals=8192)"
    assert make_task("ar", holdout=0.2).label() == "ar(holdout=0.2)"
    assert isinstance(make_task("ar"), AssociativeRecall)
    assert isinstance(atr, AssociativeTreecall) and atr.name == "atr"


def test_keys_differ_between_configurations_and_are_stable():
    keys = {
        make_task("ar").key(),
        make_task("ar", num_pairs=8).key(),
        make_task("ar", holdout=0.2).key(),
        make_task("atr", **ATR).key(),
        make_task("atr", **ATR, seed=1).key(),
    }
    assert len(keys) == 5
    # Equal options given differently (int vs float, auto vs explicit) are one configuration.
    assert make_task("ar", holdout=0).key() == make_task("ar", holdout=0.0).key()
    explicit = make_task("atr", max_rhs_len=5, num_terminals=8192, terminal_factor=20)
    assert explicit.key() == make_task("atr", max_rhs_len=5, num_terminals=8192).key()


def test_numpy_numbers_are_normalised_to_plain_python_options():
    import numpy as np

    task = make_task(
        "atr", max_rhs_len=np.int64(5), num_terminals=np.int32(20), holdout=np.float32(0.25)
    )
    config = task.config()
    assert type(config["max_rhs_len"]) is int and type(config["holdout"]) is float
    assert json.loads(json.dumps(config)) == config
    assert task == make_task("atr", max_rhs_len=5, num_terminals=20, holdout=0.25)


def test_max_document_length_bounds_every_document():
    ar = make_task("ar", num_pairs=4, num_keys=64)
    assert ar.max_document_length == ar.sample(8, seed=0).width == 13
    atr = make_task("atr", max_rhs_len=5, num_terminals=20, max_length=30)
    assert atr.max_document_length == 35
    assert int(atr.sample(200, seed=0).lengths.max()) <= atr.max_document_length
