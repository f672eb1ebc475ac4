"""FlexAttention as the model's attention code calls it, from compiled and eager code alike, and the BlockMask of
packed documents."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention


@functools.cache
def _compiled_flex_attention():
    """flex_attention is only fused (and memory-lean) when compiled; compile it once, on first use."""
    return torch.compile(flex_attention, dynamic=False)


def flex(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """flex_attention(q, k, v, **kwargs): traced into the caller's graph inside torch.compile; eager callers (an
    uncompiled model or benchmark) take the compiled one, as the unfused one materialises the T x T scores."""
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return attend(q, k, v, **kwargs)


FLEX_BLOCK = 128  # FlexAttention's default tile: queries and keys per block of a BlockMask


def document_block_mask(doc_start: Tensor, window: int | None = None) -> BlockMask:
    """FlexAttention BlockMask of keys lo .. t for each query t of packed documents: lo = doc_start[b, t], or with a
    window max(doc_start[b, t], t - window + 1). A query block's rows see keys from their lowest lo to their last
    row (some pair visible: a partial block unless full), and every key of a block from their highest lo to their
    first row (full): O(B (T/128)^2) work and memory, where create_block_mask evaluates all B T^2 pairs. As
    doc_start never decreases along a row, the blocks are exactly those that create_block_mask finds."""
    B, T = doc_start.shape
    n = -(-T // FLEX_BLOCK)
    lo = torch.cat([doc_start, doc_start[:, -1:].expand(B, n * FLEX_BLOCK - T)], 1)  # padding rows: the last doc
    if window is not None:
        lo = torch.maximum(lo, torch.arange(n * FLEX_BLOCK, device=doc_start.device) - (window - 1))
    lo = lo.view(B, n, FLEX_BLOCK)
    lowest, highest = lo.amin(-1)[..., None], lo.amax(-1)[..., None]  # [B, Nq, 1]
    first_key = torch.arange(n, device=doc_start.device) * FLEX_BLOCK
    first_row = first_key[:, None]  # [Nq, 1]
    some = (first_key <= first_row + FLEX_BLOCK - 1) & (first_key + FLEX_BLOCK - 1 >= lowest)
    every = (first_key + FLEX_BLOCK - 1 <= first_row) & (first_key >= highest)

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (kv_idx >= doc_start[b, q_idx])

    def document_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    return BlockMask.from_kv_blocks(*_ordered(some & ~every), *_ordered(every), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=document_causal if window is None else document_window,
                                    seq_lengths=(T, T))


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """[B, Nq, Nkv] bool -> a BlockMask's (count [B, 1, Nq], indices [B, 1, Nq, Nkv]) of the True blocks, in order."""
    blocks = blocks.to(torch.int32)
    order = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


class BlockMaskStorage:
    """Each batch's BlockMask copied into the tensors of the last one of the same shapes, which so keep their
    addresses from batch to batch.

    Why: CUDA graphs (compile modes reduce-overhead / max-autotune) take the tensors that a compiled block's backward
    gets from its forward as static inputs, and record the graph again whenever one of them moves. A BlockMask's
    query-side tensors, read by FlexAttention's backward only, are passed through as they come: built anew for each
    batch of packed documents, they made the graphs record again at every step (nsa-125m with documents at 8k on an
    H200: 899 ms a step against 91 ms of GPU work). The cost: a forward's mask holds until the next forward of the
    same shapes, which is a trainer's order (each micro-batch's backward before the next forward)."""

    def __init__(self) -> None:
        self._tensors: dict[tuple, Tensor] = {}

    def keep(self, mask: BlockMask) -> BlockMask:
        """`mask`, its tensors swapped for the kept ones (of the same attribute and shape) after copying into them."""
        for name, value in vars(mask).items():
            if isinstance(value, Tensor):
                key = (name, value.shape, value.dtype, value.device)
                if key not in self._tensors:
                    self._tensors[key] = torch.empty_like(value)
                setattr(mask, name, self._tensors[key].copy_(value))
        return mask
