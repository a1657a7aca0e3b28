"""Every config file in configs/ loads, and the study's grids have the study's sizes (the
per-folder study grids of configs/study/ in test_study_configs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mecheval.pipeline import load_run_config
from mecheval.sweep import expand_sweep, load_sweep

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GRID_SIZES = {"study_ar_d64.yaml": 7 * 7, "study_scale.yaml": 55, "frontier_scale.yaml": 15}
RUN_CONFIGS = ("study_ar_run.yaml", "quickstart.yaml", "findings.yaml")
TASK_FILES = ("prompts.yaml",)  # `mecheval evaluate --model ... --task FILE`


def test_every_config_file_is_covered():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert names == set(GRID_SIZES) | set(RUN_CONFIGS) | set(TASK_FILES)


def test_the_prompts_task_file_makes_its_task(tmp_path):
    """configs/prompts.yaml, read as `mecheval evaluate --model` reads it, makes the prompts
    task: with a tokenizer that reads each word as one token (a checkpoint's own is used where
    the file names none), the key the query names is the key at its role, and the answer is
    the token at the value's."""
    from mecheval.evaluation.pretrained import read_task_file
    from mecheval.models.pretrained.synthetic import word_tokenizer
    from mecheval.tasks import make_task

    options = read_task_file(CONFIGS / "prompts.yaml")
    words = ["The", "code", "of", "is", ".", *options["keys"], *options["values"]]
    word_tokenizer(words, tmp_path)
    task = make_task("prompts", tokenizer=str(tmp_path), **options)
    batch = task.dataset("dev", size=16, cache_dir=tmp_path / "cache")
    rows = torch.arange(16)
    keys, values = batch.positions["key"], batch.positions["value"]
    query = batch.positions["query"]  # the prompt's last token, "is": the key just before it
    assert (batch.tokens[rows, query - 1] == batch.tokens[rows, keys]).all()
    assert (batch.answers == batch.tokens[rows, values]).all()


@pytest.mark.parametrize("name,size", sorted(GRID_SIZES.items()))
def test_sweep_files_expand_to_the_study_grid(name, size):
    runs = load_sweep(CONFIGS / name)
    assert len(runs) == size
    assert len({r.name for r in runs}) == size


def test_study_ar_grid_is_the_study_recipe():
    runs = load_sweep(CONFIGS / "study_ar_d64.yaml")
    assert {r.config.total_steps for r in runs} == {50_016}
    assert {r.config.optim.lr for r in runs} == {3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2}


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_run_configs_load(name):
    config = load_run_config(CONFIGS / name)
    assert expand_sweep(config.sweep)


def test_quickstart_file_equals_the_built_in_default():
    assert load_run_config(CONFIGS / "quickstart.yaml") == load_run_config(None)


def test_findings_config_runs_the_study_settings_the_quickstart_lacks():
    runs = expand_sweep(load_run_config(CONFIGS / "findings.yaml").sweep)
    ar = {r.config.model.arch for r in runs if r.config.task.name == "ar"}
    atr = {r.config.model.arch for r in runs if r.config.task.name == "atr"}
    assert ar == {"h3", "hyena", "attention"} and atr == {"attention", "based", "mamba_noconv"}
    assert all(r.config.task.options == {} for r in runs if r.config.task.name == "ar")
    assert {r.config.total_steps for r in runs} == {50_016, 30_000}


def test_frontier_scale_runs_the_new_mixers_on_the_study_scale_recipe():
    runs = load_sweep(CONFIGS / "frontier_scale.yaml")
    study = load_sweep(CONFIGS / "study_scale.yaml")[0].config
    points = {(r.config.model.arch, r.config.optim.lr, r.config.seed) for r in runs}
    archs = ("kda", "gated_deltaproduct", "comba", "rwkv7", "mamba3")
    assert {(a, lr, 42) for a in archs for lr in (1e-3, 3e-3, 1e-2)} <= points
    for r in runs:
        c = r.config
        assert (c.task, c.total_steps, c.threads, c.model.d_model) == (
            study.task,
            study.total_steps,
            study.threads,
            study.model.d_model,
        )


