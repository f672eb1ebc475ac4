"""Test-wide settings: offline datasets, one inductor cache for the whole run, GPU tests skipped without CUDA and
handing their cached GPU memory back when done."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Compiled blocks are shared across tests (and subprocesses): a warm cache turns ~10 s compiles into ~1.5 s.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".inductor_cache"))
# Without a GPU, Triton kernels run in its interpreter; the flag must be set before triton is first imported.
_GPUS = sorted((p.name.removeprefix("nvidia") for p in Path("/dev").glob("nvidia[0-9]*")), key=int)
if not _GPUS:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each worker takes one GPU in turn (gw0 -> the first, gw1 -> the second, ...), so `-n 4` on a
# 4-GPU host spreads the GPU tests instead of stacking every worker on GPU 0. Must run before CUDA initialises.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _GPUS:
    _visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(_GPUS)).split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible[int(_WORKER[2:]) % len(_visible)]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `./test.sh -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, return the memory torch's allocator keeps cached for its worker. Several xdist workers
    share one GPU (`-n 6` on one H200), and memory one keeps cached is memory the others' 64k-token tests cannot
    get. Measured (H200, `pytest -m gpu -n 6 tests/`, nvidia-smi every 2 s): without this the GPU's memory sat
    full (139,481 MiB) for the run's last 46 s; with it the peak was 87,641 MiB."""
    yield
    if "gpu" in request.keywords:
        import torch

        torch.cuda.empty_cache()
