"""The Gluon kernels (`gluon_selected.py`, `gluon_selected_window.py`) compile for Hopper (sm_90) with the installed
Triton, without a GPU (tests/gluon_compile.py --quick: each kernel once, at nsa-125m's heads and its default
launch). They run only on a Hopper GPU (tests/test_gluon_selected*.py), and Gluon's API moves between Triton
releases (3.6's `async_copy_global_to_shared` and `thread_barrier` are gone by 3.9): this is where a release that
breaks them shows on a CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend compiles the kernels")

REPO = Path(__file__).resolve().parents[1]
KERNELS = 8  # forward item, dK/dV item; the sweep's forward, dQ, dK/dV; the window's forward, dQ, dK/dV


def test_gluon_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JIT functions, not the interpreter's
    # A cache of its own: Triton's cache key of a kernel does not cover the builtins its module-level names hold,
    # so a cached build would hide a change of them.
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "tests/gluon_compile.py", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if "wgmma.mma_async" in line]
    assert len(compiled) == KERNELS, done.stdout[-4000:]
