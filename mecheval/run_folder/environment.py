"""What a run's result depends on beyond its config, recorded in its result.json: the code
(mecheval's version and, in a git checkout, its commit), PyTorch's version and CPU threads, and
the machine's kind (its CPU model, or GPU name). Same config and same environment: the same
weights, bit for bit (docs/reproduction.md, "Same config, same result")."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

import torch

import mecheval


def environment(device: torch.device | None = None) -> dict[str, object]:
    """The environment of a run on `device` (CPU when None), as result.json records it."""
    on_gpu = device is not None and device.type == "cuda"
    return {
        "mecheval": mecheval.__version__,
        "commit": _commit(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": torch.cuda.get_device_name(device) if on_gpu else _cpu_model(),
    }


@functools.cache
def _commit() -> str | None:
    """The git commit of mecheval's source checkout (with `+dirty` when it has changes), or None
    outside one."""
    source = Path(mecheval.__file__).resolve().parent.parent
    try:
        run = functools.partial(
            subprocess.run, cwd=source, capture_output=True, text=True, timeout=10, check=True
        )
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
