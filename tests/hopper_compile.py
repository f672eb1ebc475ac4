"""Compiles the fused selected + window kernels for Hopper (sm_90) on a machine without a GPU: Triton's compiler
checks what its interpreter does not (every return path of a constexpr branch typed alike, shapes of untaken
branches, layouts), so a kernel that passes the CPU interpreter tests but cannot compile fails here, not on the GPU.
Run by tests/test_triton_hopper_compile.py in a process of its own (the kernels must be JIT functions, not the
interpreter's)."""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa_models.nsa import triton_selected_window as sw

HOPPER = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def signature(fn: triton.JITFunction, consts: dict, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each argument's Triton type: `consts`' names constexpr, pointers and descriptors from `tensors`, the rest
    the kernels' scalars (T and W int32, scales fp32)."""
    types = {}
    for name in fn.arg_names:
        if name in consts:
            types[name] = "constexpr"
        elif name in tensors:
            x = tensors[name]
            types[name] = f"*{TRITON_TYPES[x.dtype]}"
        elif name in ("K", "V"):  # TMA descriptors of one key step a box (triton_common.head_rows_operand)
            types[name] = f"tensordesc<{TRITON_TYPES[tensors['Q'].dtype]}[1, {consts['BN']}, {consts['BD']}]>"
        else:
            types[name] = "i32" if name in ("T", "W") else "fp32"
    return types


def compile_case(G: int, D: int, block_size: int, dtype: torch.dtype, documents: bool) -> list[str]:
    """Compiles the three kernels (T = 1024, 4 KV heads) under their launch settings; returns the failures."""
    B, T, H = 1, 1024, 4
    q = torch.zeros(B, T, H * G, D, dtype=dtype)
    k = torch.zeros(B, T, H, D, dtype=dtype)
    bits = torch.zeros(B, H, T, dtype=torch.int64)
    doc = torch.zeros(B, T, dtype=torch.int32) if documents else None
    lse = torch.zeros(B, T, H * G)
    tensors = dict(Q=q, O_SLC=q, O_WIN=q, DO_SLC=q, DO_WIN=q, DQ=q, DK=k, DV=k, BITS=bits,
                   DOC=doc if documents else bits, LSE_SLC=lse, LSE_WIN=lse, DELTA_SLC=lse, DELTA_WIN=lse)
    failures = []
    for kernel, launch in ((sw._fwd_kernel, sw.FWD_LAUNCH), (sw._bwd_dq_kernel, sw.DQ_LAUNCH),
                           (sw._bwd_dkdv_kernel, sw.DKDV_LAUNCH)):
        args, _ = sw._launch(q, k, bits, doc, block_size, 512, D ** -0.5, launch)
        options = dict(num_warps=args.pop("num_warps"), num_stages=args.pop("num_stages"))
        consts = {k: v for k, v in args.items() if k in ("H", "G", "D", "BS", "BN", "QT", "BM", "BD", "PRECISION",
                                                         "TMA", "DOC_MASK")}
        source = ASTSource(fn=kernel, signature=signature(kernel, consts, tensors),
                           constexprs={(kernel.arg_names.index(name),): value for name, value in consts.items()})
        try:
            triton.compile(source, target=HOPPER, options=options)
        except Exception as e:  # the compiler's message names the line
            failures.append(f"{kernel.fn.__name__} G={G} D={D} l'={block_size} {dtype} documents={documents}: "
                            f"{type(e).__name__}: {e}")
    return failures


def main() -> int:
    failures = []
    # nsa-125m's heads; G = 16 at D = 128 with documents; two selection blocks a key step (l' = 32). bf16 only: fp32
    # kernels take ptxas 30-80 s each, and their typing is the same code's.
    for G, D, block_size, documents in [(3, 64, 64, False), (16, 128, 64, True), (2, 64, 32, False)]:
        failures += compile_case(G, D, block_size, torch.bfloat16, documents)
    print("\n".join(failures) or "all compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
