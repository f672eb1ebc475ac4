"""`nsa_models.nsa.check_backend`, the one check that the chosen NSA backends can run: a one-line error naming the
key and the fix, before anything is built (the trainer turns it into its config error)."""

from __future__ import annotations

import pytest
import torch

from nsa_models.args import NSAArgs
from nsa_models.nsa import core
from nsa_models.nsa.core import _importable, check_backend

CUDA = torch.device("cuda")  # only named: the check reads the device's type, no GPU is touched


def test_importable_checks_submodules_without_failing_on_a_missing_parent():
    """The library check: a dotted module whose parent package is missing reads as not installed."""
    assert _importable("json.decoder")
    assert not _importable("json.no_such_module")
    assert not _importable("no_such_package.cute")


def test_the_reference_runs_anywhere_and_triton_needs_a_gpu():
    check_backend(NSAArgs(backend="reference", window_backend="flash_attn_4"), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"^model.nsa.backend = 'triton' needs a CUDA GPU \(device is cpu\): set "
                                         "--model.nsa.backend reference$"):
        check_backend(NSAArgs(backend="triton"), torch.device("cpu"), torch.float32)


def test_a_backend_that_was_not_built_is_a_clear_error():
    with pytest.raises(ValueError, match="^model.nsa.backend = 'cuda-magic' is not available here"):
        check_backend(NSAArgs(backend="cuda-magic"), CUDA, torch.bfloat16)


def test_a_missing_library_is_one_line_naming_the_key(monkeypatch):
    """A library backend whose package is not installed: the key, the package and the built-in choices."""
    monkeypatch.setattr(core, "_importable", lambda name: False)
    for key, choice, message in [
            ("window_backend", "flash_attn_4", "model.nsa.window_backend = 'flash_attn_4' needs the flash-attn-4 "
                                               "package (pip install flash-attn-4); or set it to 'flex' or 'sdpa'"),
            ("window_backend", "flash_attn", "model.nsa.window_backend = 'flash_attn' needs the flash-attn package "
                                             "(pip install flash-attn); or set it to 'flex' or 'sdpa'"),
            ("cmp_backend", "flash_attn_4", "model.nsa.cmp_backend = 'flash_attn_4' needs the flash-attn-4 package "
                                            "(pip install flash-attn-4); or set it to 'triton'")]:
        with pytest.raises(ValueError) as error:
            check_backend(NSAArgs(backend="triton", **{key: choice}), CUDA, torch.bfloat16)
        assert str(error.value) == message
    check_backend(NSAArgs(backend="triton"), CUDA, torch.bfloat16)  # the built-in choices need no package


@pytest.mark.parametrize("key,instead", [("window_backend", "'flex'"), ("cmp_backend", "'triton'")])
def test_flash_attn_4_needs_bf16_compute(key: str, instead: str, monkeypatch):
    """FA4 takes bf16 only: an fp32 run is refused (with the package installed)."""
    monkeypatch.setattr(core, "_importable", lambda name: True)
    args = NSAArgs(backend="triton", **{key: "flash_attn_4"})
    with pytest.raises(ValueError, match=f"{key} = 'flash_attn_4' runs bf16 only.* or {key} = {instead}$"):
        check_backend(args, CUDA, torch.float32)
    check_backend(args, CUDA, torch.bfloat16)


@pytest.mark.parametrize("key, default", [("selected_kernels", "triton"), ("window_backend", "flex")])
def test_gluon_kernels_need_hopper_bf16_and_gluon(key: str, default: str, monkeypatch):
    """selected_kernels or window_backend = 'gluon_hopper': a CUDA GPU of capability 9.x, bf16 compute and Gluon
    that imports; each refusal one line naming the key and the fix. The shapes are ModelArgs.validate's
    (tests/test_config.py)."""
    args = NSAArgs(backend="triton", sel_block_size=64, **{key: "gluon_hopper"})
    chosen, fix = f"model.nsa.{key} = 'gluon_hopper'", f"set model.nsa.{key} = {default!r}"
    with pytest.raises(ValueError) as error:  # the CPU device: the backend's own refusal comes first
        check_backend(args, torch.device("cpu"), torch.bfloat16)
    assert str(error.value).startswith("model.nsa.backend = 'triton' needs a CUDA GPU (device is cpu)")
    for capability, found in ((None, "no CUDA GPU here"), ((8, 0), "this one is 8.0"), ((10, 0), "this one is 10.0")):
        monkeypatch.setattr(core, "_cuda_capability", lambda device, capability=capability: capability)
        with pytest.raises(ValueError) as error:
            check_backend(args, CUDA, torch.bfloat16)
        assert str(error.value) == f"{chosen} needs a CUDA GPU of capability 9.x (Hopper; {found}): {fix}"
    monkeypatch.setattr(core, "_cuda_capability", lambda device: (9, 0))
    with pytest.raises(ValueError) as error:
        check_backend(args, CUDA, torch.float32)
    assert str(error.value) == f"{chosen} runs bf16 only: set training.mixed_precision = 'bf16' (or 'auto'), or {fix}"
    monkeypatch.setattr(core, "_gluon_import_error", lambda: "cannot import name 'warpgroup_mma'")
    with pytest.raises(ValueError) as error:
        check_backend(args, CUDA, torch.bfloat16)
    assert str(error.value) == (f"{chosen} needs triton.experimental.gluon (triton 3.6 or newer), which does not "
                                f"import here (cannot import name 'warpgroup_mma'): {fix}")
    monkeypatch.undo()
    monkeypatch.setattr(core, "_cuda_capability", lambda device: (9, 0))
    check_backend(args, CUDA, torch.bfloat16)  # Hopper, bf16, and Gluon imports (triton 3.6 or newer installed)
    check_backend(NSAArgs(backend="triton"), CUDA, torch.float32)  # the Triton kernels: no such requirement


def test_gluon_selected_kernels_on_this_machine():
    """Without a GPU (CPU test runs): the capability refusal, with the real device query."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(ValueError, match=r"^model.nsa.selected_kernels = 'gluon_hopper' needs a CUDA GPU of "
                                         r"capability 9.x \(Hopper; no CUDA GPU here\): set "
                                         r"model.nsa.selected_kernels = 'triton'$"):
        check_backend(NSAArgs(backend="triton", selected_kernels="gluon_hopper"), CUDA, torch.bfloat16)
