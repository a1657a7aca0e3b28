"""Training runs: loss masking, resume after SIGKILL bitwise-exact, finished runs are no-ops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mecheval.config import ConfigError
from mecheval.models import build_model
from mecheval.tasks import Batch
from mecheval.train.config import load_train_config
from mecheval.train.loop import train
from mecheval.train.steps import answer_logits, loss_logits

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "task.options.num_pairs=4",
    "task.options.num_keys=16",
    "task.train_size=640",
    "task.eval_size=32",
    "d_model=16",
    "arch=mamba",
    "progress=false",
    # The tests set TRITON_INTERPRET=1 (for the kernel tests), under which "auto" would pick
    # the Triton interpreter, also in child processes: far too slow for training.
    "backend=torch",
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def test_loss_looks_only_at_the_answer_position():
    """The training loss equals a full-sequence cross-entropy whose labels are ignored
    everywhere but the query position (the study's masking)."""
    torch.manual_seed(0)
    model = build_model("attention", vocab_size=30, d_model=16, max_len=10)
    tokens = torch.randint(3, 30, (4, 10))
    query = torch.tensor([7, 7, 3, 9])
    answers = torch.randint(3, 30, (4,))
    batch = Batch(tokens, answers, {"query": query}, torch.full((4,), 10))
    ours = F.cross_entropy(answer_logits(model, batch), answers)
    labels = torch.full((4, 10), -100)
    labels[torch.arange(4), query] = answers
    masked = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(ours, masked)


def test_a_document_of_several_answers_runs_once_and_trains_on_each():
    """Rows of one document (MQAR's queries) share one forward; each row's logits are those
    at its query; with `targets`, the loss takes every target token of each document once."""
    torch.manual_seed(0)
    model = build_model("attention", vocab_size=30, d_model=16, max_len=10)
    docs = torch.randint(3, 30, (2, 10))
    document = torch.tensor([0, 0, 0, 1])
    query = torch.tensor([2, 5, 9, 4])
    answers = torch.randint(3, 30, (4,))
    batch = Batch(docs[document], answers, {"query": query}, torch.full((4,), 10), document)
    full = model(docs)
    torch.testing.assert_close(answer_logits(model, batch), full[document, query])
    targets = torch.full((4, 10), -100)
    targets[:3, 4], targets[3, [1, 7]] = 11, torch.tensor([12, 13])
    with_targets = Batch(docs[document], answers, {"query": query}, torch.full((4,), 10),
                         document, targets=targets)  # fmt: skip
    logits, wanted = loss_logits(model, with_targets)
    torch.testing.assert_close(logits, full[[0, 1, 1], [4, 1, 7]])
    assert wanted.tolist() == [11, 12, 13]


def test_resume_after_sigkill_is_bitwise_identical(tmp_path):
    overrides = [*TINY, "steps=400", "checkpoint_every=10", "eval_every=100", "log_every=5"]
    config = load_train_config(None, overrides)
    whole = tmp_path / "whole"
    train(config, whole)

    killed = tmp_path / "killed"
    script = (
        # Same thread count as this process: float sums are bitwise reproducible only then.
        f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
        "from mecheval.train.config import load_train_config; "
        "from mecheval.train.loop import train; "
        f"train(load_train_config(None, {overrides!r}), {str(killed)!r})"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.time() + 120
    # Kill it once it has written a checkpoint past the first, mid-run.
    while time.time() < deadline:
        latest = killed / "checkpoints" / "latest"
        if latest.exists() and latest.read_text().strip() >= "step_000000030":
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "result.json").exists(), "the run finished before it was killed"

    result = train(config, killed)  # the same call resumes
    assert result["steps"] == 400
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [
        json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(set(steps)) == list(range(5, 401, 5))  # none lost, none duplicated


def test_finished_run_is_a_no_op(tmp_path):
    config = load_train_config(None, [*TINY, "steps=10", "eval_every=0", "checkpoint_every=0"])
    first = train(config, tmp_path)
    stamp = (tmp_path / "result.json").stat().st_mtime_ns
    assert train(config, tmp_path) == first
    assert (tmp_path / "result.json").stat().st_mtime_ns == stamp


def test_a_folder_holding_another_config_is_refused(tmp_path):
    train(load_train_config(None, [*TINY, "steps=4"]), tmp_path / "run")
    (tmp_path / "run" / "result.json").unlink()
    with pytest.raises(ConfigError, match="different config"):
        train(load_train_config(None, [*TINY, "steps=5"]), tmp_path / "run")


def test_cli_train_writes_the_run_folder(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "mecheval.cli",
        "train",
        "--out",
        str(out),
        *TINY,
        "steps=6",
        "lr=3e-3",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "dev accuracy" in done.stdout
    saved = (out / "config.yaml").read_text()
    assert "lr: 0.003" in saved and "arch: mamba" in saved
    assert (out / "metrics.parquet").exists() and (out / "result.json").exists()
    bad = subprocess.run(
        [*cmd[:-1], "optim.lrr=3"], env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "optim.lrr" in bad.stderr


def test_training_restores_the_kernel_backend(tmp_path):
    """A run sets the kernel backend of its config for its own duration only."""
    import mecheval_kernels

    with mecheval_kernels.use_backend("auto"):
        train(load_train_config(None, [*TINY, "steps=2"]), tmp_path)
        assert mecheval_kernels.get_backend() == "auto"


def test_accuracy_keeps_the_models_mode():
    from mecheval.tasks import make_task
    from mecheval.train.steps import accuracy

    config = load_train_config(None, TINY)
    task = make_task("ar", num_pairs=4, num_keys=16)
    model = build_model("attention", task.vocab_size, d_model=16, max_len=task.max_document_length)
    data = task.sample(8, seed=0)
    for mode in (False, True):
        model.train(mode)
        accuracy(model, data, config, torch.device("cpu"))
        assert model.training is mode


def test_step_time_is_measured_with_the_runs_optimizer(monkeypatch):
    """measure_step_time times the training step itself, with the run's AdamW settings."""
    from mecheval.train import steps, timing

    seen = []
    real = steps.ModelStep.__call__

    def spy(step, *args, **kwargs):
        seen.append(step.optimizer.param_groups[0])
        return real(step, *args, **kwargs)

    monkeypatch.setattr(steps.ModelStep, "__call__", spy)
    config = load_train_config(None, [*TINY, "optim.weight_decay=0.5", "optim.eps=1e-6"])
    assert timing.measure_step_time(config, steps=1, warmup=0) > 0
    group = seen[0]
    assert group["weight_decay"] == 0.5 and group["eps"] == 1e-6
    assert tuple(group["betas"]) == tuple(config.optim.betas)


def test_same_config_same_threads_same_weights(tmp_path):
    """Two runs of one config with its threads set give the same weights, bit for bit, and
    record the environment they ran in (each in its own process: the thread count is
    process-wide)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for name in ("a", "b"):
        cmd = [sys.executable, "-m", "mecheval.cli", "train", "--out", str(tmp_path / name)]
        done = subprocess.run(
            [*cmd, *TINY, "steps=8", "threads=1"], env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recorded = json.loads((tmp_path / "a" / "result.json").read_text())["environment"]
    assert recorded["torch_threads"] == 1 and recorded["torch"] == torch.__version__
    assert recorded["machine"] and recorded["mecheval"]
