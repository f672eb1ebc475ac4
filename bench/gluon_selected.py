"""The key-block-major selected item kernels, Triton's against the Gluon ones (`nsa_models/nsa/gluon_selected.py`),
on the same work lists, at nsa-125m's and nsa-1b's head shapes (needs a Hopper GPU): the forward's
`_fwd_item_kernel` and the backward's `_bwd_dkdv_kernel` (with and without the dQ term; the Gluon one also at the
other rows per step / warps it supports). Prints ms per call (triton.testing.do_bench, median) and the TFLOP/s each
reaches on the useful work per (query row, chosen block) pair, whatever the padding of a step's rows: 4 * l' * D
FLOPs forward (QK^T, PV), 8 * l' * D backward (QK^T, dO V^T, P^T dO, dS^T Q) and 10 * l' * D with the dQ term.

`fused`: the fused selected + window forward, dQ and dK/dV kernels, Triton's (`triton_selected_window.triton_fwd`,
`triton_bwd_dq`, `triton_bwd_dkdv`) against Gluon's (`gluon_selected_window`) at 2k-4k, on random valid choices;
TFLOP/s over the causal prefix they walk, and how far Gluon's outputs are from Triton's (`time_fused`); then
cuDNN's dense causal forward and backward on the same shape (`time_cudnn`), their speedup column cuDNN's time over
the Gluon forward's and over its dQ + dK/dV (below 1: Gluon slower).

Also the place the GPU test builds its launches from (`ItemLaunch`, `DkdvLaunch`), so both run the kernels exactly
as the forward and backward ops do.

    PYTHONPATH=. python3 bench/gluon_selected.py [fwd|bwd|fused]   # fwd and bwd by default
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention import SDPBackend  # noqa: E402

from bench.attention import dense_causal, random_block_indices  # noqa: E402
from nsa_models.nsa.gluon_selected import (  # noqa: E402
    bwd_launch_shape,
    gluon_bwd_dkdv_items,
    gluon_fwd_items,
)
from nsa_models.nsa.gluon_selected_window import gluon_bwd_dkdv, gluon_bwd_dq, gluon_fwd  # noqa: E402
from nsa_models.nsa.triton_common import LOG2E, gated_lse, softmax_delta  # noqa: E402
from nsa_models.nsa.triton_selected import (  # noqa: E402
    _ITEM_ROWS,
    _ITEM_ROWS_DQ,
    _bwd_dkdv_kernel,
    _combine,
    _fwd_item_kernel,
    _item_args,
    reverse_index,
)
from nsa_models.nsa.triton_selected_window import (  # noqa: E402
    chosen_bits,
    triton_bwd_dkdv,
    triton_bwd_dq,
    triton_fwd,
)

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


@dataclass
class DkdvLaunch:
    """The backward's dK/dV kernel launch for an `ItemLaunch`'s inputs: random dO, the forward's lse (the Triton
    item kernels and `_combine`, as the forward op) and delta = rowsum(o * dO), with the arguments
    `selected_attention_bwd` gives `_bwd_dkdv_kernel` (its rows per step, stages and warps)."""

    fwd: ItemLaunch
    do: Tensor
    lse: Tensor  # natural log [B, T, HQ]
    delta: Tensor
    with_dq: bool
    args: dict  # `_item_args` of the Triton launch
    num_warps: int  # the Triton launch's
    n_items: int

    def outputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """DK_PART, DV_PART [items, l', D] fp32 and DQ_PART [B, T, HQ, n, D] (the input's dtype; without the dQ term
        the kernels get DK_PART there, as in the op), NaN where no kernel writes."""
        D = self.fwd.q.shape[3]
        dk = self.do.new_full((self.n_items, BS, D), float("nan"), dtype=torch.float32)
        dv = torch.full_like(dk, float("nan"))
        dq = self.do.new_full((*self.do.shape[:3], N_SEL, D), float("nan")) if self.with_dq else dk
        return dk, dv, dq

    def used_items(self) -> Tensor:
        """[items] bool: the items with a non-empty query range (the others store nothing)."""
        return self.args["ITEM_START"] < self.args["ITEM_END"]

    def _kwargs(self, dk: Tensor, dv: Tensor, dq: Tensor) -> dict:
        D = self.fwd.q.shape[3]
        return dict(DK_PART=dk, DV_PART=dv, DQ_PART=dq, qk_scale=self.fwd.qk_scale, scale=D**-0.5,
                    WITH_DQ=self.with_dq, num_warps=self.num_warps, **self.args)

    def run_triton(self, dk: Tensor, dv: Tensor, dq: Tensor) -> None:
        f = self.fwd
        _bwd_dkdv_kernel[(self.n_items,)](f.q, f.k, f.v, self.do, self.lse, self.delta, **self._kwargs(dk, dv, dq))

    def run_gluon(self, dk: Tensor, dv: Tensor, dq: Tensor, rows: int | None = None, warps: int | None = None):
        f = self.fwd
        gluon_bwd_dkdv_items(f.q, f.k, f.v, self.do, self.lse, self.delta, **self._kwargs(dk, dv, dq), rows=rows,
                             warps=warps)

    def flops(self) -> int:
        """Useful FLOPs: 8 * l' * D per (query row, chosen block) pair, 10 * l' * D with the dQ term."""
        return self.fwd.flops() // 4 * (10 if self.with_dq else 8)


def dkdv_launch(B: int, T: int, H: int, G: int, D: int, with_dq: bool, q_start: int = 0,
                seed: int = 0) -> DkdvLaunch:
    """`item_launch`'s inputs with the backward's: the forward run to get lse (and o, for delta), random dO."""
    fwd = item_launch(B, T, H, G, D, q_start, seed)
    o_part, lse_part = fwd.outputs()
    fwd.run_triton(o_part, lse_part)
    o, lse = torch.empty_like(fwd.q), fwd.q.new_empty(fwd.q.shape[:3], dtype=torch.float32)
    _combine(o_part, lse_part, fwd.block_indices, o, lse)
    del o_part, lse_part
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(fwd.q.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    delta = softmax_delta(o, do, None)
    rows = _ITEM_ROWS_DQ if with_dq and G >= 3 and D > 64 else _ITEM_ROWS
    items, query_slot, _ = reverse_index(fwd.block_indices, BS, fwd.k.shape[1])
    args = _item_args(fwd.q, fwd.k, N_SEL, items, query_slot, BS, (q_start, q_start), rows,
                      stages=3 if with_dq else 2)
    return DkdvLaunch(fwd, do, lse, delta, with_dq, args, 8 if with_dq and D > 64 else 4, items.shape[1])


def time_bwd_shape(B: int, T: int, H: int, G: int, D: int, with_dq: bool) -> list[tuple[str, float, float]]:
    """(kernel, ms, useful GFLOP) of one shape's dK/dV launches: Triton's, the Gluon default, its alternatives."""
    launch = dkdv_launch(B, T, H, G, D, with_dq)
    dk, dv, dq = launch.outputs()
    gflop = launch.flops() / 1e9
    args = launch.args
    results = [(f"triton {args['BR']}r {launch.num_warps}w", triton.testing.do_bench(
        lambda: launch.run_triton(dk, dv, dq)), gflop)]
    default = bwd_launch_shape(G, D, with_dq)
    for rows, warps in [default] + [s for s in ((64, 4), (64, 8), (128, 8)) if s != default]:
        label = f"gluon {rows}r {warps}w" + (" (default)" if (rows, warps) == default else "")
        ms = triton.testing.do_bench(lambda r=rows, w=warps: launch.run_gluon(dk, dv, dq, r, w))
        results.append((label, ms, gflop))
    return results


def main(which: str = "all") -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if which in ("all", "fwd"):
        bench_fwd()
    if which in ("all", "bwd"):
        bench_bwd()
    if which == "fused":
        bench_fused()


def bench_fwd() -> None:
    print("forward item kernel")
    print(f"{'shape':<18} {'G':>2} {'D':>4} {'items':>7} {'triton ms':>10} {'gluon ms':>9} {'speedup':>8} "
          f"{'triton TF/s':>12} {'gluon TF/s':>11}")
    for label, B, T, H, G, D in SHAPES:
        items, ms_triton, ms_gluon, gflop = time_shape(B, T, H, G, D)
        torch.cuda.empty_cache()
        print(f"{label:<18} {G:>2} {D:>4} {items:>7} {ms_triton:>10.3f} {ms_gluon:>9.3f} {ms_triton / ms_gluon:>7.2f}x "
              f"{gflop / ms_triton:>12.1f} {gflop / ms_gluon:>11.1f}")


def bench_bwd() -> None:
    print("backward dK/dV kernel (speedup: against the Triton launch)")
    print(f"{'shape':<18} {'G':>2} {'D':>4} {'dQ':>3} {'kernel':<30} {'ms':>8} {'speedup':>8} {'TF/s':>7}")
    for with_dq in (True, False):
        for label, B, T, H, G, D in SHAPES:
            results = time_bwd_shape(B, T, H, G, D, with_dq)
            torch.cuda.empty_cache()
            ms_triton = results[0][1]
            for kernel, ms, gflop in results:
                print(f"{label:<18} {G:>2} {D:>4} {'yes' if with_dq else 'no':>3} {kernel:<30} {ms:>8.3f} "
                      f"{ms_triton / ms:>7.2f}x {gflop / ms:>7.1f}")


FUSED_SHAPES = [  # label, B, T, H (KV heads), G, D, window
    ("nsa-125m 16 x 2k", 16, 2048, 4, 3, 64, 512),
    ("nsa-125m 8 x 4k", 8, 4096, 4, 3, 64, 512),
    ("nsa-1b 8 x 2k", 8, 2048, 4, 4, 128, 512),
    ("G = 16 D = 128 4k", 2, 4096, 4, 16, 128, 512),
]


def time_fused(B: int, T: int, H: int, G: int, D: int, window: int
               ) -> tuple[list[tuple[str, float, float, float, float]], tuple[float, float, float]]:
    """Rows (kernel, Triton ms, Gluon ms, GFLOP, the largest difference of Gluon's outputs from Triton's relative to
    their largest value) of one shape's fused forward, dQ and dK/dV kernels, the backward for a random dO of the
    gated output and random gates; and cuDNN's forward ms, backward ms and forward GFLOP on the same q, k, v
    (`time_cudnn`). GFLOP as the Triton kernels walk it: per (row, key) of the causal prefix 2 * D FLOPs a product,
    and in the forward the window's keys one more (P_w V)."""
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, T, H * G, D, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(q.shape, device="cuda", generator=gen).bfloat16()
    gates = torch.rand(*q.shape[:3], 2, device="cuda", generator=gen)
    bits = chosen_bits(random_block_indices(B, H, T, N_SEL, BS, "cuda"))
    scale = D**-0.5

    def fwd_outputs() -> dict[str, Tensor]:
        lse_slc, lse_win = (q.new_full(q.shape[:3], float("nan"), dtype=torch.float32) for _ in range(2))
        return dict(o_slc=torch.full_like(q, float("nan")), o_win=torch.full_like(q, float("nan")), lse_slc=lse_slc,
                    lse_win=lse_win)

    def rel(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:  # NaN where Gluon left a value unwritten
        return max(float((got[n].float() - want[n].float()).abs().max() / want[n].float().abs().max())
                   for n in want)

    out_t, out_g = fwd_outputs(), fwd_outputs()
    triton_fwd(q, k, v, bits, None, BS, window, scale, **out_t)
    grads = dict(do=do, lse_slc=gated_lse(out_t["lse_slc"], gates[..., 0]),
                 lse_win=gated_lse(out_t["lse_win"], gates[..., 1]),
                 delta_slc=softmax_delta(out_t["o_slc"], do, None), delta_win=softmax_delta(out_t["o_win"], do, None))
    dq_t, dq_g = torch.empty_like(q), torch.full_like(q, float("nan"))
    dk_t, dv_t = torch.empty_like(k), torch.empty_like(v)
    dk_g, dv_g = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    t = torch.arange(T, dtype=torch.float64)
    pairs = B * H * G * float((t + 1).sum()), B * H * G * float(torch.clamp(t + 1, max=window).sum())
    bench = triton.testing.do_bench
    rows = []
    for kernel, run_triton, run_gluon, want, got, flops in [
            ("forward", lambda: triton_fwd(q, k, v, bits, None, BS, window, scale, **out_t),
             lambda: gluon_fwd(q, k, v, bits, None, window, scale, **out_g), out_t, out_g, 2 * pairs[0] + pairs[1]),
            ("dQ", lambda: triton_bwd_dq(q, k, v, bits, None, BS, window, scale, **grads, dq=dq_t),
             lambda: gluon_bwd_dq(q, k, v, bits, None, window, scale, **grads, dq=dq_g), dict(dq=dq_t),
             dict(dq=dq_g), 3 * pairs[0]),
            ("dK/dV", lambda: triton_bwd_dkdv(q, k, v, bits, None, BS, window, scale, **grads, dk=dk_t, dv=dv_t),
             lambda: gluon_bwd_dkdv(q, k, v, bits, None, window, scale, **grads, dk=dk_g, dv=dv_g),
             dict(dk=dk_t, dv=dv_t), dict(dk=dk_g, dv=dv_g), 4 * pairs[0])]:
        run_triton()
        run_gluon()
        rows.append((kernel, bench(run_triton), bench(run_gluon), 2 * D * flops / 1e9, rel(got, want)))
    return rows, (*time_cudnn(q, k, v, do), 2 * 2 * D * pairs[0] / 1e9)


def time_cudnn(q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> tuple[float, float]:
    """(forward ms, backward ms) of cuDNN's dense causal attention (SDPA, K/V repeated to the query heads) on q, k, v
    [B, T, heads, D] and the output gradient do: the rate the sweep's kernels walk the same causal prefix against.
    Backward FLOPs are 2.5x the forward's (S recomputed, dP, dV, dK, dQ)."""
    sdpa, leaves = dense_causal(q, k, v, SDPBackend.CUDNN_ATTENTION)
    out = sdpa()
    do = do.transpose(1, 2).contiguous()  # the heads-first layout of SDPA's output
    forward = triton.testing.do_bench(sdpa)
    backward = triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    return forward, backward


def bench_fused() -> None:
    print("fused selected + window kernels (error: Gluon's outputs against Triton's, relative to the largest); "
          "cuDNN: dense causal attention on the same shape, its backward against dQ + dK/dV")
    print(f"{'shape':<18} {'G':>2} {'D':>4} {'kernel':<8} {'triton ms':>10} {'gluon ms':>9} {'speedup':>8} "
          f"{'triton TF/s':>12} {'gluon TF/s':>11} {'error':>8} {'cuDNN ms':>9} {'cuDNN TF/s':>11}")
    for label, B, T, H, G, D, window in FUSED_SHAPES:
        rows, (cudnn_fwd, cudnn_bwd, gflop_fwd) = time_fused(B, T, H, G, D, window)
        for kernel, ms_triton, ms_gluon, gflop, error in rows:
            print(f"{label:<18} {G:>2} {D:>4} {kernel:<8} {ms_triton:>10.3f} {ms_gluon:>9.3f} "
                  f"{ms_triton / ms_gluon:>7.2f}x {gflop / ms_triton:>12.1f} {gflop / ms_gluon:>11.1f} {error:>8.1e}")
        gluon_bwd = sum(ms_gluon for kernel, _, ms_gluon, _, _ in rows if kernel != "forward")
        for kernel, ms, gflop, gluon in (("forward", cudnn_fwd, gflop_fwd, rows[0][2]),
                                         ("backward", cudnn_bwd, 2.5 * gflop_fwd, gluon_bwd)):
            print(f"{label:<18} {G:>2} {D:>4} {kernel:<8} {'':>10} {gluon:>9.3f} {ms / gluon:>7.2f}x {'':>12} "
                  f"{'':>11} {'':>8} {ms:>9.3f} {gflop / ms:>11.1f}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:2])
