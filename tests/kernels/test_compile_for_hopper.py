"""Every Triton kernel compiles for Hopper (sm_90) to a cubin, within one block's shared
memory, with no GPU: what the interpreter cannot check (see kernels/compile_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "op",
    [
        "short_conv",
        "selective_scan",
        "delta_rule",
        "gated_delta_rule",
        "kda",
        "comba",
        "dplr_delta_rule",
        "mamba3",
    ],
)
def test_kernels_compile_for_hopper(op):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "mecheval_kernels.compile_check", "--ops", op],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "regs=" in done.stdout and "FAILED" not in done.stdout
