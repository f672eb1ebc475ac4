"""The key-block-major selected forward's item kernel: Triton's `_fwd_item_kernel` against the Gluon one
(`nsa_models/nsa/gluon_selected.py`), on the same work lists, at nsa-125m's and nsa-1b's head shapes (needs a Hopper
GPU). Prints ms per call (triton.testing.do_bench, median) and the TFLOP/s each reaches on the useful work: 4 * l' * D
FLOPs per (query row, chosen block) pair (QK^T and PV), whatever the padding of a step's rows.

Also the place the GPU test builds its launches from (`ItemLaunch`), so both run the kernels exactly as the forward
op does.

    PYTHONPATH=. python3 bench/gluon_selected.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention import random_block_indices  # noqa: E402
from nsa_models.nsa.gluon_selected import gluon_fwd_items  # noqa: E402
from nsa_models.nsa.triton_common import LOG2E  # noqa: E402
from nsa_models.nsa.triton_selected import _ITEM_ROWS, _fwd_item_kernel, _item_args, reverse_index  # noqa: E402

BS, N_SEL = 64, 16  # l' and n of every flavor
SHAPES = [  # name, B, T, H (KV heads), G, D
    ("nsa-125m 2 x 8k", 2, 8192, 4, 3, 64),
    ("nsa-125m 1 x 32k", 1, 32768, 4, 3, 64),
    ("nsa-1b 2 x 8k", 2, 8192, 4, 4, 128),
    ("nsa-1b 1 x 32k", 1, 32768, 4, 4, 128),
]


@dataclass
class ItemLaunch:
    """Random bf16 q, k, v and random valid block choices, with the work lists and the item kernels' arguments the
    forward op builds (`selected_attention_fwd`'s key-block-major path)."""

    q: Tensor
    k: Tensor
    v: Tensor
    block_indices: Tensor  # [B, H, T, n]
    args: dict  # `_item_args`
    qk_scale: float

    def outputs(self) -> tuple[Tensor, Tensor]:
        """Per-slot outputs [B, T, HQ, n, D] and lse [B, T, HQ, n], NaN where no kernel writes."""
        B, T, HQ, D = self.q.shape
        return (self.q.new_full((B, T, HQ, N_SEL, D), float("nan")),
                self.q.new_full((B, T, HQ, N_SEL), float("nan"), dtype=torch.float32))

    def filled(self) -> Tensor:
        """[B, T, HQ, n] bool: the slots the kernels write (a chosen block, not -1 padding)."""
        G = self.q.shape[2] // self.k.shape[2]
        return (self.block_indices >= 0).permute(0, 2, 1, 3).repeat_interleave(G, dim=2)

    def run_triton(self, o_part: Tensor, lse_part: Tensor) -> None:
        _fwd_item_kernel[(self.args["ITEM_SEG"].shape[0],)](self.q, self.k, self.v, O_PART=o_part, LSE_PART=lse_part,
                                                            qk_scale=self.qk_scale, num_warps=4, **self.args)

    def run_gluon(self, o_part: Tensor, lse_part: Tensor) -> None:
        gluon_fwd_items(self.q, self.k, self.v, O_PART=o_part, LSE_PART=lse_part, qk_scale=self.qk_scale,
                        **self.args)

    def flops(self) -> int:
        """Useful FLOPs: 4 * l' * D per (query row, chosen block) pair."""
        G, D = self.q.shape[2] // self.k.shape[2], self.q.shape[3]
        return int((self.block_indices >= 0).sum().item()) * G * 4 * BS * D


def item_launch(B: int, T: int, H: int, G: int, D: int, q_start: int = 0, seed: int = 0) -> ItemLaunch:
    """T queries at positions q_start .. q_start + T - 1 (every batch row) of q_start + T keys, as the forward op
    launches the item kernels for them (3 pipeline stages for the Triton kernel at D > 64, as there)."""
    TK = q_start + T
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
               for n, h in ((T, H * G), (TK, H), (TK, H)))
    torch.manual_seed(seed)
    block_indices = random_block_indices(B, H, TK, N_SEL, BS, "cuda")[:, :, q_start:].contiguous()
    items, query_slot, _ = reverse_index(block_indices, BS, TK)
    args = _item_args(q, k, N_SEL, items, query_slot, BS, (q_start, q_start), _ITEM_ROWS, stages=3 if D > 64 else 2)
    return ItemLaunch(q, k, v, block_indices, args, D**-0.5 * LOG2E)


def time_shape(B: int, T: int, H: int, G: int, D: int) -> tuple[int, float, float, float]:
    """(items, Triton ms, Gluon ms, useful GFLOP) of one shape's item kernels."""
    launch = item_launch(B, T, H, G, D)
    o_part, lse_part = launch.outputs()
    ms_triton = triton.testing.do_bench(lambda: launch.run_triton(o_part, lse_part))
    ms_gluon = triton.testing.do_bench(lambda: launch.run_gluon(o_part, lse_part))
    return launch.args["ITEM_SEG"].shape[0], ms_triton, ms_gluon, launch.flops() / 1e9


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'shape':<18} {'G':>2} {'D':>4} {'items':>7} {'triton ms':>10} {'gluon ms':>9} {'speedup':>8} "
          f"{'triton TF/s':>12} {'gluon TF/s':>11}")
    for label, B, T, H, G, D in SHAPES:
        items, ms_triton, ms_gluon, gflop = time_shape(B, T, H, G, D)
        torch.cuda.empty_cache()
        print(f"{label:<18} {G:>2} {D:>4} {items:>7} {ms_triton:>10.3f} {ms_gluon:>9.3f} {ms_triton / ms_gluon:>7.2f}x "
              f"{gflop / ms_triton:>12.1f} {gflop / ms_gluon:>11.1f}")


if __name__ == "__main__":
    main()
