"""Attention-core timings at the kernel benchmark shape of NSA_SPEC.md: B=1, HQ=64, H=4, D=128, bf16, CUDA.

    python bench/attention.py                       # T = 8k, 16k, 32k, 64k
    python bench/attention.py --seq-lens 8192 16384

Rows, milliseconds (medians of triton.testing.do_bench), forward and forward+backward:
- `selected (triton)`: our selected-block attention alone, n=16 blocks of l'=64 per query (block 0, the two most
  recent and random others);
- `NSA triton backend`: the whole core at 32/16/64/16/512 (compressed branch and top-n as the reference computes
  them, selected attention, FlexAttention window, gating); compressed keys/values are inputs (phi excluded);
- dense causal baselines: SDPA flash and cuDNN (K/V expanded to HQ heads), compiled FlexAttention (GQA).
`oom` marks a row that ran out of memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nsa_models.args import NSAArgs  # noqa: E402
from nsa_models.nsa.reference import num_cmp_blocks  # noqa: E402
from nsa_models.nsa.triton_backend import nsa_triton  # noqa: E402
from nsa_models.nsa.triton_selected import selected_attention  # noqa: E402


def random_block_indices(B: int, H: int, T: int, n: int, block: int, device: torch.device | str) -> Tensor:
    """Valid selections [B, H, T, n]: block 0 and the two most recent blocks, random older ones, -1 padding."""
    n_blocks = triton.cdiv(T, block)
    current = (torch.arange(T, device=device) // block)[:, None]
    j = torch.arange(n_blocks, device=device)
    score = torch.rand(B, H, T, n_blocks, device=device)
    score = score.masked_fill((j == 0) | (j == current) | (j == current - 1), 2.0).masked_fill(j > current, -1.0)
    top = score.topk(min(n, n_blocks), dim=-1)
    idx = torch.where(top.values < 0, -1, top.indices)
    return F.pad(idx, (0, n - idx.shape[-1]), value=-1)


def time_ms(fn, grad_inputs: list[Tensor]) -> tuple[str, str]:
    """Median forward and forward+backward milliseconds of fn() (a tensor function of grad_inputs)."""
    try:
        fwd = triton.testing.do_bench(fn)
        cotangent = torch.randn_like(fn())
        fwd_bwd = triton.testing.do_bench(lambda: fn().backward(cotangent), grad_to_none=grad_inputs)
        return f"{fwd:.2f}", f"{fwd_bwd:.2f}"
    except torch.OutOfMemoryError:
        return "oom", "oom"
    finally:
        for x in grad_inputs:
            x.grad = None
        torch.cuda.empty_cache()


def bench_length(T: int, B: int, HQ: int, H: int, D: int) -> list[tuple[str, str, str]]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    nsa = NSAArgs(cmp_block_size=32, cmp_stride=16, sel_block_size=64, n_selected=16, window_size=512)
    rows = []

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = randn(B, T, HQ, D), randn(B, T, H, D), randn(B, T, H, D)
    idx = random_block_indices(B, H, T, nsa.n_selected, nsa.sel_block_size, device)
    rows.append(("selected (triton)",
                 *time_ms(lambda: selected_attention(q, k, v, idx, nsa.sel_block_size), [q, k, v])))

    n_cmp = num_cmp_blocks(T, nsa.cmp_block_size, nsa.cmp_stride)
    k_cmp, v_cmp = randn(B, n_cmp, H, D), randn(B, n_cmp, H, D)
    gates = torch.rand(B, T, HQ, 3, device=device, dtype=dtype, requires_grad=True)
    rows.append(("NSA triton backend", *time_ms(lambda: nsa_triton(q, k, v, k, v, k_cmp, v_cmp, gates, nsa)[0],
                                                [q, k, v, k_cmp, v_cmp, gates])))
    del k_cmp, v_cmp, gates, idx

    qh, kh, vh = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))  # [B, heads, T, D]
    ke, ve = (x.detach().repeat_interleave(HQ // H, dim=1).requires_grad_() for x in (kh, vh))
    for name, backend in (("SDPA flash (dense)", SDPBackend.FLASH_ATTENTION),
                          ("SDPA cuDNN (dense)", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, ke, ve, is_causal=True)
        rows.append((name, *time_ms(sdpa, [qh, ke, ve])))
    del ke, ve

    causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device=device, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    rows.append(("FlexAttention (dense)",
                 *time_ms(lambda: flex(qh, kh, vh, block_mask=causal, enable_gqa=True), [qh, kh, vh])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/attention.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B={args.batch} HQ={args.heads} H={args.kv_heads} D={args.head_dim} bf16, ms fwd / fwd+bwd")
    print("| T | kernel | fwd | fwd+bwd |\n|---|---|---|---|", flush=True)
    for T in args.seq_lens:
        for name, fwd, fwd_bwd in bench_length(T, args.batch, args.heads, args.kv_heads, args.head_dim):
            print(f"| {T} | {name} | {fwd} | {fwd_bwd} |", flush=True)


if __name__ == "__main__":
    main()
