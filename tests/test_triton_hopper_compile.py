"""Every NSA Triton kernel compiles for Hopper (sm_90) without a GPU, with the arguments its host code launches it
with (tests/hopper_compile.py): the Triton interpreter, which the other CPU tests run them under, accepts code that
Triton's compiler rejects."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend compiles the kernels")

REPO = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JIT functions, not the interpreter's
    done = subprocess.run([sys.executable, "tests/hopper_compile.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().startswith("all compiled"), done.stdout[-4000:]
    assert " of 13 kernels: " in done.stdout  # every kernel of the four modules was launched and compiled
