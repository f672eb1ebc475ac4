"""Compiles the Gluon kernels for Hopper (sm_90) on a machine without a GPU (`nsa_models/nsa/gluon_selected.py`:
the key-block-major forward and the backward's dK/dV kernel; `gluon_selected_window.py`: the fused selected +
window forward), with the arguments the host code launches
them with, and prints what the PTX holds: wgmma and cp.async instruction counts, shared memory, and ptxas's
registers / spills and the SASS instructions of each loop per shape, next to the Triton kernel each replaces, compiled
for the same launch.

As tests/hopper_compile.py does for the Triton kernels: the launch is recorded from `gluon_fwd_items` (given the
work lists and `_item_args` of CPU tensors) instead of run, then compiled. Cases: nsa-125m's heads (4 KV heads,
G = 3, D = 64) and nsa-1b's (4 KV heads, G = 4, D = 128), 16 blocks of 64 keys chosen; the backward at both with
and without the dQ term (WITH_DQ), with the rows per step and warps `selected_attention_bwd` gives each. Exit status 1
if any fails. `--quick`: each Gluon kernel once, at nsa-125m's heads and its default launch
(tests/test_gluon_compile.py).

    python tests/gluon_compile.py [items] [fused] [--quick]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import random_block_indices  # noqa: E402
from nsa_models.nsa import gluon_selected, gluon_selected_window, triton_selected_window  # noqa: E402
from nsa_models.nsa.triton_common import LOG2E  # noqa: E402
from nsa_models.nsa.triton_selected import (  # noqa: E402
    _ITEM_ROWS,
    _ITEM_ROWS_DQ,
    _bwd_dkdv_kernel,
    _fwd_item_kernel,
    _item_args,
    reverse_index,
)

HOPPER = GPUTarget("cuda", 90, 32)
CASES = [  # name, H (KV heads), G, D, T
    ("nsa-125m", 4, 3, 64, 4096),
    ("nsa-1b", 4, 4, 128, 4096),
    ("G=1 D=128", 4, 1, 128, 4160),  # T not a multiple of 64
]
BWD_CASES = [  # name, H (KV heads), G, D, T, WITH_DQ
    ("nsa-125m", 4, 3, 64, 4096, True),
    ("nsa-125m", 4, 3, 64, 4096, False),
    ("nsa-1b", 4, 4, 128, 4096, True),
    ("nsa-1b", 4, 4, 128, 4096, False),
]
BS, N_SEL = 64, 16
PTX_COUNTS = {  # what the kernel is meant to be made of
    "wgmma.mma_async": r"wgmma\.mma_async",
    "cp.async": r"cp\.async\.c[ag]\.shared",
    "cp.async.wait_group": r"cp\.async\.wait_group",
    "fence.proxy.async": r"fence\.proxy\.async",
    "bar.sync": r"bar\.sync|barrier\.sync",
}


def record(kernel_name: str, launch, module=gluon_selected) -> tuple[tuple, dict]:
    """The positional and keyword arguments `launch()` gives `module.<kernel_name>`, recorded instead of run."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((a, kw))

    kernel = getattr(module, kernel_name)
    setattr(module, kernel_name, Recorder())
    try:
        launch()
    finally:
        setattr(module, kernel_name, kernel)
    (recorded,) = launches
    return recorded


def recorded_launch(H: int, G: int, D: int, T: int) -> tuple[tuple, dict]:
    """The positional and keyword arguments `gluon_fwd_items` gives the kernel for bf16 CPU tensors of this shape."""
    q = torch.zeros(1, T, H * G, D, dtype=torch.bfloat16)
    k = v = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    idx = random_block_indices(1, H, T, N_SEL, BS, "cpu")
    items, query_slot, _ = reverse_index(idx, BS, T)
    args = _item_args(q, k, N_SEL, items, query_slot, BS, (0, 0), _ITEM_ROWS, stages=2)
    return record("_fwd_item_kernel", lambda: gluon_selected.gluon_fwd_items(
        q, k, v, O_PART=q, LSE_PART=q.float(), qk_scale=D**-0.5 * LOG2E, **args))


