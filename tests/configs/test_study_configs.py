"""The study's experiment grids (configs/study/, one file per folder of the study's
experiments/configs): run counts, architectures, widths, learning rates, run length, schedule,
position embeddings, layers and task options, as the study's make_sweep.py scripts and run files
set them (docs/study.md)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mecheval.models import model_config
from mecheval.sweep import load_sweep
from mecheval.tasks import make_task

STUDY = Path(__file__).resolve().parents[2] / "configs" / "study"

SIX = {"attention", "base_conv", "based", "h3", "hyena", "mamba"}
FIVE = SIX - {"h3"}  # the grids that leave H3 out
WIDTHS = {16, 32, 64, 128, 256}
LRS = {3e-5, 1e-4, 3e-4, 1e-3, 3e-3}
MORE_LRS = {1e-2, 3e-2}
AR_STEPS = 16 * 3126  # 16 epochs over 100,032 documents, batch 32
ATR_STEPS = 32 * 3126
EASY = {"max_rhs_len": 5, "num_terminals": 20}
MEDIUM = {"max_rhs_len": 10, "num_terminals": 20}
STUDY_DRAW = {"seed": 42, "draw": "study"}  # the study's grammar and documents
GEN = {**EASY, "holdout": 0.2}
SIBLING = {**EASY, "query": "sibling"}
EASY_8192 = {**EASY, "num_terminals": 8192, "terminal_factor": 20, **STUDY_DRAW}
MEDIUM_8192 = {**MEDIUM, "num_terminals": 8192, "terminal_factor": 20, **STUDY_DRAW}
EASY = {**EASY, **STUDY_DRAW}
MEDIUM = {**MEDIUM, **STUDY_DRAW, "draw": "study_after_easy"}  # drawn after the (5, 20) one

# file -> (runs, architectures, widths, learning rates, layers, steps, schedule,
#          position embeddings: "all" | "none" | "attention", task name, task options)
GRIDS = {
    "ar_32": (150, SIX, WIDTHS, LRS, 2, AR_STEPS, "cosine", "all", "ar", {}),
    "ar_32_nope": (150, SIX, WIDTHS, LRS, 2, AR_STEPS, "cosine", "none", "ar", {}),
    "ar_32_more_lr": (60, SIX, WIDTHS, MORE_LRS, 2, AR_STEPS, "cosine", "none", "ar", {}),
    "ar_32_1L": (210, SIX, WIDTHS, LRS | MORE_LRS, 1, AR_STEPS, "cosine", "attention", "ar", {}),
    "ar_32_3L": (210, SIX, WIDTHS, LRS | MORE_LRS, 3, AR_STEPS, "cosine", "attention", "ar", {}),
    "ar_32_mamba_ablation": (
        140,
        {"mamba", "mamba_noconv"},
        WIDTHS,
        LRS | MORE_LRS,
        2,
        AR_STEPS,
        "cosine",
        "none",
        "ar",
        {},
    ),
    "ar_32_based_ablation": (
        50,
        {"based_long", "base_conv_long"},
        WIDTHS,
        LRS,
        2,
        AR_STEPS,
        "cosine",
        "none",
        "ar",
        {},
    ),
    "ar_32_based_ablation2": (75, {"based"}, WIDTHS, LRS, 2, AR_STEPS, "cosine", "none", "ar", {}),
    "ar_32_delta_net": (25, {"deltanet"}, WIDTHS, LRS, 2, AR_STEPS, "cosine", "all", "ar", {}),
    "ar_32_value": (
        75,
        FIVE,
        {16, 32, 64},
        LRS,
        2,
        ATR_STEPS,
        "cosine",
        "attention",
        "ar",
        {"query": "value", "query_ids": "swapped"},
    ),
    "ar_32_reverse": (
        210,
        SIX,
        WIDTHS,
        LRS | MORE_LRS,
        3,
        AR_STEPS,
        "cosine",
        "attention",
        "ar",
        {"query": "value"},
    ),
    "ar_gen": (
        210,
        SIX,
        WIDTHS,
        LRS | MORE_LRS,
        2,
        ATR_STEPS,
        "linear",
        "attention",
        "ar",
        {"holdout": 0.2},
    ),
    "ar_gen_delta_net": (
        35,
        {"deltanet"},
        WIDTHS,
        LRS | MORE_LRS,
        2,
        ATR_STEPS,
        "linear",
        "attention",
        "ar",
        {"holdout": 0.2},
    ),
    "pcfg_easy": (150, SIX, WIDTHS, LRS, 2, ATR_STEPS, "cosine", "all", "atr", EASY),
    "pcfg_easy_nope": (150, SIX, WIDTHS, LRS, 2, ATR_STEPS, "cosine", "none", "atr", EASY),
    "pcfg_easy_1L": (150, SIX, WIDTHS, LRS, 1, ATR_STEPS, "cosine", "attention", "atr", EASY),
    "pcfg_easy_8192": (
        150,
        SIX,
        WIDTHS,
        LRS,
        2,
        ATR_STEPS,
        "cosine",
        "attention",
        "atr",
        EASY_8192,
    ),
    "pcfg_easy_8192_delta_net": (
        25,
        {"deltanet"},
        WIDTHS,
        LRS,
        2,
        ATR_STEPS,
        "cosine",
        "attention",
        "atr",
        EASY_8192,
    ),
    "pcfg_easy_mamba_ablation": (
        140,
        {"mamba", "mamba_noconv"},
        WIDTHS,
        LRS | MORE_LRS,
        2,
        ATR_STEPS,
        "cosine",
        "none",
        "atr",
        EASY,
    ),
    "pcfg_medium": (150, SIX, WIDTHS, LRS, 2, ATR_STEPS, "cosine", "all", "atr", MEDIUM),
    "pcfg_medium_nope": (125, FIVE, WIDTHS, LRS, 2, ATR_STEPS, "cosine", "none", "atr", MEDIUM),
    "pcfg_medium_nope_delta_net": (
        25,
        {"deltanet"},
        WIDTHS,
        LRS,
        2,
        ATR_STEPS,
        "cosine",
        "none",
        "atr",
        MEDIUM,
    ),
    "pcfg_medium_8192": (
        75,
        FIVE,
        {16, 32, 64},
        LRS,
        2,
        ATR_STEPS,
        "cosine",
        "attention",
        "atr",
        MEDIUM_8192,
    ),
    "pcfg_gen": (150, SIX, WIDTHS, LRS, 2, ATR_STEPS, "linear", "attention", "atr", GEN),
    "pcfg_gen_1L": (150, SIX, WIDTHS, LRS, 1, ATR_STEPS, "linear", "attention", "atr", GEN),
    "pcfg_gen_3L": (150, SIX, WIDTHS, LRS, 3, ATR_STEPS, "linear", "attention", "atr", GEN),
    "sibling": (150, SIX, WIDTHS, LRS, 2, ATR_STEPS, "linear", "attention", "atr", SIBLING),
    "sibling_1L": (150, SIX, WIDTHS, LRS, 1, ATR_STEPS, "linear", "attention", "atr", SIBLING),
    "sibling_3L": (150, SIX, WIDTHS, LRS, 3, ATR_STEPS, "linear", "attention", "atr", SIBLING),
}


def position_embeddings(config) -> bool:
    """Whether the run's model has position embeddings (the option, else mecheval's default)."""
    model = config.model
    resolved = model_config(model.arch, 50, model.d_model, max_len=8, **model.options)
    return resolved.uses_position_embeddings


@pytest.fixture(scope="module")
def sweeps():
    return {path.stem: load_sweep(path) for path in sorted(STUDY.glob("*.yaml"))}


def test_every_study_file_is_covered(sweeps):
    assert set(sweeps) == set(GRIDS)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_grid_is_the_studys(name, sweeps):
    size, archs, widths, lrs, layers, steps, schedule, pe, task, options = GRIDS[name]
    runs = [run.config for run in sweeps[name]]
    assert len(runs) == size == len({run.name for run in sweeps[name]})
    assert {c.model.arch for c in runs} == archs
    assert {c.model.d_model for c in runs} == widths
    assert {c.optim.lr for c in runs} == lrs
    assert {c.model.n_layers for c in runs} == {layers}
    assert {c.total_steps for c in runs} == {steps}
    assert {c.optim.schedule for c in runs} == {schedule}
    assert {(c.batch_size, c.task.train_size, c.task.eval_size, c.seed) for c in runs} == {
        (32, 100_032, 320, 42)
    }
    assert {c.optim.warmup_fraction for c in runs} == {0.1}
    assert {c.optim.weight_decay for c in runs} == {0.0}
    assert {(c.task.name, tuple(sorted(c.task.options.items()))) for c in runs} == {
        (task, tuple(sorted(options.items())))
    }
    # A full product: every model variant (architecture and options) at every width and rate.
    variants = {(c.model.arch, tuple(sorted(c.model.options.items()))) for c in runs}
    cells = {(v, d, lr) for v in variants for d in widths for lr in lrs}
    assert cells == {
        ((c.model.arch, tuple(sorted(c.model.options.items()))), c.model.d_model, c.optim.lr)
        for c in runs
    }
    assert len(cells) == size
    for c in runs:
        expected = {"all": True, "none": False, "attention": c.model.arch == "attention"}[pe]
        assert position_embeddings(c) is expected, (name, c.model)


def test_mamba_ablation_widths(sweeps):
    for name in ("ar_32_mamba_ablation", "pcfg_easy_mamba_ablation"):
        variants = Counter(
            (c.config.model.arch, c.config.model.options.get("d_conv")) for c in sweeps[name]
        )
        expected = [("mamba_noconv", None), ("mamba", 1), ("mamba", 2), ("mamba", 3)]
        assert variants == dict.fromkeys(expected, 35)


def test_based_ablation_widths(sweeps):
    widths = Counter(c.config.model.options["d_conv"] for c in sweeps["ar_32_based_ablation2"])
    assert widths == {1: 25, 2: 25, 4: 25}


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_every_model_setting_fits_its_task(name, sweeps):
    """Each distinct model setting is a valid ModelConfig for its task's vocabulary and longest
    document, as training sizes it."""
    seen = set()
    for run in sweeps[name]:
        c = run.config
        setting = (c.model.arch, c.model.n_layers, tuple(sorted(c.model.options.items())))
        if setting in seen:
            continue
        seen.add(setting)
        task = make_task(c.task.name, **c.task.options)
        model_config(
            c.model.arch,
            task.vocab_size,
            16,
            c.model.n_layers,
            max_len=task.max_document_length,
            **c.model.options,
        )
