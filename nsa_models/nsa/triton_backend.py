"""The `triton` NSA backend: Triton selected-block attention, library kernels for the window.

Same contract as `nsa_reference`. Branches:
- compressed attention and top-n selection: the reference's PyTorch code, query chunk by query chunk (so the
  selected blocks are the reference's, bit for bit, on the same inputs);
- selected attention: `triton_selected.selected_attention` (custom op, deterministic backward);
- sliding window: FlexAttention (`window_backend = "flex"`), masked SDPA (`"sdpa"`) or flash-attn (`"flash_attn"`).
  FlexAttention has no CPU backward, so CPU tensors (Triton interpreter tests) always take the SDPA path.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from nsa_models.args import NSAArgs
from nsa_models.nsa.reference import compressed_branch, select_blocks
from nsa_models.nsa.triton_selected import selected_attention


def _compressed_chunk(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, start: int, args: NSAArgs) -> tuple[Tensor, Tensor]:
    """The reference's compressed branch, with p_cmp detached (it only feeds the selection)."""
    o_cmp, p_cmp = compressed_branch(q, k_cmp, v_cmp, start, args)
    return o_cmp, p_cmp.detach()


def _compressed_and_selection(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, args: NSAArgs,
                              block_indices: Tensor | None) -> tuple[Tensor, Tensor]:
    """Compressed-branch output [B, T, HQ, D] and block indices [B, H, T, n], computed as the reference does.

    Each query chunk is checkpointed: its [C, Nc] probabilities are recomputed in backward instead of being kept
    for all T queries (O(T * Nc * HQ) memory, 64k tokens would not fit).
    """
    B, T, HQ, D = q.shape
    H = k_cmp.shape[2]
    qh = q.view(B, T, H, HQ // H, D).permute(0, 2, 3, 1, 4)  # [B, H, G, T, D], the reference's layout
    k_cmp, v_cmp = k_cmp.transpose(1, 2), v_cmp.transpose(1, 2)  # [B, H, Nc, D]
    outs, indices = [], []
    for start in range(0, T, args.query_chunk):
        end = min(T, start + args.query_chunk)
        o_cmp, p_cmp = checkpoint(_compressed_chunk, qh[:, :, :, start:end], k_cmp, v_cmp, start, args,
                                  use_reentrant=False)
        outs.append(o_cmp)
        if block_indices is None:
            indices.append(select_blocks(p_cmp, start, T, args.cmp_block_size, args.cmp_stride,
                                         args.sel_block_size, args.n_selected))
    o_cmp = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    if block_indices is None:
        block_indices = torch.cat(indices, dim=2) if len(indices) > 1 else indices[0]
    return o_cmp.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D), block_indices


@functools.cache
def _compiled_flex():
    """flex_attention is only fused (and memory-lean) when compiled; compile it once, on first use."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _window_block_mask(seq_len: int, window: int, device: str, compile_mask: bool = True):
    """FlexAttention block mask of keys t-w+1 .. t (built by a compiled kernel outside torch.compile)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(sliding_window, None, None, seq_len, seq_len, device=device, _compile=compile_mask)


_cached_window_block_mask = functools.lru_cache(maxsize=8)(_window_block_mask)


def _window(q: Tensor, k: Tensor, v: Tensor, args: NSAArgs) -> Tensor:
    """Sliding-window attention over keys t-w+1 .. t; [B, T, HQ, D]."""
    T, w = q.shape[1], args.window_size
    if args.window_backend == "flash_attn":
        try:
            from flash_attn import flash_attn_func
        except ImportError as e:
            raise ImportError("model.nsa.window_backend = 'flash_attn' needs the flash-attn package "
                              "(pip install flash-attn); or set it to 'flex' or 'sdpa'") from e
        return flash_attn_func(q, k, v, causal=True, window_size=(w - 1, 0))
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if args.window_backend == "flex" and q.is_cuda:
        if torch.compiler.is_compiling():  # inside torch.compile: traced into the caller's graph, no caches
            from torch.nn.attention.flex_attention import flex_attention

            block_mask = _window_block_mask(T, w, str(q.device), compile_mask=False)
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        else:
            block_mask = _cached_window_block_mask(T, w, str(q.device))
            out = _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)
    else:
        t = torch.arange(T, device=q.device)
        mask = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < w)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


def nsa_triton(q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, k_cmp: Tensor,
               v_cmp: Tensor, gates: Tensor, args: NSAArgs,
               block_indices: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gated sum of the three NSA branches. Returns (out [B, T, HQ, D], block indices [B, H, T, n])."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.nsa.backend = 'triton' needs a CUDA device; use backend = 'reference' on CPU")
    o_cmp, block_indices = _compressed_and_selection(q, k_cmp, v_cmp, args, block_indices)
    o_slc = selected_attention(q, k_slc, v_slc, block_indices, args.sel_block_size)
    o_win = _window(q, k_win, v_win, args)
    g = gates.to(q.dtype).unsqueeze(-1)
    out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return out, block_indices
