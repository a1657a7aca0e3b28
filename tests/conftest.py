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
