"""Fixed datasets: equal to the seeded sample, cached atomically on disk and reused."""

import json
import os

import pytest
import torch

from mecheval.tasks import DATASET_SEED, DATASET_SIZES, make_task
from mecheval.tasks.associative_recall import AssociativeRecall
from mecheval.tasks.associative_treecall import AssociativeTreecall


def cached_files(root):
    return sorted((root / "tasks").iterdir()) if (root / "tasks").exists() else []


@pytest.mark.parametrize(
    "name, options, task_class",
    [
        ("ar", {}, AssociativeRecall),
        ("atr", {"max_rhs_len": 10, "num_terminals": 8192}, AssociativeTreecall),
    ],
)
def test_dataset_round_trips_and_is_reused(tmp_path, monkeypatch, name, options, task_class):
    task = make_task(name, **options)
    first = task.dataset("dev", size=64, cache_dir=tmp_path)
    assert first.equals(task.sample(64, DATASET_SEED, "dev"))
    (path,) = cached_files(tmp_path)
    assert task.key() in path.name and path.suffix == ".safetensors"
    stamp = path.stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("the cached dataset should have been read, not generated")

    monkeypatch.setattr(task_class, "_generate", refuse)
    again = make_task(name, **options).dataset("dev", size=64, cache_dir=tmp_path)
    assert again.equals(first) and again.tokens.dtype == torch.long
    assert path.stat().st_mtime_ns == stamp
    assert cached_files(tmp_path) == [path]  # no temporary files left behind


def test_each_split_size_and_configuration_has_its_own_file(tmp_path):
    ar = make_task("ar")
    dev = ar.dataset("dev", size=32, cache_dir=tmp_path)
    test = ar.dataset("test", size=32, cache_dir=tmp_path)
    ar.dataset("dev", size=16, cache_dir=tmp_path)
    make_task("ar", num_pairs=8).dataset("dev", size=32, cache_dir=tmp_path)
    assert len(cached_files(tmp_path)) == 4
    assert not torch.equal(dev.tokens, test.tokens)
    assert dev[:16].equals(ar.dataset("dev", size=16, cache_dir=tmp_path))


def test_default_location_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "from-env"))
    make_task("ar").dataset("test", size=8)
    assert len(cached_files(tmp_path / "from-env")) == 1
    assert DATASET_SIZES == {"train": 100_032, "dev": 320, "test": 320}


def test_a_damaged_file_is_regenerated(tmp_path):
    task = make_task("ar")
    first = task.dataset("dev", size=10, cache_dir=tmp_path)
    (path,) = cached_files(tmp_path)
    path.write_bytes(b"not a safetensors file")
    assert task.dataset("dev", size=10, cache_dir=tmp_path).equals(first)
    assert path.stat().st_size > 100


def test_write_is_atomic_on_failure(tmp_path, monkeypatch):
    import mecheval.tasks.dataset_cache as dataset_cache

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dataset_cache, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        make_task("ar").dataset("dev", size=10, cache_dir=tmp_path)
    assert cached_files(tmp_path) == []
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "tasks"))


def test_files_store_documents_packed_in_a_small_dtype(tmp_path):
    from safetensors import safe_open

    task = make_task("atr", max_rhs_len=10, num_terminals=20)
    batch = task.dataset("train", size=500, cache_dir=tmp_path)
    (path,) = cached_files(tmp_path)
    with safe_open(path, framework="pt") as handle:
        packed = handle.get_tensor("packed_tokens")
        assert json.loads(handle.metadata()["config"]) == task.config()
    assert packed.dtype == torch.int16 and packed.numel() == int(batch.lengths.sum())
    inside = torch.arange(batch.width) < batch.lengths[:, None]
    assert torch.equal(packed.long(), batch.tokens[inside])
