"""Stacked training: models trained as one stack equal the same models trained alone; a
stacked run writes the folders single runs write, resumes bitwise, and isolates a diverging
run."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mecheval.config import ConfigError
from mecheval.models import ARCHITECTURES, build_model
from mecheval.run_folder.files import RESULT, read_result
from mecheval.tasks import make_task
from mecheval.train import loop
from mecheval.train.config import load_train_config
from mecheval.train.loop import stack_key, train, train_stacked
from mecheval.train.stacked import StackedAdamW, StackedModels
from tests import helpers

# Learning rates at which these tiny models train smoothly: at 3e-3 DeltaNet's training itself
# turns a 1e-7 change of its initial weights into a 3e-3 change after 100 steps, and no
# implementation can be closer to another than that.
LRS = (1e-4, 3e-4, 1e-3)
TINY = [
    *helpers.TINY,
    "arch=mamba",
    "steps=40",
    "eval_every=20",
    "checkpoint_every=20",
    "log_every=10",
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stacked_models_equal_models_trained_alone(arch):
    """100 AdamW steps on AR batches: every stacked model's weights equal the same model
    trained alone with torch.optim.AdamW, to 1e-4 relative (fp32, CPU): the whole weight
    vector's difference over its norm (each tensor to 1e-3: a bias that starts at zero is
    small, its relative error large)."""
    task = make_task("ar", num_pairs=4, num_keys=16)
    data = task.sample(100 * 8, seed=0)
    models = []
    for seed in range(len(LRS)):
        torch.manual_seed(seed)
        models.append(build_model(arch, task.vocab_size, 8, 2, max_len=task.max_document_length))
    alone = [copy.deepcopy(m) for m in models]
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1)
        for m, lr in zip(alone, LRS, strict=True)
    ]
    stack = StackedModels(models)
    stacked_optimizer = StackedAdamW(stack.params, (0.9, 0.999), 1e-8, [0.1] * len(LRS))
    for step in range(100):
        batch = data[step * 8 : (step + 1) * 8].trim()
        tokens, query, answers = batch.tokens, batch.positions["query"], batch.answers
        for model, optimizer in zip(alone, optimizers, strict=True):
            optimizer.zero_grad()
            F.cross_entropy(model(tokens, at=query), answers).backward()
            optimizer.step()
        stacked_optimizer.zero_grad()
        logits = stack(tokens, query)
        sum(F.cross_entropy(logits[k], answers) for k in range(len(LRS))).backward()
        stacked_optimizer.step(list(LRS))
    for k, model in enumerate(alone):
        ours = {name: stack.params[name][k].detach() for name, _ in model.named_parameters()}
        theirs = dict(model.named_parameters())
        for name, p in theirs.items():
            error = _relative_error(ours[name], p.detach())
            assert error < 1e-3, f"{arch} model {k} {name}: {error:.2e}"
        whole = _relative_error(
            torch.cat([t.flatten() for t in ours.values()]),
            torch.cat([p.detach().flatten() for p in theirs.values()]),
        )
        assert whole < 1e-4, f"{arch} model {k}: {whole:.2e}"


def test_stacked_adamw_state_round_trips_through_torch_adamw():
    """A model's moments and step go out in torch.optim.AdamW's state_dict form (what the
    checkpoints hold) and come back unchanged."""
    torch.manual_seed(0)
    models = [build_model("attention", 20, 8, 1, max_len=6) for _ in range(2)]
    stack = StackedModels(models)
    optimizer = StackedAdamW(stack.params, (0.9, 0.999), 1e-8, [0.0, 0.1])
    for p in stack.params.values():
        p.grad = torch.randn_like(p)
    optimizer.step([1e-3, 2e-3])
    names = [n for n, _ in models[0].named_parameters()]
    reference = torch.optim.AdamW(models[1].parameters())
    state = {
        "state": optimizer.state_of(1, names),
        "param_groups": reference.state_dict()["param_groups"],
    }
    reference.load_state_dict(state)
    other = StackedAdamW(stack.params, (0.9, 0.999), 1e-8, [0.0, 0.1])
    other.load_state_of(0, names, reference.state_dict()["state"])
    assert other.step_count == 1
    for n in names:
        torch.testing.assert_close(other.exp_avg[n][0], optimizer.exp_avg[n][1], rtol=0, atol=0)


def _configs(*extra: str):
    return [
        load_train_config(None, [*TINY, f"lr={lr}", f"seed={seed}", *extra])
        for seed, lr in enumerate(LRS)
    ]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def test_a_stack_writes_what_single_runs_write_and_equals_them(tmp_path):
    configs = _configs()
    stacked = train_stacked(configs, [tmp_path / f"s{i}" for i in range(3)])
    for i, config in enumerate(configs):
        run = tmp_path / f"s{i}"
        alone = train(config, tmp_path / f"a{i}")
        assert read_result(run) == stacked[i]
        assert stacked[i]["stack_size"] == 3 and stacked[i]["steps"] == 40
        assert {p.name for p in run.iterdir()} >= {
            "config.yaml",
            "metrics.jsonl",
            "metrics.parquet",
            "checkpoints",
            RESULT,
        }
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [10, 20, 30, 40]
        assert records[-1]["lr"] == 0.0 or records[-1]["lr"] < config.optim.lr
        ours, theirs = _weights(run), _weights(tmp_path / f"a{i}")
        for name in theirs:
            assert _relative_error(ours[name], theirs[name]) < 1e-4, name
        assert abs(stacked[i]["dev_accuracy"] - alone["dev_accuracy"]) <= 1 / 32
        # A stacked run's folder is a run folder: train on it returns its result.
        assert train(config, run) == stacked[i]


def _killed_at(monkeypatch, step_to_die: int):
    """Make the stack's loop die (as a kill would) when it reaches `step_to_die`."""
    original = loop._Loop._step

    def step(self, batch, lrs, step):
        if step == step_to_die:
            raise KeyboardInterrupt("killed")
        return original(self, batch, lrs, step)

    monkeypatch.setattr(loop._Loop, "_step", step)


