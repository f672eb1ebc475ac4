"""The kernels one compiled transformer block launches, read from inductor's generated code: a launch count that
needs no GPU.

    python bench/block_kernels.py                                   # nsa-125m and dense-125m on the CPU, T = 256
    python bench/block_kernels.py --device cuda --seq-len 2048 --list

Compiles block 0 of each flavor (`fullgraph=True`, the `triton` NSA backend) and runs one forward and backward; for
each generated graph (forward, backward) it counts the fused kernels inductor wrote (`cpp_fused_*` on the CPU,
Triton kernels on a GPU) and the extern calls (GEMMs, SDPA, the NSA custom ops), and prints a markdown table. On the
CPU (NSA's Triton kernels through the interpreter, fp32) the counts are a proxy for a GPU's: inductor fuses alike but
writes no bf16 casts and splits no reductions there, and a custom op's own launches are one call here. What the
GPU launches, custom ops' kernels included, is `bench/profile_step.py`'s table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

# On the CPU the NSA ops' Triton kernels run through the interpreter, which has to be on before triton is imported
# (without it inductor finds no Triton driver on a machine without a GPU).
if __name__ == "__main__" and not any("cuda" in arg for arg in sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch._inductor.utils import run_and_get_code

from nsa_models import get_flavor
from nsa_models.model import TransformerBlock, rope_cache
from nsa_models.nsa import window_mask

# A kernel launch in inductor's `call` function: a C++ kernel called by name, or a Triton kernel's `.run(`.
_FUSED = re.compile(r"^\s+(cpp_fused_\w+)\(|^\s+(\w+)\.run\(", re.M)
# An extern call: a library kernel (`extern_kernels.mm`) or an op called through torch.ops (SDPA, NSA's ops).
_EXTERN = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)


def graph_kernels(code: str) -> tuple[list[str], list[str]]:
    """The fused kernels and the extern calls of one generated module's `call` function, in launch order."""
    call = code[code.index("def call("):]
    fused = [cpp or triton for cpp, triton in _FUSED.findall(call)]
    return fused, _EXTERN.findall(call)


def block_kernels(flavor: str, seq_len: int, device: torch.device, window_backend: str | None
                  ) -> list[tuple[list[str], list[str]]]:
    """Per generated graph of block 0 of `flavor` (forward, then backward): its fused kernels and extern calls."""
    args = get_flavor(flavor)
    if args.attention == "nsa":
        nsa = dataclasses.replace(args.nsa, backend="triton")
        args = dataclasses.replace(args, nsa=nsa if window_backend is None
                                   else dataclasses.replace(nsa, window_backend=window_backend))
    args = dataclasses.replace(args, max_seq_len=max(seq_len, args.max_seq_len))
    torch.manual_seed(0)
    block = TransformerBlock(0, args).to(device)
    block.init_weights(args.init_std, args.n_layers)
    rope = rope_cache(seq_len, args.head_dim, args.rope_theta, device)
    mask = window_mask(seq_len, args.nsa, device) if args.attention == "nsa" else None
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x = torch.randn(2, seq_len, args.dim, device=device, requires_grad=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out, _ = compiled(x, rope, mask)
        out.float().square().mean().backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    return [graph_kernels(code) for code in codes]


def table(rows: dict[str, list[tuple[list[str], list[str]]]]) -> str:
    """Markdown: per flavor, fused kernels and extern calls of the forward and the backward graph, and their sum."""
    lines = ["| flavor | forward fused / extern | backward fused / extern | launches a block |", "|---|---|---|---|"]
    for flavor, graphs in rows.items():
        cells = [f"{len(fused)} / {len(extern)}" for fused, extern in graphs]
        total = sum(len(fused) + len(extern) for fused, extern in graphs)
        lines.append(f"| {flavor} | {' | '.join(cells + [''] * (2 - len(cells)))} | {total} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavors", nargs="+", default=["nsa-125m", "dense-125m"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--window-backend", default="fused_with_selected",
                        help="model.nsa.window_backend (the recipes' by default)")
    parser.add_argument("--list", action="store_true", help="also list each graph's kernels")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = {flavor: block_kernels(flavor, args.seq_len, device, args.window_backend) for flavor in args.flavors}
    print(table(rows))
    if args.list:
        for flavor, graphs in rows.items():
            for name, (fused, extern) in zip(("forward", "backward"), graphs):
                print(f"{flavor} {name}: " + ", ".join(fused + extern))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
