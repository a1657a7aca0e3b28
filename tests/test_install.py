"""mecheval installs beside Hugging Face's `kernels` (which transformers 5.25 and later require):
the kernel library imports as `mecheval_kernels`, and the checkout's `kernels/` folder, found by
its name when the checkout's root is on sys.path, hands the name `kernels` back."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]

BOTH = """
import importlib.metadata, kernels, mecheval_kernels, mecheval.models, transformers
assert hasattr(kernels, "get_kernel"), kernels.__file__  # Hugging Face's
assert mecheval_kernels.causal_conv1d_fn is not None
print(transformers.__version__, importlib.metadata.version("kernels"))
print(kernels.__file__)
print(mecheval_kernels.__file__)
"""


def _hugging_face_kernels() -> str:
    try:
        return importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25)")


def _python(code: str, cwd: Path, **env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


@pytest.mark.slow
def test_an_installed_mecheval_imports_beside_hugging_face_kernels(tmp_path):
    _hugging_face_kernels()
    site, source = tmp_path / "site", tmp_path / "source"  # pip builds inside its source
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    for name in tracked.stdout.splitlines():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*install, "--target", str(site), str(source)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (site / "mecheval_kernels" / "short_conv" / "op.py").is_file()
    assert not (site / "kernels").exists()
    versions, theirs, ours = _python(BOTH, tmp_path, PYTHONPATH=str(site))
    assert "site-packages" in theirs and ours.startswith(str(site)), (theirs, ours)
    assert Version(versions.split()[0]) >= Version("5.25")


def test_the_checkout_hands_the_name_kernels_back():
    _hugging_face_kernels()
    _, theirs, ours = _python(BOTH, REPO)
    assert ours == str(REPO / "kernels" / "__init__.py")
    assert theirs != str(REPO / "kernels" / "__init__.py")