@pytest.mark.parametrize("lost", ["nothing", "one run's checkpoint"])
def test_a_killed_stack_resumes_bitwise(tmp_path, monkeypatch, lost):
    configs = _configs()
    whole = [tmp_path / f"whole{i}" for i in range(3)]
    train_stacked(configs, whole)
    cut = [tmp_path / f"cut{i}" for i in range(3)]
    with monkeypatch.context() as patch:
        _killed_at(patch, 30)
        with pytest.raises(KeyboardInterrupt):
            train_stacked(configs, cut)
    for run in cut:
        assert not (run / RESULT).exists()
        assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000000020"]
    if lost != "nothing":  # the stack then restarts every run from scratch
        shutil.rmtree(cut[1] / "checkpoints" / "step_000000020")
    train_stacked(configs, cut)
    for a, b in zip(whole, cut, strict=True):
        ours, theirs = _weights(b), _weights(a)
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
        lines = (b / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [10, 20, 30, 40]


def test_a_diverging_run_fails_alone(tmp_path):
    configs = _configs()
    configs[1] = configs[1].replace(
        optim=configs[1].optim.__class__(**{**configs[1].optim.__dict__, "lr": 1e30})
    )
    outcomes = train_stacked(configs, [tmp_path / f"r{i}" for i in range(3)])
    assert isinstance(outcomes[1], Exception) and "non-finite" in str(outcomes[1])
    assert not (tmp_path / "r1" / RESULT).exists()
    for i in (0, 2):
        assert outcomes[i]["steps"] == 40 and (tmp_path / f"r{i}" / RESULT).exists()


def test_runs_of_other_shapes_do_not_stack(tmp_path):
    configs = _configs()
    other = load_train_config(None, [*TINY, "d_model=8"])
    assert stack_key(configs[0]) == stack_key(configs[2]) != stack_key(other)
    with pytest.raises(ConfigError, match="do not stack"):
        train_stacked([configs[0], other], [tmp_path / "a", tmp_path / "b"])


def test_a_compiled_stack_trains_as_the_eager_one(tmp_path):
    """compile=true compiles the stack's forward and backward (on a GPU as CUDA graphs)."""
    configs = [c.replace(steps=6, eval_every=0, checkpoint_every=0) for c in _configs()[:2]]
    train_stacked(configs, [tmp_path / f"e{i}" for i in range(2)])
    compiled = [c.replace(compile=True) for c in configs]
    ours = train_stacked(compiled, [tmp_path / f"c{i}" for i in range(2)])
    for i in range(2):
        assert ours[i]["steps"] == 6
        a, b = _weights(tmp_path / f"e{i}"), _weights(tmp_path / f"c{i}")
        for name in a:
            assert _relative_error(b[name], a[name]) < 1e-5, name


def test_a_stack_step_is_timed_for_sweep_estimates():
    from mecheval.train.timing import measure_stacked_step_time

    seconds = measure_stacked_step_time(_configs()[:2], steps=2, warmup=1)
    assert 0 < seconds < 60
