"""Test-wide settings: offline datasets, one inductor cache for the whole run, the Triton interpreter without a GPU
(two of its slow paths made fast, with the same values), GPU tests skipped without CUDA and handing
their cached GPU memory back when done."""

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


def _fast_interpreter_xor_reduce() -> None:
    """Give the Triton interpreter a numpy path for XOR reductions along an axis, which `tl.sort` and
    `tl.bitonic_merge` run at every compare-and-swap stage (`xor_sum`). The interpreter has numpy paths for sum, min
    and max only and reduces anything else one element at a time through the combine function: 96% of a selection
    kernel's time (measured: one `select_topn` call of tests/test_triton_compressed.py, 42 s -> 1.8 s). XOR is
    associative and commutative and the result keeps the input's integer dtype, so the values are bit for bit those
    of the slow path (tests/test_triton_compressed.py::test_interpreter_xor_sum_and_sort_match_torch)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no triton: no interpreter tests
        return
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(getattr(tl, "standard", None), "_xor_combine", None)
    if reduce_ops is None or xor_combine is None or getattr(reduce_ops, "_nsa_fast_xor", False):
        return
    generic_apply = reduce_ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is xor_combine and len(input) == 1 and self.axis is not None:
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype)
        return generic_apply(self, input)

    reduce_ops.apply_impl = apply_impl
    reduce_ops._nsa_fast_xor = True


def _patch_language_once_per_launch() -> None:
    """Let the Triton interpreter patch triton.language once per kernel launch instead of at every call of a device
    function as well. A launch patches the language modules its kernel sees (`_patch_lang`) and restores them when
    it ends; each device-function call (`tl.sort`'s every stage, the repo's `@triton.jit` helpers) patches them again
    with `inspect.getmembers` over all of triton.language, though they are patched already: 40% of the interpreter
    tests' time (measured with cProfile on a selected-attention and a compressed-attention case). Here a call whose
    modules the running launch has patched gets an empty scope; any other call (another module, a new launch)
    patches as before, and the launch's restore ends it. A call left unpatched would fail, not compute otherwise."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_nsa_once", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: set[int] = set()  # the language modules of the running launch, patched

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched:
            return interpreter._LangPatchScope()
        scope = original(fn)
        outermost = not patched
        patched.update(langs)
        if outermost:
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_lang._nsa_once = True
    interpreter._patch_lang = patch_lang


_fast_interpreter_xor_reduce()
_patch_language_once_per_launch()
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