def recorded_bwd_launch(H: int, G: int, D: int, T: int, with_dq: bool, rows: int | None = None,
                        warps: int | None = None) -> tuple[tuple, dict, dict]:
    """The arguments `gluon_bwd_dkdv_items` gives the Gluon dK/dV kernel (its own rows per step and warps, or
    `rows` / `warps`), called with the keywords `selected_attention_bwd` gives `_bwd_dkdv_kernel`; and the Triton
    kernel's keywords in that launch (its rows per step, stages and warps for this shape)."""
    q = do = torch.zeros(1, T, H * G, D, dtype=torch.bfloat16)
    k = v = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    lse = delta = torch.zeros(1, T, H * G, dtype=torch.float32)
    idx = random_block_indices(1, H, T, N_SEL, BS, "cpu")
    items, query_slot, _ = reverse_index(idx, BS, T)
    triton_rows = _ITEM_ROWS_DQ if with_dq and G >= 3 and D > 64 else _ITEM_ROWS
    args = _item_args(q, k, N_SEL, items, query_slot, BS, (0, 0), triton_rows, stages=3 if with_dq else 2)
    dk_part = torch.zeros(items.shape[1], BS, D, dtype=torch.float32)
    dq_part = q.new_zeros(1, T, H * G, N_SEL, D) if with_dq else dk_part
    outputs = dict(DK_PART=dk_part, DV_PART=dk_part, DQ_PART=dq_part, qk_scale=D**-0.5 * LOG2E, scale=D**-0.5,
                   WITH_DQ=with_dq, num_warps=8 if with_dq and D > 64 else 4)
    launch_args, launch_kwargs = record("_bwd_dkdv_kernel", lambda: gluon_selected.gluon_bwd_dkdv_items(
        q, k, v, do, lse, delta, **outputs, **args, rows=rows, warps=warps))
    constexprs = ("N_SEL", "H", "G", "D", "BS", "BR", "QB", "BD", "PRECISION", "WITH_DQ", "num_warps", "num_stages")
    triton_kwargs = {key: value for key, value in (outputs | args).items() if key in constexprs}
    return launch_args, launch_kwargs, triton_kwargs


FUSED_CASES = [  # name, H (KV heads), G, D, T, documents
    ("nsa-125m", 4, 3, 64, 2048, False),
    ("nsa-125m, documents", 4, 3, 64, 2048, True),
    ("nsa-1b", 4, 4, 128, 2048, False),
]


def recorded_fused_launches(H: int, G: int, D: int, T: int, documents: bool) -> tuple[tuple, tuple, tuple, tuple]:
    """The (args, kwargs) `gluon_fwd` gives the Gluon fused forward, `triton_fwd` the Triton one, and
    `gluon_bwd_dq` / `gluon_bwd_dkdv` the Gluon backward kernels, for bf16 CPU tensors of this shape (one batch
    row, the window of nsa-125m: 512)."""
    q = torch.zeros(1, T, H * G, D, dtype=torch.bfloat16)
    k = v = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    bits = torch.zeros(1, H, T, dtype=torch.int64)
    doc = torch.zeros(1, T, dtype=torch.int32) if documents else None
    lse = torch.zeros(1, T, H * G)
    gluon_launch = record("_fwd_kernel", lambda: gluon_selected_window.gluon_fwd(
        q, k, v, bits, doc, 512, D**-0.5, q, q, lse, lse), gluon_selected_window)
    triton_launch = record("_fwd_kernel", lambda: triton_selected_window.triton_fwd(
        q, k, v, bits, doc, BS, 512, D**-0.5, o_slc=q, o_win=q, lse_slc=lse, lse_win=lse), triton_selected_window)
    dq_launch = record("_bwd_dq_kernel", lambda: gluon_selected_window.gluon_bwd_dq(
        q, k, v, bits, doc, 512, D**-0.5, q, lse, lse, lse, lse, q), gluon_selected_window)
    dkdv_launch = record("_bwd_dkdv_kernel", lambda: gluon_selected_window.gluon_bwd_dkdv(
        q, k, v, bits, doc, 512, D**-0.5, q, lse, lse, lse, lse, k, k), gluon_selected_window)
    return gluon_launch, triton_launch, dq_launch, dkdv_launch


def recorded_window_launches(H: int, G: int, D: int, T: int, documents: bool) -> list[tuple[str, str, tuple]]:
    """(label, kernel name, (args, kwargs)) of the three Gluon kernels as `window_sweep_fwd` / `_bwd` launch them
    (the window alone: no bits, no selected-branch tensors)."""
    q = torch.zeros(1, T, H * G, D, dtype=torch.bfloat16)
    k = v = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    doc = torch.zeros(1, T, dtype=torch.int32) if documents else None
    lse = torch.zeros(1, T, H * G)
    g = gluon_selected_window
    return [
        ("window forward", "_fwd_kernel", record("_fwd_kernel", lambda: g.gluon_fwd(
            q, k, v, None, doc, 512, D**-0.5, None, q, None, lse), g)),
        ("window dQ", "_bwd_dq_kernel", record("_bwd_dq_kernel", lambda: g.gluon_bwd_dq(
            q, k, v, None, doc, 512, D**-0.5, q, None, lse, None, lse, q), g)),
        ("window dK/dV", "_bwd_dkdv_kernel", record("_bwd_dkdv_kernel", lambda: g.gluon_bwd_dkdv(
            q, k, v, None, doc, 512, D**-0.5, q, None, lse, None, lse, k, k), g)),
    ]