def test_study_scale_runs_every_findings_models_at_the_studys_scale_on_one_thread():
    runs = load_sweep(CONFIGS / "study_scale.yaml")
    assert {r.config.threads for r in runs} == {1}
    ar = [r.config for r in runs if r.config.task.name == "ar"]
    assert all(c.task.options == {} and c.total_steps == 50_016 for c in ar)
    assert {c.model.arch for c in ar} >= {
        "attention",
        "based",
        "h3",
        "hyena",
        "mamba",
        "deltanet",
        "mamba_noconv",
    }
    atr = [r.config for r in runs if r.config.task.name == "atr"]
    assert {c.model.arch for c in atr} == {"attention", "based", "mamba_noconv"}
    assert all(c.task.options["draw"] == "study" for c in atr)
    at_length = {c.model.arch for c in atr if c.total_steps == 100_032}  # the study's 32 epochs
    assert at_length == {"attention", "based", "mamba_noconv"}
    mamba = [c for c in ar if c.model.arch == "mamba"]
    assert {c.seed for c in mamba} == {42, 43, 44} and {c.optim.lr for c in mamba} == {1e-2}
    # Every AR point over three seeds, the new mixers' low-rate points included.
    seeds = {}
    for c in ar:
        seeds.setdefault((c.model.arch, c.optim.lr), set()).add(c.seed)
    assert all(s == {42, 43, 44} for s in seeds.values())
    assert {(arch, 1e-3) for arch in ("deltanet", "gated_deltanet", "mamba2")} <= set(seeds)
    at_study_length = [c for c in atr if c.total_steps == 100_032]
    for arch in ("attention", "based", "mamba_noconv"):
        assert {c.seed for c in at_study_length if c.model.arch == arch} == {42, 43, 44}


@pytest.mark.parametrize("path", sorted((CONFIGS / "ladder").glob("*.yaml")), ids=lambda p: p.name)
def test_ladder_sweeps_load_and_run_one_thread_each(path):
    runs = load_sweep(path)
    assert runs and {r.config.threads for r in runs} == {1}


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path):
    """YAML keeps the last of two equal keys silently; mecheval's configs refuse them, as a
    second `include:` dropped a sweep's first rows."""
    from mecheval.config import ConfigError

    path = tmp_path / "twice.yaml"
    path.write_text("base: {steps: 2}\ninclude:\n  - {seed: 1}\ninclude:\n  - {seed: 2}\n")
    with pytest.raises(ConfigError, match="the key 'include' is given twice"):
        load_sweep(path)


MQAR_POINTS = {  # file -> (input length, key-value pairs, d_models)
    "mqar_64.yaml": (64, 4, {64}),
    "mqar_128.yaml": (128, 8, {64, 128}),
    "mqar_256.yaml": (256, 16, {128}),
}


def test_the_mqar_sweeps_are_zoologys_points():
    """configs/mqar/: points of zoology's Figure 2 (vocabulary 8,192), each of the eight
    architectures at its study learning rate over seeds 42 to 44 at each d_model."""
    assert {p.name for p in (CONFIGS / "mqar").glob("*.yaml")} == set(MQAR_POINTS)
    for name, (length, pairs, widths) in MQAR_POINTS.items():
        runs = load_sweep(CONFIGS / "mqar" / name)
        options = {(r.config.task.name, tuple(sorted(r.config.task.options.items()))) for r in runs}
        assert options == {("mqar", (("input_seq_len", length), ("num_kv_pairs", pairs),
                                     ("vocab_size", 8192)))}  # fmt: skip
        assert {r.config.model.d_model for r in runs} == widths
        assert len(runs) == 8 * 3 * len(widths) == len({r.name for r in runs})
        by_arch = {(r.config.model.arch, r.config.optim.lr) for r in runs}
        assert len(by_arch) == 8 and {r.config.seed for r in runs} == {42, 43, 44}
