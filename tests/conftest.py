"""Test-session setup shared by every test.

Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors; the interpreter
must be switched on before triton is first imported, so this happens here, at collection.
Model-level tests then default to the PyTorch path (the interpreter is slow); kernel tests
ask for backend="triton" explicitly.
"""

import os
import tempfile

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile tests get a fresh cache per process: pytest-xdist workers compiling into one
# shared cache at once failed intermittently, and entries left by an older version of a custom
# op (another output layout) break its compile.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mecheval-inductor-")

import pytest  # noqa: E402

import mecheval_kernels  # noqa: E402

if not HAS_CUDA:
    mecheval_kernels.set_backend("torch")

# Test tensors are small: one thread per process is faster than two contending threads, and
# pytest-xdist (`-n auto`) spreads the tests over the cores instead.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _cache(request, monkeypatch):
    """Each reliability test's task datasets in its own cache, never the user's (tests/evaluation
    and tests/run_folder do this for all their tests in their conftest.py)."""
    if request.node.get_closest_marker("reliability") is not None:
        tmp_path = request.getfixturevalue("tmp_path")
        monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


# The pipeline tests' trained model: 4-pair AR over 16 keys, 2,400 steps, every 600-step
# checkpoint kept (for the read-outs over training).
TRAINED = [
    "task.options.num_pairs=4",
    "task.options.num_keys=16",
    "task.train_size=64000",
    "task.eval_size=128",
    "arch=attention",
    "d_model=64",
    "model.options.init=pytorch",
    "steps=2400",
    "seed=0",
    "lr=1e-3",
    "eval_every=600",
    "checkpoint_every=600",
    "keep_checkpoints=4",
    "progress=false",
    "backend=torch",
]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A small attention model trained once per session (it solves its AR by induction): its
    run folder and its result."""
    from mecheval.train.config import load_train_config
    from mecheval.train.loop import train

    root = tmp_path_factory.mktemp("trained")
    os.environ["MECHEVAL_CACHE"] = str(root / "cache")
    run = root / "attention"
    result = train(load_train_config(None, TRAINED), run)
    return run, result


@pytest.fixture
def device() -> torch.device:
    """The device Triton kernels run on in this session: CUDA, else CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