def compile_launch(kernel: triton.JITFunction, source_type: type[ASTSource], args: tuple, kwargs: dict):
    """triton.compile of a kernel (the Gluon one, or for comparison the Triton one) for sm_90: constexpr
    parameters as constants, the rest typed as the launcher types them, every tensor 16-byte aligned (as CUDA's
    allocator gives them and `gluon_fwd_items` requires: the 16-byte cp.async copies need the launcher's
    divisibility hint)."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in kwargs}
    if options.get("maxnreg") is None:
        options.pop("maxnreg", None)
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[param.name] = mangle_type(value)
            if isinstance(value, torch.Tensor):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = source_type(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=options)


def _bundled_tool(tool: str, name: str, data: bytes, *args: str) -> subprocess.CompletedProcess | None:
    """Run one of the CUDA tools Triton's NVIDIA backend bundles on `data`, written to a temporary file `name`
    (given as the tool's last argument; relative paths in args land beside it); None if Triton has no such tool."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    if not path.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_bytes(data)
        return subprocess.run([str(path), *args, name], cwd=tmp, capture_output=True, text=True)


def ptxas_report(ptx: str) -> str:
    """Registers and spill bytes ptxas reports for the PTX (sm_90a), from Triton's bundled ptxas, and whether it
    serialized the wgmma instructions, and why (its "Potential Performance Loss" warnings: C7513, a register operand
    defined while a product runs; C7515, a non-wgmma instruction writing a product's accumulator registers while
    another product runs)."""
    result = _bundled_tool("ptxas", "kernel.ptx", ptx.encode(), "-arch=sm_90a", "-v", "-o", "k.cubin")
    if result is None:
        return "no ptxas in Triton's NVIDIA backend"
    text = result.stdout + result.stderr
    if result.returncode:  # e.g. a newer Triton's PTX ISA past its bundled ptxas
        fatal = next((line for line in text.splitlines() if "fatal" in line), text.strip()[:200])
        return "ptxas: " + fatal.split("fatal", 1)[-1].lstrip(" :")
    found = [re.search(pattern, text) for pattern in (r"Used (\d+) registers", r"(\d+) bytes spill stores")]
    regs, spills = (m.group(1) if m else "?" for m in found)
    reasons = re.findall(r"\((C75\d\d)\) Potential Performance Loss: wgmma", text)
    serialized = f"; WGMMA SERIALIZED ({', '.join(sorted(set(reasons)))})" if reasons else ""
    return f"registers {regs}, spill stores {spills} B{serialized}"


def sass_loops(cubin: bytes) -> str:
    """The SASS instructions of each loop of the kernel (a backward branch's span, innermost loops included), from
    Triton's bundled nvdisasm: what one step issues a warp, the measure the item kernels' steps are bound by
    (docs/KERNELS.md, "What a step costs")."""
    result = _bundled_tool("nvdisasm", "kernel.cubin", cubin, "-c")
    if result is None or result.returncode:
        return "SASS loops: no nvdisasm output"
    labels, branches, address = {}, [], -16
    for line in result.stdout.splitlines():
        at = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if at:
            address = int(at.group(1), 16)
            target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
            if target:
                branches.append((address, target.group(1)))
        elif re.match(r"^(\.L_x_\d+):", line):
            labels[line.split(":")[0]] = address + 16  # the next instruction's address
    loops = [(address - labels[name]) // 16 + 1 for address, name in branches if labels.get(name, address) < address]
    loops = [n for n in loops if n > 2]  # not the closing branch to itself, nor the barrier's retry
    return f"SASS loops {', '.join(map(str, loops)) or 'none'}"


def summary(compiled) -> str:
    """The PTX's instruction counts, shared memory, ptxas's report and the SASS loops of one compiled kernel."""
    ptx = compiled.asm["ptx"]
    counts = ", ".join(f"{key} {len(re.findall(pattern, ptx))}" for key, pattern in PTX_COUNTS.items())
    return f"{counts}; shared {compiled.metadata.shared} B; {ptxas_report(ptx)}; {sass_loops(compiled.asm['cubin'])}"


def main(parts: list[str]) -> int:
    """parts: "items" (the key-block-major kernels), "fused" (the fused sweep's kernels, with and without the
    selected branch); both when empty. With "--quick" among them, each Gluon kernel once: at nsa-125m's heads,
    its default launch, no Triton kernel beside it (what tests/test_gluon_compile.py runs)."""
    print(f"triton {triton.__version__}, target {HOPPER}")
    failures = 0
    quick = "--quick" in parts
    parts = [part for part in parts if part != "--quick"] or ["items", "fused"]
    first = slice(1) if quick else slice(None)  # nsa-125m's heads come first in each list
    for name, H, G, D, T in CASES[first] if "items" in parts else []:
        args, kwargs = recorded_launch(H, G, D, T)
        label = f"{name}: H={H} G={G} D={D} T={T} (QB={kwargs['QB']})"
        try:
            compiled = compile_launch(gluon_selected._fwd_item_kernel, GluonASTSource, args, kwargs)
        except Exception as e:  # the compiler's message names the line
            failures += 1
            print(f"FAILED {label}: {type(e).__name__}: {e}")
            continue
        print(f"compiled {label}\n  gluon:  {summary(compiled)}")
        if quick:
            continue
        # The Triton kernel as the forward op launches it, for comparison (4 warps, 2 or 3 stages: `_item_args`).
        triton_kwargs = {key: value for key, value in kwargs.items() if key not in ("NUM_WARPS", "num_warps")}
        triton_kwargs |= dict(PRECISION="tf32", BD=kwargs["D"], num_warps=4, num_stages=3 if kwargs["D"] > 64 else 2)
        print(f"  triton: {summary(compile_launch(_fwd_item_kernel, ASTSource, args, triton_kwargs))}")
    for name, H, G, D, T, with_dq in BWD_CASES[first] if "items" in parts else []:
        args, kwargs, triton_kwargs = recorded_bwd_launch(H, G, D, T, with_dq)
        print(f"bwd dK/dV {name}: H={H} G={G} D={D} T={T} WITH_DQ={with_dq}")
        # The Gluon kernel at its default rows per step / warps (`bwd_launch_shape`), then the alternatives.
        default = (kwargs["BR"], kwargs["num_warps"])
        for shape in [default] + [s for s in ((64, 4), (64, 8), (128, 8)) if s != default and not quick]:
            label = f"gluon {shape[0]:>3} rows {shape[1]} warps{' (default)' if shape == default else ''}"
            try:
                args, kwargs, _ = recorded_bwd_launch(H, G, D, T, with_dq, *shape)
                compiled = compile_launch(gluon_selected._bwd_dkdv_kernel, GluonASTSource, args, kwargs)
                print(f"  {label}: {summary(compiled)}")
            except Exception as e:
                failures += 1
                print(f"  FAILED {label}: {type(e).__name__}: {e}")
        if quick:
            continue
        # The Triton kernel as `selected_attention_bwd` launches it.
        label = f"triton {triton_kwargs['BR']:>3} rows {triton_kwargs['num_warps']} warps"
        print(f"  {label}: {summary(compile_launch(_bwd_dkdv_kernel, ASTSource, args, triton_kwargs))}")
    for name, H, G, D, T, documents in FUSED_CASES[first] if "fused" in parts else []:
        (args, kwargs), (triton_args, triton_kwargs), dq_launch, dkdv_launch = recorded_fused_launches(
            H, G, D, T, documents)
        print(f"fused selected + window {name}: H={H} G={G} D={D} T={T}")
        for label, kernel, launch in [("forward, gluon", gluon_selected_window._fwd_kernel, (args, kwargs)),
                                      ("dQ, gluon", gluon_selected_window._bwd_dq_kernel, dq_launch),
                                      ("dK/dV, gluon", gluon_selected_window._bwd_dkdv_kernel, dkdv_launch)]:
            try:
                print(f"  {label}: {summary(compile_launch(kernel, GluonASTSource, *launch))}")
            except Exception as e:
                failures += 1
                print(f"  FAILED {label}: {type(e).__name__}: {e}")
        if not quick:
            compiled = compile_launch(triton_selected_window._fwd_kernel, ASTSource, triton_args, triton_kwargs)
            print(f"  forward, triton: {summary(compiled)}")
        for label, kernel, launch in recorded_window_launches(H, G, D, T, documents):
            try:
                compiled = compile_launch(getattr(gluon_selected_window, kernel), GluonASTSource, *launch)
                print(f"  {label}, gluon: {summary(compiled)}")
            except Exception as e:
                failures += 1
                print(f"  FAILED {label}, gluon: {type(e).__name__}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
