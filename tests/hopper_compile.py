"""Compiles every NSA Triton kernel for Hopper (sm_90) on a machine without a GPU, with the arguments its host code
launches it with: Triton's compiler checks what its interpreter does not (every return path of a constexpr branch
typed alike, shapes of untaken branches, layouts), so a kernel that passes the CPU interpreter tests but cannot
compile fails here, not on the GPU.

The triton backend runs forward and backward on CPU tensors with every kernel's launch recorded instead of run
(`record_launches`: the outputs are garbage, the launches are exact), over cases that reach each layout: the
compressed branch and the selection with and without documents, the selected branch key-block-major, by packed
query tiles and by one-query tiles, and the fused selected + window sweep. Each distinct (kernel, argument types,
constexprs, launch options) is then compiled for sm_90. Run by tests/test_triton_hopper_compile.py in a process of
its own (the kernels must be JIT functions, not the interpreter's)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import random_block_indices  # noqa: E402
from nsa_models.args import NSAArgs  # noqa: E402
from nsa_models.nsa import (  # noqa: E402
    triton_compressed,
    triton_selected,
    triton_selected_window,
    triton_selection,
)
from nsa_models.nsa.triton_backend import nsa_triton  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
MODULES = (triton_compressed, triton_selection, triton_selected, triton_selected_window)
Launch = tuple[triton.JITFunction, tuple, dict]


class _Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records the launch's arguments instead of running it."""

    def __init__(self, kernel: triton.JITFunction, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def record_launches(run: Callable[[], None]) -> list[Launch]:
    """The kernel launches (kernel, positional and keyword arguments) that `run` makes."""
    launches: list[Launch] = []
    kernels = [(module, name, obj) for module in MODULES for name, obj in vars(module).items()
               if isinstance(obj, triton.JITFunction) and name.endswith("_kernel")]
    for module, name, kernel in kernels:
        setattr(module, name, _Recorder(kernel, launches))
    wrap_triton = torch.library.wrap_triton  # the ops' launches (`triton_common.kernel_op`) wrap the recorders
    torch.library.wrap_triton = lambda kernel: kernel
    try:
        run()
    finally:
        torch.library.wrap_triton = wrap_triton
        for module, name, kernel in kernels:
            setattr(module, name, kernel)
    return launches


def compile_source(kernel: triton.JITFunction, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """The ASTSource and options of one launch: constexpr parameters (and None arguments) as constants, every
    other argument typed as Triton's launcher types it (pointer, scalar or TMA descriptor)."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[param.name] = mangle_type(value)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs), options


def backend_case(G: int, D: int, T: int, window_backend: str, documents: bool, block_size: int, n: int) -> None:
    """nsa_triton's forward and backward on CPU tensors (bf16, 4 KV heads, n given valid block choices)."""
    H = 4
    args = NSAArgs(sel_block_size=block_size, n_selected=n, backend="triton", window_backend=window_backend)
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_()

    q = leaf(1, T, H * G, D)
    k, v = leaf(1, T, H, D), leaf(1, T, H, D)
    k_cmp, v_cmp = leaf(1, args.num_cmp_blocks(T), H, D), leaf(1, args.num_cmp_blocks(T), H, D)
    gates = torch.rand(1, T, H * G, 3, generator=gen)
    doc_start = (torch.arange(T, dtype=torch.int32) // 512 * 512)[None] if documents else None
    idx = random_block_indices(1, H, T, n, block_size, "cpu")
    out, _, _ = nsa_triton(q, k, v, k, v, k_cmp, v_cmp, gates, args, block_indices=idx, doc_start=doc_start)
    out.float().sum().backward()


CASES = [  # G, D, T, window backend, documents, l', n
    (3, 64, 4096, "flex", False, 64, 16),  # nsa-125m's heads: selected branch key-block-major
    (3, 64, 2048, "flex", False, 64, 16),  # packed query tiles
    (16, 128, 2048, "flex", True, 64, 16),  # G = 16: 4-query tiles; documents in the compressed branch and selection
    (16, 128, 2112, "flex", False, 64, 4),  # one-query tiles (more than 8n blocks)
    (3, 64, 2048, "fused_with_selected", False, 64, 16),  # the fused sweep
    (16, 128, 1024, "fused_with_selected", True, 64, 16),
    (2, 64, 1024, "fused_with_selected", False, 32, 16),  # two selection blocks a key step
]


def main() -> int:
    sources: dict[str, tuple[ASTSource, dict]] = {}
    for case in CASES:
        for kernel, args, kwargs in record_launches(lambda case=case: backend_case(*case)):
            source, options = compile_source(kernel, args, kwargs)
            key = f"{kernel.fn.__name__} {sorted(source.signature.items())} {source.constants} {options}"
            sources.setdefault(key, (source, options))
    names = sorted({source.fn.fn.__module__.rsplit(".", 1)[1] + "." + source.fn.fn.__name__
                    for source, _ in sources.values()})
    failures = []
    for key, (source, options) in sources.items():
        try:
            triton.compile(source, target=HOPPER, options=options)
        except Exception as e:  # the compiler's message names the line
            failures.append(f"{key[:300]}: {type(e).__name__}: {e}")
    print("\n".join(failures) or f"all compiled: {len(sources)} launches of {len(names)} kernels: {', '.join(names)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
