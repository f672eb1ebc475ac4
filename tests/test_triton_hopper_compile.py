"""The fused selected + window kernels compile for Hopper (sm_90) without a GPU (tests/hopper_compile.py): the
Triton interpreter, which the other CPU tests run them under, accepts code that Triton's compiler rejects."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend compiles the kernels")

REPO = Path(__file__).resolve().parents[1]


def test_fused_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JIT functions, not the interpreter's
    done = subprocess.run([sys.executable, "tests/hopper_compile.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("all compiled")
