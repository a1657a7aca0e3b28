"""Typed configs: YAML + key=value overrides, nesting, aliases, unknown keys refused by name."""

from __future__ import annotations

import pytest

from mecheval.config import ConfigError, parse_value
from mecheval.train.config import TrainConfig, identity, load_train_config


def test_defaults_are_the_study_recipe():
    c = TrainConfig()
    assert (c.batch_size, c.epochs, c.seed, c.task.train_size, c.task.eval_size) == (
        32,
        16,
        42,
        100_032,
        320,
    )
    assert (c.optim.betas, c.optim.eps, c.optim.weight_decay, c.optim.warmup_fraction) == (
        (0.9, 0.999),
        1e-8,
        0.0,
        0.1,
    )
    assert c.total_steps == 50_016  # 16 epochs of 100,032 documents in batches of 32


def test_yaml_then_overrides_with_aliases_and_dotted_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "task:\n  name: atr\n  options: {max_rhs_len: 5, num_terminals: 20}\n"
        "model:\n  arch: based\noptim:\n  lr: 0.01\n"
    )
    c = load_train_config(
        path,
        [
            "arch=mamba",
            "d_model=128",
            "lr=3e-3",
            "optim.betas=[0.8, 0.9]",
            "steps=300",
            "model.options.d_conv=2",
            "compile=true",
        ],
    )
    assert c.task.name == "atr" and c.task.options == {"max_rhs_len": 5, "num_terminals": 20}
    assert (c.model.arch, c.model.d_model, c.model.options) == ("mamba", 128, {"d_conv": 2})
    assert c.optim.lr == 3e-3 and isinstance(c.optim.lr, float)
    assert c.optim.betas == (0.8, 0.9)
    assert c.steps == 300 and c.total_steps == 300
    assert c.compile is True


@pytest.mark.parametrize(
    "override,words",
    [
        ("optim.lrr=1", ["optim.lrr", "did you mean 'optim.lr'"]),
        ("epochz=3", ["epochz", "did you mean 'epochs'"]),
        ("model.width=3", ["model.width"]),
        ("batch_size=abc", ["batch_size", "expected int"]),
        ("batch_size=0", ["batch_size must be >= 1"]),
        ("precision=fp8", ["precision", "fp8"]),
        ("compile=3", ["compile", "expected bool"]),
        ("optim.betas=[0.9]", ["optim.betas", "2 items"]),
        ("no_equals_sign", ["key=value"]),
        ("optim.warmup_fraction=1.5", ["warmup_fraction"]),
        ("threads=0", ["threads must be >= 1"]),
    ],
)
def test_bad_keys_and_values_are_refused_by_name(override, words):
    with pytest.raises(ConfigError) as info:
        load_train_config(None, [override])
    for word in words:
        assert word in str(info.value)


def test_file_must_hold_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_train_config(path)


def test_values_parse_as_yaml_scalars():
    assert parse_value("3e-3") == 0.003 and parse_value("1e-2") == 0.01
    assert parse_value("null") is None and parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2] and parse_value("ar") == "ar"


def test_identity_ignores_display_only_fields():
    assert identity(TrainConfig(progress=False)) == identity(TrainConfig(progress=True))
    assert identity(TrainConfig(seed=1)) != identity(TrainConfig(seed=2))


def test_threads_are_part_of_a_run_only_when_set():
    """A run with its threads set is another run than with them unset or other (its result
    can differ); unset, the identity is what it was before the field existed."""
    assert "threads" not in identity(TrainConfig())
    assert identity(TrainConfig(threads=1)) != identity(TrainConfig())
    assert identity(TrainConfig(threads=1)) != identity(TrainConfig(threads=2))


def test_train_refuses_a_mixer_with_a_site_forward_never_reaches(tmp_path, capsys):
    """Before: it trained, and then `evaluate` failed with "internal error", exit 3."""
    from mecheval.models import register_mixer
    from mecheval.models.registry import unregister_mixer
    from tests.helpers import TINY, cli_line
    from tests.testing.test_mixers import Unreached

    register_mixer("unreached_site", Unreached)
    try:
        run = tmp_path / "run"
        code, line = cli_line(["train", "--out", str(run), *TINY, "arch=unreached_site"], capsys)
    finally:
        unregister_mixer("unreached_site")
    assert code == 2
    assert line == (
        "mecheval: config error: model: layer 0's mixer (Unreached) breaks the mixer contract: "
        "sites: never is never reached by forward (every site sees every position: "
        "docs/mixers.md) (mecheval.testing.check_mixer checks it all)"
    )
    assert not run.exists()
