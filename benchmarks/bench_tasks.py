"""Task generation speed: the study's 100,032-document training set of AR and of each ATR
setting, generated from scratch (no cache).

Run: pytest benchmarks/bench_tasks.py --benchmark-only -s
Targets (issue 5, on a 2-core CPU machine): AR under 2 s; ATR under 60 s per setting.
Each figure lands in `benchmark.extra_info` (documents, seconds, documents per second, the
longest document) and is printed.
"""

from __future__ import annotations

import pytest

from mecheval.tasks import DATASET_SIZES, make_task

NUM_DOCUMENTS = DATASET_SIZES["train"]
SETTINGS = {
    "ar": ("ar", {}, 2.0),
    "ar holdout 0.2 (test split)": ("ar", {"holdout": 0.2}, 2.0),
    "atr (5, 20)": ("atr", {"max_rhs_len": 5, "num_terminals": 20}, 60.0),
    "atr (10, 20)": ("atr", {"max_rhs_len": 10, "num_terminals": 20}, 60.0),
    "atr (5, 8192) r=20": ("atr", {"max_rhs_len": 5, "num_terminals": 8192}, 60.0),
    "atr (10, 8192) r=20": ("atr", {"max_rhs_len": 10, "num_terminals": 8192}, 60.0),
    "atr (5, 20) holdout 0.2 (test split)": (
        "atr",
        {"max_rhs_len": 5, "num_terminals": 20, "holdout": 0.2},
        60.0,
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generate_training_set(benchmark, capsys, setting):
    name, options, target_s = SETTINGS[setting]
    task = make_task(name, **options)
    split = "test" if options.get("holdout") else "train"
    rounds = 3 if name == "ar" else 1
    batch = benchmark.pedantic(
        task.sample, args=(NUM_DOCUMENTS, 0, split), rounds=rounds, iterations=1
    )
    assert len(batch) == NUM_DOCUMENTS
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        documents=NUM_DOCUMENTS,
        seconds=round(seconds, 3),
        documents_per_s=round(NUM_DOCUMENTS / seconds),
        longest_document=int(batch.lengths.max()),
        mean_document=round(float(batch.lengths.double().mean()), 1),
        target_s=target_s,
    )
    with capsys.disabled():
        print(
            f"\n{setting}: {NUM_DOCUMENTS} documents in {seconds:.2f} s (target < {target_s:g} s),"
            f" mean length {float(batch.lengths.double().mean()):.1f},"
            f" longest {int(batch.lengths.max())}"
        )


@pytest.mark.parametrize("setting", ["ar", "atr (10, 20)"])
def test_reload_cached_training_set(benchmark, capsys, tmp_path, setting):
    """Reading the cached 100,032-document set back (what every run after the first does)."""
    name, options, _ = SETTINGS[setting]
    task = make_task(name, **options)
    first = task.dataset("train", cache_dir=tmp_path)
    (path,) = (tmp_path / "tasks").iterdir()
    again = benchmark.pedantic(
        task.dataset, args=("train",), kwargs={"cache_dir": tmp_path}, rounds=3, iterations=1
    )
    assert again.equals(first)
    seconds = benchmark.stats.stats.median
    megabytes = path.stat().st_size / 1e6
    benchmark.extra_info.update(seconds=round(seconds, 3), file_MB=round(megabytes, 1))
    with capsys.disabled():
        print(f"\n{setting}: cached training set ({megabytes:.1f} MB) reloads in {seconds:.2f} s")
